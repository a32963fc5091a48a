"""Running benchmark cases in child processes: our nodes (``--nodes M``) and gloo (``--compare gloo``).

Both start their processes on this machine, pass the cases as a JSON file (a command line cannot
hold thousands of cases), read ``ROW <json>`` lines from the first process and always reap every
process (also on errors and Ctrl-C).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import IO, Any

from collective.bench.sweep import Case, Row
from collective.launch import free_port, node_environment, start_orchestrator, stop_processes

__all__ = ["run_gloo", "run_nodes", "torch_available"]


def torch_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def _run_workers(
    module: str, envs: list[dict[str, str]], plan: dict[str, Any], what: str, timeout: float
) -> list[Row]:
    """``python -m module PLAN`` once per environment, the plan in a file they read; the first
    one's rows. Every worker is stopped whatever happens."""
    processes: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="collective-bench-") as scratch:
        path = os.path.join(scratch, "plan.json")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(plan, handle)
        try:
            for env in envs:
                argv = [sys.executable, "-m", module, path]
                pipe = subprocess.PIPE
                processes.append(  # (its own session: Ctrl-C reaches the bench, which stops it first)
                    subprocess.Popen(
                        argv, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True
                    )
                )
            return _collect(processes, what, timeout)
        finally:
            stop_processes(processes, groups=True)  # SIGINT first: its shared memory is removed


def _plan(
    cases: Sequence[Case], warmup: int, iters: int, timeout: float, backend: str = "gloo"
) -> dict[str, Any]:
    return {
        "cases": [asdict(c) for c in cases],
        "warmup": warmup,
        "iters": iters,
        "timeout": timeout,
        "backend": backend,
    }


def collect_lines(processes: list[subprocess.Popen[str]], what: str, timeout: float) -> list[str]:
    """The first process's stdout lines; RuntimeError with every failing process's stderr."""
    errors: dict[int, str] = {}

    def drain_errors(rank: int, stream: IO[str]) -> None:
        errors[rank] = stream.read()

    readers = [
        threading.Thread(target=drain_errors, args=(rank, p.stderr), daemon=True)
        for rank, p in enumerate(processes)
    ]
    for reader in readers:
        reader.start()
    assert processes[0].stdout is not None
    lines = list(processes[0].stdout)
    deadline = time.monotonic() + timeout
    codes = [p.wait(max(0.1, deadline - time.monotonic())) for p in processes]
    for reader in readers:
        reader.join(5)
    if any(codes):
        detail = "\n".join(
            f"[{what} {rank}] {errors.get(rank, '').strip()[-2000:]}" for rank, c in enumerate(codes) if c
        )
        raise RuntimeError(f"{what} processes failed (exit codes {codes}):\n{detail}")
    return lines


def _collect(processes: list[subprocess.Popen[str]], what: str, timeout: float) -> list[Row]:
    """Rows printed by the first process; RuntimeError with the others' stderr if any fails."""
    lines = collect_lines(processes, what, timeout)
    return [Row.from_dict(json.loads(line[4:])) for line in lines if line.startswith("ROW ")]


def run_nodes(
    cases: Sequence[Case], nodes: int, devices: int, warmup: int, iters: int, timeout: float
) -> list[Row]:
    """Time ``cases`` on ``nodes`` node processes of ``devices`` local peers each, on this machine."""
    orchestrator, address = start_orchestrator()
    job = f"bench-{os.getpid()}-{int(time.time() * 1000)}"
    try:
        envs = [node_environment(address, job, rank, nodes, devices) for rank in range(nodes)]
        plan = _plan(cases, warmup, iters, timeout)
        return _run_workers("collective.bench.node_worker", envs, plan, "node", timeout * max(1, len(cases)))
    finally:
        stop_processes([orchestrator])


def run_gloo(
    cases: Sequence[Case], world: int, warmup: int, iters: int, timeout: float, backend: str = "gloo"
) -> list[Row]:
    """Time ``cases`` through torch.distributed, one process per peer: its gloo backend, or ours
    (``backend="collective"``)."""
    port = free_port()
    envs = [
        dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            OMP_NUM_THREADS="1",
        )
        for rank in range(world)
    ]
    plan = _plan(cases, warmup, iters, timeout, backend)
    return _run_workers("collective.bench.gloo_worker", envs, plan, backend, timeout * max(1, len(cases)))
