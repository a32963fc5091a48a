"""Per-call timeouts on local peers (threads): a call's timeout overrides the config's, both ways,
and names the peer that never came."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import collective as col
from tests.conftest import run_peers
from tests.peers import config, run_failing_step, zeros

TIMED: dict[str, Callable[..., Any]] = {
    "all_gather": lambda rt, p, **kw: rt.all_gather(p, zeros(2), **kw),
    "reduce_scatter": lambda rt, p, **kw: rt.reduce_scatter(p, zeros(2), **kw),
    "all_to_all": lambda rt, p, **kw: rt.all_to_all(p, zeros(2), **kw),
    "gather": lambda rt, p, **kw: rt.gather(p, zeros(2), root=1, **kw),
    "scatter": lambda rt, p, **kw: rt.scatter(p, zeros(2, 3) if p == 0 else None, root=0, **kw),
    "barrier": lambda rt, p, **kw: rt.barrier(p, **kw),
    "coalesced": lambda rt, p, **kw: rt.all_reduce_coalesced(p, [zeros(2), zeros(3, dtype=np.int32)], **kw),
}


@pytest.mark.parametrize("kind", [*TIMED, "recv"])
def test_a_call_timeout_overrides_the_configs_and_names_the_missing_peer(
    runtime: col.Runtime, kind: str
) -> None:
    """Config timeout 30 s, call timeout 0.3 s: CollectiveTimeout naming peer 1 well before 30 s."""
    timed_out = threading.Event()

    def step(peer: int) -> Any:
        if peer == 1:  # late: meets the verdict the others reached, then the job goes on
            assert timed_out.wait(20)
            return None if kind == "recv" else TIMED[kind](runtime, peer)
        started = time.monotonic()
        try:
            return (
                runtime.recv(0, src=1, timeout=0.3)
                if kind == "recv"
                else TIMED[kind](runtime, peer, timeout=0.3)
            )
        finally:
            elapsed = time.monotonic() - started
            assert 0.25 <= elapsed < 10, elapsed
            timed_out.set()

    errors = run_failing_step(runtime, 2, step, timeout=30)
    assert isinstance(errors[0], col.CollectiveTimeout) and errors[0].missing == (1,), errors[0]
    assert "peer 1" in str(errors[0])
    if kind != "recv":
        assert isinstance(errors[1], col.CollectiveTimeout), errors[1]


def test_a_call_timeout_longer_than_the_configs_lets_a_slow_peer_arrive(runtime: col.Runtime) -> None:
    def step(peer: int) -> Any:
        if peer == 1:
            time.sleep(1.0)  # (kept: the slow peer under test) past the config's 0.5 s
        return runtime.all_gather(peer, np.full(2, peer), timeout=20)

    def body(peer: int) -> Any:
        runtime.register(peer, "cpu", config(2, timeout=0.5))
        return step(peer)

    for got in run_peers(2, body, runtime):
        np.testing.assert_array_equal(got, [[0, 0], [1, 1]])
