"""A caller's mistake fails that call only; an exception inside one peer never leaves anyone stuck."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import collective as col
import collective.calls.movement
from tests.conftest import outcomes_of_peers, run_peers


def cfg(n: int, timeout: float = 30.0) -> col.CollectiveConfig:
    return col.CollectiveConfig(num_devices=n, timeout=timeout)


def all_reduce_works(rt: col.Runtime, peers: list[int]) -> None:
    """Every peer of ``peers`` all-reduces (from its own thread) and gets the right sum."""
    results = run_peers(len(peers), lambda i: rt.all_reduce(peers[i], np.full(3, peers[i], np.int64)), rt)
    for result in results:
        np.testing.assert_array_equal(result, np.full(3, sum(peers)))


@pytest.fixture
def joined() -> Iterator[col.Runtime]:
    """A runtime whose job of 3 peers has formed."""
    with col.Runtime() as rt:
        run_peers(3, lambda p: rt.register(p, "cpu", cfg(3)), rt)
        yield rt


def test_registering_a_joined_peer_again_leaves_the_job_running(joined: col.Runtime) -> None:
    job = joined.job
    with pytest.raises(col.RegistrationError, match="peer 1 is already registered"):
        joined.register(1, "cpu", cfg(3))
    assert joined.job is job
    all_reduce_works(joined, [0, 1, 2])


def test_a_peer_outside_the_job_leaves_the_job_running(joined: col.Runtime) -> None:
    for peer in (3, -1, "2"):
        with pytest.raises(col.RegistrationError, match="outside the job"):
            joined.register(peer, "cpu", cfg(3))  # type: ignore[arg-type]
    all_reduce_works(joined, [0, 1, 2])


def test_a_refused_registration_does_not_change_the_peers_device(joined: col.Runtime) -> None:
    with pytest.raises(col.RegistrationError):
        joined.register(0, 3, cfg(3))  # CUDA device 3, for a peer already on the CPU
    all_reduce_works(joined, [0, 1, 2])  # numpy arrays are still what peer 0 is registered for


def test_a_finished_peer_registering_again_does_not_drop_the_job(joined: col.Runtime) -> None:
    job = joined.job
    joined.finish(0)
    with pytest.raises(col.RegistrationError, match="already finished this job"):
        joined.register(0, "cpu", cfg(3))
    assert joined.job is job
    for peer in (1, 2):  # the others see peer 0 gone...
        with pytest.raises(col.PeerLostError, match="peer 0 left the job"):
            joined.all_reduce(peer, np.ones(2))
    for peer in (1, 2):  # ...and can leave cleanly
        joined.finish(peer)
    assert joined.job is None
    run_peers(3, lambda p: joined.register(p, "cpu", cfg(3)), joined)  # a new job starts
    all_reduce_works(joined, [0, 1, 2])


PATHS = {"fused": {}, "shared": {"fuse_below": 0}, "link": {"fuse_below": 0, "share_below": 0}}


@pytest.mark.parametrize("path", list(PATHS))
def test_an_exception_in_one_peer_fails_the_others_at_once_and_frees_everyone(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whichever path runs it, a MemoryError inside one peer is PeerLostError for the others, fast.

    On the fused path the peer that fails is the one computing the result at the rendezvous; on
    the others it is peer 1, inside its share of the work. Afterwards nobody is left "inside a
    collective": every peer can finish.
    """
    real_reduce_all = collective.calls.movement.reduce_all
    real_combine = collective.transport.inproc.combine  # type: ignore[attr-defined]
    failed: list[str] = []

    def failing(*args: Any, real: Any) -> Any:
        name = threading.current_thread().name
        if (path == "fused" or name == "peer-1") and not failed:
            failed.append(name)
            raise MemoryError("simulated")
        return real(*args)

    monkeypatch.setattr(collective.calls.movement, "reduce_all", lambda *a: failing(*a, real=real_reduce_all))
    monkeypatch.setattr(collective.transport.inproc, "combine", lambda *a: failing(*a, real=real_combine))
    with col.Runtime(**PATHS[path]) as rt:
        started = time.monotonic()

        def body(peer: int) -> Any:
            rt.register(peer, "cpu", cfg(4))
            try:
                rt.all_reduce(peer, np.ones(1000), strategy="tree")  # (a schedule that combines)
            except BaseException as exc:
                rt.finish(peer)  # never "already inside a collective"
                return exc
            return "no error"

        outcomes = outcomes_of_peers(4, body, rt)
    assert time.monotonic() - started < 10, "the others waited out their timeout"
    culprit = int(failed[0].removeprefix("peer-"))
    assert isinstance(outcomes[culprit], MemoryError), outcomes
    for peer, outcome in enumerate(outcomes):
        if peer != culprit:
            assert isinstance(outcome, col.PeerLostError), outcome
            assert f"peer {culprit} failed" in str(outcome)


def test_errors_raised_to_the_caller_are_not_also_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG", logger="collective")
    with col.Runtime() as rt:
        outcomes = outcomes_of_peers(
            2,
            lambda p: (rt.register(p, "cpu", cfg(2)), rt.all_reduce(p, np.zeros(3 if p else 4))),
            rt,
        )
    assert all(isinstance(o, col.MismatchError) for o in outcomes)
    assert "MismatchError" not in caplog.text and "peers disagree" not in caplog.text


def test_a_late_peer_gets_the_steps_timeout_though_the_others_finished_since() -> None:
    """It got PeerLostError ('peers 1-2 left the job') instead of the step's CollectiveTimeout."""
    with col.Runtime() as rt:

        def body(peer: int) -> Any:
            rt.register(peer, "cpu", col.CollectiveConfig(num_devices=3, timeout=10))
            if peer == 0:
                time.sleep(1.0)  # (kept: the late peer under test) past the others' 0.3 s timeout
            try:
                return rt.all_reduce(peer, np.ones(4), timeout=0.3)
            finally:
                rt.finish(peer)

        outcomes = outcomes_of_peers(3, body, rt)
    for outcome in outcomes:
        assert isinstance(outcome, col.CollectiveTimeout) and outcome.missing == (0,), outcome
