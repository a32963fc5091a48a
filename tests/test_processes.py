"""The tests' own process helpers (tests/processes.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.processes import reaping_orphans


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux's")
def test_a_process_orphaned_inside_the_block_is_ended_and_reaped_at_its_end() -> None:
    with reaping_orphans(grace=2.0):
        started = subprocess.run(
            ["sh", "-c", "sleep 60 > /dev/null 2>&1 & echo $!"], capture_output=True, text=True, timeout=10
        )
        orphan = int(started.stdout)  # (its parent, the shell, has ended: it is this process's now)
        os.kill(orphan, 0)  # running
    with pytest.raises(ProcessLookupError):
        os.kill(orphan, 0)
