"""Many consecutive collectives: no growth in threads, memory or server state."""

from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest

import collective as col
from collective.trace import RECORDER
from tests.conftest import run_peers


@pytest.mark.parametrize(
    ("limits", "iterations"),
    [({}, 10_000), ({"fuse_below": 0}, 2_000), ({"fuse_below": 0, "share_below": 0}, 2_000)],
    ids=["fused", "shared", "link"],
)
def test_consecutive_small_all_reduces_do_not_grow(limits: dict[str, int], iterations: int) -> None:
    n = 4
    threads_before = set(threading.enumerate())  # a parked worker of an earlier test may end meanwhile
    config = col.CollectiveConfig(num_devices=n, local_all_reduce_strategy="ring", timeout=30)
    traced: dict[str, int] = {}
    # Measured twice at the same fill of the flight recorder's ring, half way between two of its
    # drops (it grows to twice its size, then its older half is dropped: every size // n calls of
    # each peer), once it was first dropped; at a drop, the peers' few calls apart would decide
    # whether the ring holds its size or twice it.
    period = RECORDER.size // n
    last = iterations - 1 - period // 2
    early = last - period * ((last - RECORDER.limit // n) // period)
    tracemalloc.start()
    try:
        with col.Runtime(**limits) as rt:

            def body(peer: int) -> np.ndarray:
                rt.register(peer, "cpu", config)
                x = np.full(2, peer, np.float32)
                y = x
                for i in range(iterations):
                    y = rt.all_reduce(peer, x)
                    if peer == 0 and i in (early, last):
                        traced[f"at {i}"] = tracemalloc.get_traced_memory()[0]
                job = rt.job
                assert job is not None and job.rendezvous(job.members).open_slots <= 1  # steps are dropped
                rt.finish(peer)
                return y

            results = run_peers(n, body, rt, timeout=120)
    finally:
        tracemalloc.stop()
    for y in results:
        np.testing.assert_array_equal(y, np.full(2, 6, np.float32))
    first, last = traced.values()
    assert last - first < 256 * 1024, f"traced memory grew by {last - first} bytes over the run"
    assert not set(threading.enumerate()) - threads_before, "threads left behind"
