"""Asynchronous collectives of local peers (threads): a Work's result and state, errors reaching
wait() and exception(), issue order within a group, independence across groups, no thread left
behind, and finish() waiting for queued work. (The Sequencer on its own: tests/test_work.py.)"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import collective as col
from tests.conftest import PATHS, run_peers, wait_until
from tests.peers import CALL_TIMEOUT, config, drive, registered, zeros

ASYNC_CALLS: dict[str, tuple[Callable[..., Any], Callable[[list[np.ndarray], int], Any]]] = {
    # kind: (the call for peer p of 2 given x, the expected result on peer p given both xs)
    "all_reduce": (lambda rt, p, x, **kw: rt.all_reduce(p, x, **kw), lambda xs, p: xs[0] + xs[1]),
    "reduce": (
        lambda rt, p, x, **kw: rt.reduce(p, x, root=1, **kw),
        lambda xs, p: xs[0] + xs[1] if p else None,
    ),
    "broadcast": (lambda rt, p, x, **kw: rt.broadcast(p, x if p else None, **kw), lambda xs, p: xs[1]),
    "all_gather": (lambda rt, p, x, **kw: rt.all_gather(p, x, **kw), lambda xs, p: np.stack(xs)),
    "reduce_scatter": (
        lambda rt, p, x, **kw: rt.reduce_scatter(p, x, **kw),
        lambda xs, p: (xs[0] + xs[1])[2 * p : 2 * p + 2],
    ),
    "all_to_all": (
        lambda rt, p, x, **kw: rt.all_to_all(p, x, **kw),
        lambda xs, p: np.concatenate([xs[0][2 * p : 2 * p + 2], xs[1][2 * p : 2 * p + 2]]),
    ),
    "gather": (
        lambda rt, p, x, **kw: rt.gather(p, x, root=0, **kw),
        lambda xs, p: None if p else np.stack(xs),
    ),
    "scatter": (
        lambda rt, p, x, **kw: rt.scatter(p, x.reshape(2, 2) if p == 0 else None, root=0, **kw),
        lambda xs, p: xs[0].reshape(2, 2)[p],
    ),
    "barrier": (lambda rt, p, x, **kw: rt.barrier(p, **kw), lambda xs, p: None),
    "coalesced": (
        lambda rt, p, x, **kw: rt.all_reduce_coalesced(p, [x, x[:1]], **kw),
        lambda xs, p: [xs[0] + xs[1], (xs[0] + xs[1])[:1]],
    ),
}


def _equal(got: Any, expected: Any) -> None:
    if expected is None or isinstance(expected, list):
        assert (got is None) == (expected is None)
        for a, b in zip(got or [], expected or [], strict=True):
            np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("kind", list(ASYNC_CALLS))
def test_async_work_gives_the_result_and_its_state(runtime: col.Runtime, kind: str) -> None:
    call, expected = ASYNC_CALLS[kind]
    xs = [np.arange(4.0) + 10 * p for p in range(2)]
    issued = threading.Event()

    def body(peer: int) -> Any:
        runtime.register(peer, "cpu", config(2))
        if peer == 1:  # calls only once peer 0's Work exists and has been looked at
            assert issued.wait(10)
            return call(runtime, 1, xs[1]), None
        work = call(runtime, 0, xs[0], async_op=True)
        state = (isinstance(work, col.Work), work.is_completed(), work.exception())
        issued.set()
        result = work.wait(10)
        return result, (state, work.is_completed(), work.exception(), work.wait(0.1) is result)

    outcome = run_peers(2, body, runtime)
    (result, (before, done, error, again)), (blocking, _) = outcome
    assert before == (True, False, None), "a Work, pending while peer 1 has not called"
    assert done and error is None and again
    _equal(result, expected(xs, 0))
    _equal(blocking, expected(xs, 1))


@pytest.mark.parametrize("path", list(PATHS))
def test_async_errors_reach_wait_and_exception(path: str) -> None:
    def body(peer: int) -> Any:
        rt.register(peer, "cpu", config(2))
        mismatch = rt.all_gather(peer, zeros(2 + peer), async_op=True)
        invalid = rt.reduce_scatter(peer, zeros(3), async_op=True)
        with pytest.raises(col.MismatchError, match=r"shape: peer 0 passed \(2,\), peer 1 passed \(3,\)"):
            mismatch.wait(10)
        with pytest.raises(col.InvalidArgumentError, match="divisible by the group size 2"):
            invalid.wait(10)
        assert isinstance(mismatch.exception(), col.MismatchError) and mismatch.is_completed()
        assert isinstance(invalid.exception(), col.InvalidArgumentError)
        if peer == 0:  # peer 1 never calls this one
            timed_out = rt.barrier(peer, timeout=0.3, async_op=True)
            with pytest.raises(col.CollectiveTimeout) as info:
                timed_out.wait(10)
            assert info.value.missing == (1,) and isinstance(timed_out.exception(), col.CollectiveTimeout)
            peer_1_may_go.set()
        else:
            assert peer_1_may_go.wait(10)
            with pytest.raises(col.CollectiveTimeout):  # the same verdict for the late peer
                rt.barrier(peer, async_op=True).wait(10)
        return rt.all_reduce(peer, np.ones(2), async_op=True).wait(10)

    peer_1_may_go = threading.Event()
    with col.Runtime(**PATHS[path]) as rt:
        for y in run_peers(2, body, rt):
            np.testing.assert_array_equal(y, [2, 2])


def test_wait_with_a_timeout_raises_without_cancelling(runtime: col.Runtime) -> None:
    registered(runtime, 2)
    work = runtime.all_gather(0, np.ones(2), async_op=True)
    started = time.monotonic()
    with pytest.raises(col.CollectiveTimeout, match=r"did not complete within 0.1s of wait\(\)") as info:
        work.wait(0.1)
    assert isinstance(info.value, TimeoutError) and time.monotonic() - started < 5
    assert not work.is_completed() and work.exception() is None
    np.testing.assert_array_equal(runtime.all_gather(1, np.zeros(2)), [[1, 1], [0, 0]])
    np.testing.assert_array_equal(work.wait(10), [[1, 1], [0, 0]])


@pytest.mark.parametrize("path", list(PATHS))
def test_calls_of_one_peer_on_one_group_complete_in_issue_order(path: str) -> None:
    """Peer 0 mixes async and blocking calls; peer 1 issues all async and waits for the last."""
    plan = ["all_reduce", "reduce_scatter", "all_gather", "barrier", "all_to_all", "all_reduce", "gather"]
    blocking = {2, 5}  # peer 0's blocking calls: every earlier Work must be complete when they return
    xs = [[np.full(4, 10 * i + p, np.int64) for i in range(len(plan))] for p in range(2)]

    def issue(peer: int, i: int, async_op: bool) -> Any:
        call, _ = ASYNC_CALLS[plan[i]]
        return call(rt, peer, xs[peer][i], async_op=async_op)

    def body(peer: int) -> list[Any]:
        rt.register(peer, "cpu", config(2))
        if peer == 1:  # once peer 0 has queued its first two calls and waits in its first blocking one
            wait_until(lambda: rt.pending(0) >= 3, 10, "peer 0's first three calls issued")
            works = [issue(1, i, True) for i in range(len(plan))]
            last = works[-1].wait(15)
            assert all(w.is_completed() for w in works), "the last Work completed before an earlier one"
            return [w.wait(0) for w in works[:-1]] + [last]
        results: list[Any] = []
        pending: list[Any] = []
        for i in range(len(plan)):
            if i in blocking:
                results.append(issue(0, i, False))
                assert all(w.is_completed() for w in pending), f"call {i} returned before earlier Works"
            else:
                pending.append(issue(0, i, True))
                results.append(pending[-1])
        return [r.wait(15) if isinstance(r, col.Work) else r for r in results]

    with col.Runtime(**PATHS[path]) as rt:
        results = run_peers(2, body, rt)
    for peer in range(2):
        for i, kind in enumerate(plan):
            _equal(results[peer][i], ASYNC_CALLS[kind][1]([xs[0][i], xs[1][i]], peer))


def test_async_calls_on_two_groups_of_one_peer_complete_independently(runtime: col.Runtime) -> None:
    registered(runtime, 3, timeout=30)
    kw: dict[str, Any] = {"async_op": True, "timeout": CALL_TIMEOUT}
    pair_1, pair_2 = col.new_group([0, 1]), col.new_group([0, 2])

    def scenario() -> None:
        first = runtime.all_reduce(0, np.ones(2), group=pair_1, **kw)
        second = runtime.all_reduce(0, np.ones(2), group=pair_2, **kw)
        wait_until(  # both of peer 0's Works wait for their partners
            lambda: runtime.waiting(pair_1) == (0,) and runtime.waiting(pair_2) == (0,),
            CALL_TIMEOUT - 1,
            "peer 0's Works waiting in both groups",
        )
        np.testing.assert_array_equal(runtime.all_reduce(2, np.ones(2), group=pair_2), [2, 2])
        np.testing.assert_array_equal(second.wait(CALL_TIMEOUT - 1), [2, 2])
        assert not first.is_completed(), "waits for peer 1 only, not for the other group"
        np.testing.assert_array_equal(runtime.all_reduce(1, np.ones(2), group=pair_1), [2, 2])
        np.testing.assert_array_equal(first.wait(CALL_TIMEOUT - 1), [2, 2])

    (outcome,) = drive(runtime, [scenario], within=2 * CALL_TIMEOUT)
    if outcome is not None:
        raise outcome


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads started since ``before`` that are still alive."""
    return [t for t in threading.enumerate() if t not in before]


def test_dropped_work_leaks_no_thread_once_it_completes(runtime: col.Runtime) -> None:
    registered(runtime, 2)
    before = set(threading.enumerate())
    baseline = threading.active_count()
    for i in range(20):  # never waited: completed by peer 1's calls below, or timed out
        runtime.all_reduce(0, np.full(2, i), async_op=True)
    runtime.all_gather(0, np.ones(1), timeout=0.2, async_op=True)  # peer 1 never calls this one
    gc.collect()
    assert any(t.name.startswith("collective-") for t in threading.enumerate() if t not in before)
    for i in range(20):
        np.testing.assert_array_equal(runtime.all_reduce(1, np.full(2, i)), [2 * i, 2 * i])
    wait_until(lambda: not _new_threads(before), 10, lambda: f"threads left behind: {_new_threads(before)}")
    assert threading.active_count() <= baseline


def test_finish_lets_the_peers_queued_work_end_first(runtime: col.Runtime) -> None:
    """finish() used to return at once: the queued calls were dropped and their wait() raised
    RegistrationError 'peer 0 has finished'."""
    registered(runtime, 2)
    works = [runtime.all_reduce(0, np.full(2, i), async_op=True) for i in range(5)]
    finishing = threading.Thread(target=runtime.finish, args=(0,))
    finishing.start()
    wait_until(lambda: runtime.waiting() == (0,), 10, "peer 0's first Work waiting for peer 1")
    finishing.join(0.2)  # (not an order: the time a finish that does not wait would take to return)
    assert finishing.is_alive()  # peer 1 has not called yet: the works wait, and so does finish
    for i in range(5):
        np.testing.assert_array_equal(runtime.all_reduce(1, np.full(2, i)), [2 * i, 2 * i])
    finishing.join(10)
    assert not finishing.is_alive()
    for i, work in enumerate(works):
        np.testing.assert_array_equal(work.wait(5), [2 * i, 2 * i])
    with pytest.raises(col.RegistrationError, match="peer 0 has finished"):
        runtime.all_reduce(0, np.ones(2))
