"""Run a benchmark module as ranks of one torch.distributed job on this host (torchrun's variables)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from collective.launch import free_port

__all__ = ["run_ranks"]


def run_ranks(module: str, argv: Sequence[str], ranks: int) -> int:
    """``python -m module *argv --worker`` as ``ranks`` processes meeting on a free port; the
    highest exit status (every process is stopped and reaped however this ends)."""
    port = free_port()
    processes = []
    try:
        for rank in range(ranks):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(ranks),
                "LOCAL_WORLD_SIZE": str(ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            }
            processes.append(subprocess.Popen([sys.executable, "-m", module, *argv, "--worker"], env=env))
        return max(process.wait() for process in processes)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
