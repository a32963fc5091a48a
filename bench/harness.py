"""Timing local peers (threads): the nccl-tests / OSU method.

Before each timed call every peer passes a barrier (untimed); each peer times its own call; an
iteration's time is the slowest peer's; the reported time is the median over iterations.
After each timed call every peer passes a second barrier and then (untimed) counts the wrong
elements of its result: the check never runs while another peer is still being timed.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from collective.transport.inproc import Doorbell, ring_claimed

__all__ = ["Measurement", "PeerStep", "QuickBarrier", "measure_threads"]

# One peer's step: run(iteration) -> None performs the call; check(iteration) -> wrong elements.
PeerStep = tuple[Callable[[int], None], Callable[[int], int]]


class QuickBarrier:
    """A reusable barrier whose waiters wake on their own doorbell, not through one Condition.

    threading.Barrier wakes its waiters one after another through a shared lock, which staggers
    their exits by ~10 us each on a 2-core machine; that stagger would be timed as part of every
    small collective. ``abort()`` breaks it for good (waiters raise BrokenBarrierError).
    """

    def __init__(self, parties: int, timeout: float) -> None:
        self._parties = parties
        self._timeout = timeout
        self._lock = threading.Lock()
        self._bells = [Doorbell() for _ in range(parties)]
        self._arrived = 0
        self._generation = 0
        self._broken = False

    def wait(self, party: int) -> None:
        with self._lock:
            if self._broken:
                raise threading.BrokenBarrierError
            generation = self._generation
            self._arrived += 1
            last = self._arrived == self._parties
            if last:
                self._arrived = 0
                self._generation += 1
                claimed = [bell for bell in self._bells if bell.claim()]
            else:
                self._bells[party].arm()
        if last:
            ring_claimed(claimed)
            return
        deadline = time.monotonic() + self._timeout
        while True:
            self._bells[party].wait(deadline - time.monotonic(), self._lock)
            with self._lock:
                if self._broken:
                    raise threading.BrokenBarrierError
                if generation != self._generation:
                    return
                if time.monotonic() >= deadline:
                    self._broken = True
                    claimed = [bell for bell in self._bells if bell.claim()]
                else:
                    self._bells[party].arm()
                    continue
            ring_claimed(claimed)
            raise threading.BrokenBarrierError

    def abort(self) -> None:
        with self._lock:
            self._broken = True
            claimed = [bell for bell in self._bells if bell.claim()]
        ring_claimed(claimed)


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
    barrier = QuickBarrier(peers, timeout)
    times = [[0.0] * iterations for _ in range(peers)]
    wrong = [0] * peers
    failures: list[BaseException] = []

    def peer_main(peer: int) -> None:
        try:
            run, check = make_step(peer)
            for i in range(warmup):
                barrier.wait(peer)
                run(i)
                wrong[peer] += check(i)
            for i in range(iterations):
                barrier.wait(peer)
                started = time.perf_counter()
                run(warmup + i)
                times[peer][i] = time.perf_counter() - started
                barrier.wait(peer)
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
