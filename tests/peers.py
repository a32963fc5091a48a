"""Helpers of the tests that run collectives on the local peers (threads) of one Runtime.

A job's config, inputs, the step every peer fails followed by one that must work, and threads
that drive peers of an already registered job. The fixtures (``runtime``, ``rt`` for each path of
``PATHS``) and ``run_peers`` are in tests/conftest.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import collective as col
from collective.config import KINDS
from tests.conftest import peer_input, run_peers

# Per call where threads drive peers: a call still running 2 s after its partners was not woken.
CALL_TIMEOUT = 3.0


def config(n: int, strategy: Any = None, timeout: float = 20.0) -> col.CollectiveConfig:
    """A job of ``n`` local peers running ``strategy`` (default Tree(2)) for every collective kind."""
    strategy = strategy or col.Tree(2)
    return col.CollectiveConfig(
        num_devices=n, timeout=timeout, **{f"local_{kind}_strategy": strategy for kind in KINDS}
    )


def make_input(peer: int, shape: tuple[int, ...], dtype: Any, seed: int, view: bool = False) -> np.ndarray:
    """Small integers (-3..3) in ``dtype``, so sums, products and means are exact in every dtype.

    ``view``: a non-contiguous view (every other column of an array twice as wide).
    """
    full = (*shape[:-1], 2 * shape[-1]) if view else shape
    x = peer_input(peer, full, "float32", seed=seed, small=True).astype(dtype)
    return x[..., ::2] if view else x


def zeros(*shape: int, dtype: Any = np.float64) -> np.ndarray:
    return np.zeros(shape, dtype)


def same_bytes(got: Any, expected: np.ndarray) -> None:
    """``got`` is an array of ``expected``'s shape, dtype and bytes."""
    assert isinstance(got, np.ndarray), f"expected an array, got {got!r}"
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got.shape, got.dtype)
    assert got.tobytes() == np.ascontiguousarray(expected).tobytes(), "wrong values"


def registered(rt: col.Runtime, n: int, timeout: float = 20.0) -> None:
    """Register peers 0..n-1 of a job (from threads; they may then be driven from any thread)."""
    run_peers(n, lambda p: rt.register(p, "cpu", config(n, timeout=timeout)), rt)


def run_failing_step(rt: col.Runtime, n: int, step: Callable[[int], Any], timeout: float = 10.0) -> list[Any]:
    """Every peer runs ``step`` (expected to fail), then a good all_reduce; each peer's outcome.

    The all_reduce after the failed step must work on every peer: the job stays usable.
    """

    def body(peer: int) -> Any:
        rt.register(peer, "cpu", config(n, timeout=timeout))
        try:
            outcome: Any = step(peer)
        except col.CollectiveError as exc:
            outcome = exc
        good = rt.all_reduce(peer, np.full(3, peer, np.int64))
        rt.finish(peer)
        return outcome, good

    results = run_peers(n, body, rt)
    for _, good in results:
        np.testing.assert_array_equal(good, np.full(3, n * (n - 1) // 2))
    return [outcome for outcome, _ in results]


def drive(rt: col.Runtime, bodies: list[Callable[[], Any]], within: float) -> list[Any]:
    """Run each body in a thread of its own; each one's result or exception.

    Threads still running after ``within`` seconds fail the test as a hang (the job is reset to
    free them first).
    """
    outcomes: list[Any] = [None] * len(bodies)

    def target(index: int) -> None:
        try:
            outcomes[index] = bodies[index]()
        except BaseException as exc:
            outcomes[index] = exc

    threads = [
        threading.Thread(target=target, args=(i,), name=f"driver-{i}", daemon=True)
        for i in range(len(bodies))
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + within
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        rt.reset()
        for thread in threads:
            thread.join(10)
        raise AssertionError(f"{stuck} still running after {within:g} s: not woken")
    return outcomes
