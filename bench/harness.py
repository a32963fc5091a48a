"""Timing local peers (threads): the nccl-tests / OSU method.

Before each timed call every peer passes a barrier (untimed); each peer times its own call; an
iteration's time is the slowest peer's; the reported time is the median over iterations.
After each timed call (untimed) every peer counts wrong elements in its result.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Measurement", "PeerStep", "measure_threads"]

# One peer's step: run(iteration) -> None performs the call; check(iteration) -> wrong elements.
PeerStep = tuple[Callable[[int], None], Callable[[int], int]]


@dataclass(frozen=True)
class Measurement:
    median_us: float
    min_us: float
    iterations: int
    wrong: int


def measure_threads(
    peers: int, make_step: Callable[[int], PeerStep], warmup: int, iterations: int, timeout: float = 600.0
) -> Measurement:
    """Run ``make_step(peer)`` in ``peers`` threads: ``warmup`` untimed, then ``iterations`` timed calls."""
    barrier = threading.Barrier(peers, timeout=timeout)
    times = [[0.0] * iterations for _ in range(peers)]
    wrong = [0] * peers
    failures: list[BaseException] = []

    def peer_main(peer: int) -> None:
        try:
            run, check = make_step(peer)
            for i in range(warmup):
                barrier.wait()
                run(i)
                wrong[peer] += check(i)
            for i in range(iterations):
                barrier.wait()
                started = time.perf_counter()
                run(warmup + i)
                times[peer][i] = time.perf_counter() - started
                wrong[peer] += check(warmup + i)
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:
            failures.append(exc)
            barrier.abort()

    threads = [
        threading.Thread(target=peer_main, args=(p,), name=f"bench-peer-{p}", daemon=True)
        for p in range(peers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if any(thread.is_alive() for thread in threads):
        barrier.abort()
        raise TimeoutError(f"benchmark peers still running after {timeout}s")
    if failures:
        raise failures[0]
    per_iteration = [max(times[p][i] for p in range(peers)) for i in range(iterations)]
    return Measurement(
        median_us=statistics.median(per_iteration) * 1e6 if per_iteration else 0.0,
        min_us=min(per_iteration) * 1e6 if per_iteration else 0.0,
        iterations=iterations,
        wrong=sum(wrong),
    )
