"""Direct calls with JAX arrays (tests/jax_worker.py, in a process of its own per check): the
pytree recipe of docs/frameworks.md, every collective, and out= refused. JAX is optional (and
large): these skip where it is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="JAX is not installed")
WORKER = str(Path(__file__).with_name("jax_worker.py"))


@pytest.mark.parametrize("check", ["pytrees", "every_collective", "out_refused", "training"])
def test_jax(check: str) -> None:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}  # (two host devices)
    result = subprocess.run(
        [sys.executable, WORKER, check], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0 and f"OK {check}" in result.stdout, result.stdout + result.stderr
