"""all_reduce_coalesced of a model's gradients against its two alternatives, side by side in one run.

    python -m collective.bench.coalesced [--rounds 3] [--iters 200] [--procs 2]

``--procs`` processes (torchrun's variables, ``col.init()``: on one host the shared-memory path)
hold the 26 gradients of a 12 x Linear(128, 128) MLP with its head (0.76 MiB of float32) and
time, taking turns call by call after a barrier, each with a new result per call:

* ``coalesced``: one ``all_reduce_coalesced`` of the 26 arrays;
* ``one array``: one ``all_reduce`` of the same bytes as one array (the floor);
* ``separate``: 26 ``all_reduce`` calls, one per array (the trap coalescing avoids).

A figure is the median over iterations of rank 0's time, per round. The targets: coalesced at
most 1.2 x one array, and at most 0.3 x separate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import collective as col
from collective.launch import free_port, stop_processes

SHAPES = [(128, 128), (128,)] * 12 + [(10, 128), (10,)]
VARIANTS = ("coalesced", "one array", "separate")


def worker(iters: int) -> dict[str, float]:
    """One process: microseconds per variant (medians over ``iters`` calls each)."""
    peer = col.init()
    grads = [np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32) for shape in SHAPES]
    flat = np.concatenate([grad.reshape(-1) for grad in grads])
    runs: dict[str, Callable[[], Any]] = {
        "coalesced": lambda: col.all_reduce_coalesced(peer, grads),
        "one array": lambda: col.all_reduce(peer, flat),
        "separate": lambda: [col.all_reduce(peer, grad) for grad in grads],
    }
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for name in VARIANTS:  # warm up: pool blocks, shared-memory channels, agreements
        for _ in range(5):
            runs[name]()
    for _ in range(iters):
        for name in VARIANTS:
            col.barrier(peer)
            started = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - started)
    expected = np.asarray(col.all_reduce(peer, flat))
    got = np.concatenate([np.asarray(r).reshape(-1) for r in col.all_reduce_coalesced(peer, grads)])
    col.finish(peer)
    if not np.array_equal(got, expected):
        raise SystemExit("all_reduce_coalesced differs from all_reduce of the same bytes")
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def run_round(procs: int, iters: int) -> dict[str, float]:
    """``worker`` in ``procs`` processes started the way torchrun starts them; rank 0's figures."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    port = free_port()
    argv = [sys.executable, "-m", "collective.bench.coalesced", "--worker", "--iters", str(iters)]
    started = [
        subprocess.Popen(
            argv,
            env=dict(env, RANK=str(r), WORLD_SIZE=str(procs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(procs)
    ]
    try:
        out, _ = started[0].communicate(timeout=300)
        for process in started[1:]:
            process.wait(60)
    finally:
        stop_processes(started)
    if started[0].returncode:
        raise SystemExit(f"rank 0 failed (exit {started[0].returncode})")
    return dict(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collective.bench.coalesced", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.iters)), flush=True)
        return 0
    mib = sum(int(np.prod(shape)) for shape in SHAPES) * 4 / 2**20
    print(
        f"# coalesced: {args.procs} processes, {len(SHAPES)} float32 arrays ({mib:.2f} MiB), "
        f"{args.rounds} rounds x {args.iters} calls, median us per call (rank 0)"
    )
    print(
        f"{'round':>5} {'coalesced':>10} {'one array':>10} {'separate':>10} {'x one':>7} {'x separate':>11}"
    )
    ratios_one, ratios_separate = [], []
    for round_ in range(args.rounds):
        figures = run_round(args.procs, args.iters)
        one, separate = (
            figures["coalesced"] / figures["one array"],
            figures["coalesced"] / figures["separate"],
        )
        ratios_one.append(one)
        ratios_separate.append(separate)
        print(
            f"{round_:>5} {figures['coalesced']:>10.1f} {figures['one array']:>10.1f} "
            f"{figures['separate']:>10.1f} {one:>6.2f}x {separate:>6.2f}x"
        )
    one, separate = statistics.median(ratios_one), statistics.median(ratios_separate)
    print(f"# target coalesced <= 1.2 x one array: {'met' if one <= 1.2 else 'NOT met'} ({one:.2f})")
    print(f"# target coalesced <= 0.3 x separate: {'met' if separate <= 0.3 else 'NOT met'} ({separate:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
