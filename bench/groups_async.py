"""Groups and asynchronous work, measured side by side in one run (medians).

    python -m collective.bench.groups_async [--rounds 5] [--iters 300]

1. Groups: 4 thread peers in two groups of 2 running 8 B all_reduces at the same time, against a
   lone job of 2 thread peers doing the same (time per call, per group); and the same for the bare
   least any Python threads can do (a lock and a bell per peer), which shows what the interpreter's
   one lock (the GIL) costs four threads on this machine's cores, whatever the runtime.
2. Overlap: 2 processes started with torchrun's variables through ``col.init()``: a 1 MiB
   all_reduce alone, a 5 ms numpy computation alone, and the all_reduce started with
   ``async_op=True``, the computation, then ``wait()``: that over the longer of the two.
3. ``init()`` against an explicit config: 8 B and 64 MiB all_reduce between 2 processes, the job
   made by ``init()`` from torchrun's variables or by a hand-written ``CollectiveConfig``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

import collective as col
from collective.bench.trivial import BareAllReduce
from collective.launch import free_port, start_orchestrator, stop_processes

COMPUTE_MS = 5.0


def _per_call(run: Any, peers: list[int], iters: int) -> float:
    """Microseconds per call, the slowest peer's, with every peer in its own thread."""
    times: dict[int, float] = {}

    def body(peer: int) -> None:
        run(peer)  # warm up
        started = time.perf_counter()
        for _ in range(iters):
            run(peer)
        times[peer] = (time.perf_counter() - started) / iters * 1e6

    threads = [threading.Thread(target=body, args=(p,)) for p in peers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return max(times.values())


def groups(iters: int) -> tuple[float, float]:
    """(µs per 8 B all_reduce of two concurrent groups of 2 among 4 peers, of a lone 2-peer job)."""
    x = np.ones(2, np.float32)
    with col.Runtime() as rt:
        config = col.CollectiveConfig(num_devices=4, timeout=60)
        joined = [threading.Thread(target=rt.register, args=(p, "cpu", config)) for p in range(4)]
        for thread in joined:
            thread.start()
        for thread in joined:
            thread.join(60)
        pairs = {
            0: col.new_group([0, 1]),
            1: col.new_group([0, 1]),
            2: col.new_group([2, 3]),
            3: col.new_group([2, 3]),
        }
        concurrent = _per_call(lambda p: rt.all_reduce(p, x, group=pairs[p]), [0, 1, 2, 3], iters)
    with col.Runtime() as rt:
        config = col.CollectiveConfig(num_devices=2, timeout=60)
        joined = [threading.Thread(target=rt.register, args=(p, "cpu", config)) for p in range(2)]
        for thread in joined:
            thread.start()
        for thread in joined:
            thread.join(60)
        lone = _per_call(lambda p: rt.all_reduce(p, x), [0, 1], iters)
    return concurrent, lone


def bare_groups(iters: int) -> tuple[float, float]:
    """``groups`` for ``BareAllReduce`` pairs: (two pairs at once, a lone pair), µs per call."""
    x = np.ones(2, np.float32)
    pairs = {0: BareAllReduce(2), 2: BareAllReduce(2)}
    concurrent = _per_call(lambda p: pairs[p & 2].all_reduce(p & 1, x), [0, 1, 2, 3], iters)
    lone = BareAllReduce(2)
    return concurrent, _per_call(lambda p: lone.all_reduce(p, x), [0, 1], iters)


def _compute(ms: float) -> None:
    """About ``ms`` milliseconds of numpy work that releases the GIL (matrix products)."""
    a = np.random.default_rng(0).standard_normal((160, 160))
    deadline = time.perf_counter() + ms / 1000
    while time.perf_counter() < deadline:
        a = np.tanh(a @ a.T / 160)


def worker(mode: str, iters: int) -> dict[str, float]:
    """One process: the measurements of ``mode`` ("init" or "config"), medians in microseconds."""
    if mode == "init":
        peer = col.init()
    else:
        peer = int(os.environ["PEER"])
        col.register(peer, "cpu", col.CollectiveConfig.from_env(timeout=60))
    small, big, grad = np.ones(2, np.float32), np.ones(16 << 20, np.float32), np.ones(1 << 18, np.float32)
    out_big = np.empty_like(big)
    result: dict[str, float] = {}
    for name, x, out, n in (("8B", small, None, iters), ("64MiB", big, out_big, 5)):
        times = []
        col.all_reduce(peer, x, out=out)
        for _ in range(n):
            col.barrier(peer)
            started = time.perf_counter()
            col.all_reduce(peer, x, out=out)
            times.append(time.perf_counter() - started)
        result[name] = statistics.median(times) * 1e6
    if mode == "init":
        alone, compute, both = [], [], []
        for _ in range(20):
            col.barrier(peer)
            started = time.perf_counter()
            col.all_reduce(peer, grad)
            alone.append(time.perf_counter() - started)
            started = time.perf_counter()
            _compute(COMPUTE_MS)
            compute.append(time.perf_counter() - started)
            col.barrier(peer)
            started = time.perf_counter()
            work = col.all_reduce(peer, grad, async_op=True)
            _compute(COMPUTE_MS)
            work.wait()
            both.append(time.perf_counter() - started)
        result.update(
            alone=statistics.median(alone) * 1e6,
            compute=statistics.median(compute) * 1e6,
            both=statistics.median(both) * 1e6,
        )
    col.finish(peer)
    return result


def processes(mode: str, iters: int) -> dict[str, float]:
    """Run ``worker(mode)`` in 2 processes; rank 0's figures."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for several processes of a host:
    # each process's BLAS threads would otherwise spin on both cores, the other's collective starved
    orchestrator = None
    if mode == "init":
        port = free_port()
        envs = [
            dict(env, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            for r in range(2)
        ]
    else:
        orchestrator, address = start_orchestrator()
        envs = [
            dict(
                env,
                COLLECTIVE_NUM_DEVICES="1",
                COLLECTIVE_NUM_NODES="2",
                COLLECTIVE_GLOBAL_ADDRESS=address,
                COLLECTIVE_NODE_ADDRESS="127.0.0.1:0",
                COLLECTIVE_DATA_SERVICE_PORT="0",
                COLLECTIVE_JOB=f"bench-{os.getpid()}",
                PEER=str(r),
            )
            for r in range(2)
        ]
    argv = [sys.executable, "-m", "collective.bench.groups_async", "--worker", mode, "--iters", str(iters)]
    procs = [subprocess.Popen(argv, env=e, stdout=subprocess.PIPE, text=True) for e in envs]
    try:
        out, _ = procs[0].communicate(timeout=300)
        procs[1].wait(60)
    finally:
        stop_processes([*procs, *([orchestrator] if orchestrator else [])])
    return dict(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collective.bench.groups_async", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--worker", choices=("init", "config"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.iters)), flush=True)
        return 0
    print(f"# groups_async: {args.rounds} rounds, medians per round; {os.cpu_count()} CPUs")
    for round_ in range(args.rounds):
        concurrent, lone = groups(args.iters)
        print(
            f"round {round_}: groups: 2 concurrent groups of 2 (of 4 peers) {concurrent:.1f} us per "
            f"8 B call, a lone 2-peer job {lone:.1f} us ({concurrent / lone:.2f}x)"
        )
        bare_concurrent, bare_lone = bare_groups(args.iters)
        print(
            f"round {round_}: groups, the bare least (a lock and a bell per peer, no checks): 2 pairs "
            f"at once {bare_concurrent:.1f} us, a lone pair {bare_lone:.1f} us "
            f"({bare_concurrent / bare_lone:.2f}x)"
        )
        by_init, by_config = processes("init", args.iters), processes("config", args.iters)
        print(
            f"round {round_}: 2 processes, 8 B: init() {by_init['8B']:.1f} us, explicit config "
            f"{by_config['8B']:.1f} us; 64 MiB: init() {by_init['64MiB'] / 1000:.1f} ms, explicit config "
            f"{by_config['64MiB'] / 1000:.1f} ms"
        )
        longer = max(by_init["alone"], by_init["compute"])
        print(
            f"round {round_}: overlap: 1 MiB all_reduce {by_init['alone'] / 1000:.2f} ms, "
            f"{COMPUTE_MS:g} ms compute {by_init['compute'] / 1000:.2f} ms, both overlapped "
            f"{by_init['both'] / 1000:.2f} ms ({by_init['both'] / longer:.2f}x the longer)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
