"""What a small collective among thread peers costs here, against the least any could cost.

    python -m collective.bench.studies.thread_floor [--peers 4] [--calls 3000] [--rounds 3]

``--peers`` threads of this process call an 8 B float32 all_reduce back to back, each of these
ways, and each reports wall and CPU time (``time.thread_time``) per call, the slowest peer's:

* ``floor``: the least a one-wake-up collective can do in Python: a counter under a lock; the
  last peer to arrive sums the inputs and releases one lock per waiting peer (one wake-up each);
* ``recorded``: the floor with the least that the always-on flight recorder and a timeout add to
  a call: the caller looked up (``trace.caller``), two clock reads, one entry appended to a ring
  (dropped in batches, never tallied: less than the recorder does), a wait with a deadline. No
  check of the call, no agreement, no failure ever detected: what no collective goes under;
* ``trivial``: the reference baseline's schedule (../shared/reference-bench): two
  ``threading.Barrier`` waits per call;
* ``ours``: ``Runtime.all_reduce`` with ``out=`` (the Fused executor: one wake-up per waiting peer);
* ``persistent``: the same all_reduce made once (``Runtime.all_reduce_init``), each call one use.

The gap between ``ours`` and ``floor`` is the part of our time that is neither numpy nor the
wake-ups themselves: the per-call Python path, which every GIL hand-off between peers waits for.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from collective.config import CollectiveConfig
from collective.runtime import Runtime
from collective.trace import CLOCK, caller

__all__ = ["main", "measure"]

Loop = Callable[[int], None]
WAIT = 300.0  # seconds any peer waits for the others at a barrier of its own (then BrokenBarrierError)


def _timed(peers: int, loop: Loop, setup: Loop | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds of the slowest peer's ``loop(rank)``, after every ``setup(rank)``."""
    times: dict[int, tuple[float, float]] = {}
    start = threading.Barrier(peers, timeout=WAIT)

    def run(rank: int) -> None:
        if setup is not None:
            setup(rank)
        start.wait()
        cpu, wall = time.thread_time(), time.perf_counter()
        loop(rank)
        times[rank] = (time.perf_counter() - wall, time.thread_time() - cpu)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(peers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return max(w for w, _ in times.values()), max(c for _, c in times.values())


def floor(peers: int, calls: int, recorded: bool = False) -> tuple[float, float]:
    lock, bells = threading.Lock(), [threading.Lock() for _ in range(peers)]
    for bell in bells:
        bell.acquire()
    arrived = [0]
    inputs = [np.ones(2, np.float32) for _ in range(peers)]
    outputs = [np.empty(2, np.float32) for _ in range(peers)]
    results: list[np.ndarray] = [inputs[0]] * peers
    ring: list[tuple[Any, ...]] = []  # (the recorder's entries)
    members, kind, path, state = tuple(range(peers)), "all_reduce", "fused", "completed"

    def use(rank: int) -> None:
        wait = -1.0  # (no deadline)
        if recorded:  # what the recorder and a timeout add
            origin = caller(2)
            created = CLOCK()
            wait = created * 1e-9 + 60.0 - time.monotonic()
        with lock:
            arrived[0] += 1
            last = arrived[0] == peers
            if last:
                arrived[0] = 0
                total = inputs[0].copy()
                for other in inputs[1:]:
                    np.add(total, other, out=total)
                results[:] = [total] * peers
        if last:
            for waiter, bell in enumerate(bells):
                if waiter != rank:
                    bell.release()
        else:
            bells[rank].acquire(timeout=wait)
        outputs[rank][...] = results[rank]
        if recorded:
            done = CLOCK()
            ring.append(
                (rank, members, 0, kind, origin, None, path, None, state, created, created, done, None)
            )
            if len(ring) >= 4000:
                del ring[:2000]

    def loop(rank: int) -> None:
        for _ in range(calls):
            use(rank)

    wall, cpu = _timed(peers, loop)
    return wall / calls * 1e6, cpu / calls * 1e6


def trivial(peers: int, calls: int) -> tuple[float, float]:
    barrier = threading.Barrier(peers)  # (as the reference baseline waits: no timeout)
    inputs = [np.ones(2, np.float32) for _ in range(peers)]
    outputs = [np.empty(2, np.float32) for _ in range(peers)]
    result = np.empty(2, np.float32)

    def loop(rank: int) -> None:
        for _ in range(calls):
            barrier.wait()
            if rank == 0:
                np.copyto(result, inputs[0])
                for other in inputs[1:]:
                    np.add(result, other, out=result)
            barrier.wait()
            np.copyto(outputs[rank], result)

    wall, cpu = _timed(peers, loop)
    return wall / calls * 1e6, cpu / calls * 1e6


def ours(peers: int, calls: int, persistent: bool = False) -> tuple[float, float]:
    with Runtime() as runtime:
        config = CollectiveConfig(num_devices=peers, timeout=120)
        x, out = np.ones(2, np.float32), [np.empty(2, np.float32) for _ in range(peers)]
        uses: list[Any] = [None] * peers

        def setup(rank: int) -> None:
            runtime.register(rank, "cpu", config)  # (returns once every peer registered)
            made = runtime.all_reduce_init(rank, x, out=out[rank]) if persistent else None
            uses[rank] = made or partial(runtime.all_reduce, rank, x, out=out[rank])
            for _ in range(20):
                uses[rank]()

        def loop(rank: int) -> None:
            use = uses[rank]
            for _ in range(calls):
                use()

        wall, cpu = _timed(peers, loop, setup)
    return wall / calls * 1e6, cpu / calls * 1e6


WAYS: dict[str, Callable[[int, int], tuple[float, float]]] = {
    "floor": floor,
    "recorded": partial(floor, recorded=True),
    "trivial": trivial,
    "ours": ours,
    "persistent": partial(ours, persistent=True),
}


def measure(peers: int, calls: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """Per way, one (wall, CPU) figure per round; the ways take turns."""
    found: dict[str, list[tuple[float, float]]] = {name: [] for name in WAYS}
    for _ in range(rounds):
        for name, way in WAYS.items():
            found[name].append(way(peers, calls))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3000, help="calls per round and way")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    found = measure(args.peers, args.calls, args.rounds)
    print(f"# {args.peers} thread peers, 8 B all_reduce back to back; medians of {args.rounds} rounds")
    print(f"{'way':>10} {'wall us':>9} {'CPU us':>8} {'x floor':>8} {'x trivial':>10}")
    base = statistics.median(w for w, _ in found["floor"])
    trivial_wall = statistics.median(w for w, _ in found["trivial"])
    for name, figures in found.items():
        wall, cpu = statistics.median(w for w, _ in figures), statistics.median(c for _, c in figures)
        print(f"{name:>10} {wall:>9.1f} {cpu:>8.1f} {wall / base:>7.2f}x {wall / trivial_wall:>9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
