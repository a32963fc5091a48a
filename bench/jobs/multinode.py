"""Running benchmark cases in child processes: our nodes (``--nodes M``) and gloo (``--compare gloo``).

Both start their processes on this machine, or inside emulated hosts (``--hosts H``,
collective.bench.jobs.hosts: ``per_host`` processes in each, the orchestrator and gloo's master on host
0), pass the cases as a JSON file (a command line cannot hold thousands of cases), read
``ROW <json>`` lines from the first process and always reap every process (also on errors and
Ctrl-C).
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

from collective.bench.jobs.hosts import INTERFACE, EmulatedHosts
from collective.bench.sweep import Case, Row
from collective.launch import free_port, node_environment, start_orchestrator, stop_processes

__all__ = ["run_gloo", "run_nodes", "torch_available"]


def torch_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def _run_workers(
    module: str,
    envs: list[dict[str, str]],
    plan: dict[str, Any],
    what: str,
    timeout: float,
    hosts: EmulatedHosts | None = None,
    per_host: int = 1,
) -> list[Row]:
    """``python -m module PLAN`` once per environment (inside host ``rank // per_host`` of
    ``hosts``, if given), the plan in a file they read; the first one's rows. Every worker is
    stopped whatever happens."""
    processes: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="collective-bench-") as scratch:
        path = os.path.join(scratch, "plan.json")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(plan, handle)
        try:
            for rank, env in enumerate(envs):
                argv = [sys.executable, "-m", module, path]
                if hosts is not None:
                    argv = hosts.command(rank // per_host, argv)
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
    cases: Sequence[Case],
    nodes: int,
    devices: int,
    warmup: int,
    iters: int,
    timeout: float,
    hosts: EmulatedHosts | None = None,
) -> list[Row]:
    """Time ``cases`` on ``nodes`` node processes of ``devices`` local peers each, on this machine,
    or ``nodes`` in each of the emulated ``hosts``."""
    if hosts is None:
        orchestrator, address = start_orchestrator()
    else:
        orchestrator, address = start_orchestrator(hosts.address(0), hosts.command(0, []))
    job = f"bench-{os.getpid()}-{int(time.time() * 1000)}"
    world = nodes * (1 if hosts is None else hosts.count)
    try:
        envs = [node_environment(address, job, rank, world, devices) for rank in range(world)]
        if hosts is not None:
            for rank, env in enumerate(envs):
                host = rank // nodes
                env.update(
                    COLLECTIVE_HOST_ID=f"host{host}",
                    COLLECTIVE_NODE_ADDRESS=f"{hosts.address(host)}:0",
                    MASTER_ADDR=hosts.address(0),
                )
        plan = _plan(cases, warmup, iters, timeout)
        module, limit = "collective.bench.jobs.node_worker", timeout * max(1, len(cases))
        return _run_workers(module, envs, plan, "node", limit, hosts, nodes)
    finally:
        stop_processes([orchestrator])


def run_gloo(
    cases: Sequence[Case],
    world: int,
    warmup: int,
    iters: int,
    timeout: float,
    backend: str = "gloo",
    hosts: EmulatedHosts | None = None,
) -> list[Row]:
    """Time ``cases`` through torch.distributed, one process per peer: its gloo backend, or ours
    (``backend="collective"``); with ``hosts``, ``world // hosts.count`` processes in each."""
    port = free_port()
    master = "127.0.0.1" if hosts is None else hosts.address(0)
    envs = [
        dict(
            os.environ,
            MASTER_ADDR=master,
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            OMP_NUM_THREADS="1",
        )
        for rank in range(world)
    ]
    per_host = world // (1 if hosts is None else hosts.count)
    if hosts is not None:
        for rank, env in enumerate(envs):
            env.update(GLOO_SOCKET_IFNAME=INTERFACE, COLLECTIVE_HOST_ID=f"host{rank // per_host}")
    plan = _plan(cases, warmup, iters, timeout, backend)
    module, limit = "collective.bench.jobs.gloo_worker", timeout * max(1, len(cases))
    return _run_workers(module, envs, plan, backend, limit, hosts, per_host)
