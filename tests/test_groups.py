"""Groups of local peers (threads): ranks by position, independence of disjoint groups, one peer
waiting in several groups at once, peers outside a group, and groups made by hand or by
new_group() checked when made."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import collective as col
from collective import Ring
from tests.conftest import PATHS, assert_matches, reference, run_peers, wait_until
from tests.peers import CALL_TIMEOUT, config, drive, make_input, registered, same_bytes, zeros


@pytest.mark.parametrize("path", list(PATHS))
def test_a_group_ranks_by_position_and_mean_divides_by_its_size(path: str) -> None:
    """Job of 5; group [4, 1, 3] (ranks: peer 1 -> 0, 3 -> 1, 4 -> 2) beside group [2, 0]."""
    n = 5
    group, other = col.new_group([4, 1, 3]), col.new_group([2, 0])
    assert group.members == (1, 3, 4) and group.size == 3 and group.rank(4) == 2
    xs = [make_input(p, (6, 2), np.float64, seed=3) for p in range(n)]
    members = [xs[p] for p in group.members]
    stack = make_input(4, (3, 2), np.float64, seed=4)

    def body(peer: int) -> dict[str, Any]:
        rt.register(peer, "cpu", config(n))
        x, got = xs[peer], {}
        if peer in group.members:
            got["size"] = rt.world_size(group)
            got["all_gather"] = rt.all_gather(peer, x, group=group)
            got["all_reduce"] = rt.all_reduce(peer, x, "mean", group=group)
            got["reduce_scatter"] = rt.reduce_scatter(peer, x, "mean", group=group)
            got["all_to_all"] = rt.all_to_all(peer, x, group=group)
            got["gather"] = rt.gather(peer, x, root=3, group=group)
            got["scatter"] = rt.scatter(peer, stack if peer == 4 else None, root=4, group=group)
            got["reduce"] = rt.reduce(peer, x, "sum", root=1, group=group)
            got["broadcast"] = rt.broadcast(peer, x if peer == 3 else None, group=group)
            got["coalesced"] = rt.all_reduce_coalesced(peer, [x, x[0]], "mean", group=group)
            rt.barrier(peer, group=group)
            with pytest.raises(
                col.InvalidArgumentError, match=r"root 0 is not a peer of the group \(peers 1, 3-4\)"
            ):
                rt.gather(peer, x, root=0, group=group)
        else:
            got["all_reduce"] = rt.all_reduce(peer, x, "mean", group=other)
        got["world"] = rt.all_reduce(peer, x, "mean")
        rt.finish(peer)
        return got

    with col.Runtime(**PATHS[path]) as rt:
        results = run_peers(n, body, rt)
    mean = reference(members, "mean")
    for rank, peer in enumerate(group.members):
        got = results[peer]
        assert got["size"] == 3
        same_bytes(got["all_gather"], np.stack(members))
        assert_matches(got["all_reduce"], mean, 3)
        assert_matches(got["reduce_scatter"], mean[2 * rank : 2 * rank + 2], 3)
        same_bytes(got["all_to_all"], np.concatenate([m[2 * rank : 2 * rank + 2] for m in members]))
        assert (got["gather"] is None) == (peer != 3)
        same_bytes(got["scatter"], stack[rank])
        assert (got["reduce"] is None) == (peer != 1)
        same_bytes(got["broadcast"], xs[3])
        assert_matches(got["coalesced"][0], mean, 3)
        assert_matches(got["coalesced"][1], mean[0], 3)
    same_bytes(results[3]["gather"], np.stack(members))
    assert_matches(results[1]["reduce"], reference(members, "sum"), 3)
    for peer in other.members:
        assert_matches(results[peer]["all_reduce"], reference([xs[0], xs[2]], "mean"), 2)
    for got in results:
        assert_matches(got["world"], reference(xs, "mean"), n)


def test_a_group_of_one_completes_alone(runtime: col.Runtime) -> None:
    registered(runtime, 3)
    alone = col.new_group([2])
    x = np.arange(6.0).reshape(3, 2)
    same_bytes(runtime.all_gather(2, x, group=alone), x[None])
    same_bytes(runtime.all_reduce(2, x, "mean", group=alone), x)
    same_bytes(runtime.scatter(2, x[None], root=2, group=alone), x)
    same_bytes(runtime.all_to_all(2, x, group=alone), x)
    assert runtime.barrier(2, group=alone) is None


@pytest.mark.parametrize("path", list(PATHS))
def test_disjoint_groups_are_independent(path: str) -> None:
    """[0, 1] waits inside a collective until [2, 3] has run 20 of its own: no shared order."""
    pair_a, pair_b = col.new_group([0, 1]), col.new_group([2, 3])
    b_done = threading.Event()

    def body(peer: int) -> list[Any]:
        rt.register(peer, "cpu", config(4, Ring()))
        out = []
        if peer in pair_b.members:
            for i in range(20):
                out.append(rt.all_gather(peer, np.full(2, 10 * peer + i), group=pair_b))
                out.append(rt.reduce_scatter(peer, np.full(4, i), group=pair_b))
            b_done.set()
        else:
            if peer == 1:  # peer 0 is already waiting inside all_reduce #0 of [0, 1]
                assert b_done.wait(15)
            out.append(rt.all_reduce(peer, np.full(3, peer + 1), group=pair_a))
            out.append(rt.all_to_all(peer, np.full(2, peer), group=pair_a))
        rt.barrier(peer)
        rt.finish(peer)
        return out

    with col.Runtime(**PATHS[path]) as rt:
        results = run_peers(4, body, rt)
    for peer in (0, 1):
        np.testing.assert_array_equal(results[peer][0], np.full(3, 3))
        np.testing.assert_array_equal(results[peer][1], [0, 1])
    for peer in (2, 3):
        for i in range(20):
            np.testing.assert_array_equal(results[peer][2 * i], [[20 + i] * 2, [30 + i] * 2])
            np.testing.assert_array_equal(results[peer][2 * i + 1], [2 * i] * 2)


@pytest.mark.parametrize("path", ["fused", "linked"])
def test_a_peer_waiting_in_two_groups_at_once_is_woken_for_each(path: str) -> None:
    seen = threading.Event()  # peer 0 was seen waiting in both groups (before either partner called)

    def peer_0_waits_in_both() -> bool:
        if rt.waiting([0, 1]) == (0,) and rt.waiting([0, 2]) == (0,):
            seen.set()
        return seen.is_set()

    def call(peer: int, members: list[int], late: bool = False) -> Callable[[], Any]:
        def body() -> Any:
            if late:
                wait_until(peer_0_waits_in_both, 2.0, "peer 0 waiting in groups [0, 1] and [0, 2]")
            return rt.all_reduce(peer, np.ones(2), group=col.new_group(members), timeout=CALL_TIMEOUT)

        return body

    with col.Runtime(**PATHS[path]) as rt:
        registered(rt, 3, timeout=30)
        # Peer 0 waits in both groups from two threads before its partners call.
        bodies = [call(0, [0, 1]), call(0, [0, 2]), call(2, [0, 2], late=True), call(1, [0, 1], late=True)]
        for got in drive(rt, bodies, within=CALL_TIMEOUT - 0.5):
            np.testing.assert_array_equal(got, [2, 2])


@pytest.mark.parametrize("path", ["fused", "linked"])
def test_overlapping_groups_driven_by_two_threads_of_the_same_peers(path: str) -> None:
    """Peers 0 and 2 run [0, 1, 2, 3] from one thread and [0, 2] from another, at the same time."""
    world, pair = col.new_group([0, 1, 2, 3]), col.new_group([2, 0])
    drivers = [(p, world) for p in range(4)] + [(0, pair), (2, pair)]
    rounds = 25

    def body(peer: int, group: col.Group) -> list[Any]:
        out = []
        for i in range(rounds):
            x = np.full(4, 100 * peer + i, np.int64)
            out.append(rt.all_reduce(peer, x, group=group, timeout=CALL_TIMEOUT))
            out.append(rt.all_gather(peer, x[:1], group=group, timeout=CALL_TIMEOUT))
            if i % 5 == 0:
                work = rt.reduce_scatter(peer, x, "max", group=group, timeout=CALL_TIMEOUT, async_op=True)
                out.append(work.wait(2 * CALL_TIMEOUT))
        return out

    with col.Runtime(**PATHS[path]) as rt:
        registered(rt, 4, timeout=30)
        bodies = [lambda p=p, g=g: body(p, g) for p, g in drivers]
        results = drive(rt, bodies, within=CALL_TIMEOUT + 1)
    for (peer, group), out in zip(drivers, results, strict=True):
        expected = []
        for i in range(rounds):
            values = [100 * p + i for p in group.members]
            expected += [np.full(4, sum(values)), np.array(values)[:, None]]
            if i % 5 == 0:
                expected.append(np.full(4 // group.size, max(values)))
        assert not isinstance(out, BaseException), f"peer {peer} in {group}: {out!r}"
        assert len(out) == len(expected)
        for got, want in zip(out, expected, strict=True):
            np.testing.assert_array_equal(got, want)


GROUP_CALLS: dict[str, Callable[[col.Runtime, int, col.Group], Any]] = {
    "all_reduce": lambda rt, p, g: rt.all_reduce(p, zeros(2), group=g),
    "all_gather": lambda rt, p, g: rt.all_gather(p, zeros(2), group=g),
    "reduce_scatter": lambda rt, p, g: rt.reduce_scatter(p, zeros(2), group=g),
    "all_to_all": lambda rt, p, g: rt.all_to_all(p, zeros(2), group=g),
    "gather": lambda rt, p, g: rt.gather(p, zeros(2), root=0, group=g),
    "scatter": lambda rt, p, g: rt.scatter(p, None, root=0, group=g),
    "broadcast": lambda rt, p, g: rt.broadcast(p, None, group=g),
    "barrier": lambda rt, p, g: rt.barrier(p, group=g),
    "coalesced": lambda rt, p, g: rt.all_reduce_coalesced(p, [zeros(2)], group=g),
    "async": lambda rt, p, g: rt.all_reduce(p, zeros(2), group=g, async_op=True),
}


@pytest.mark.parametrize("kind", list(GROUP_CALLS))
def test_a_peer_outside_the_group_is_refused_at_once(runtime: col.Runtime, kind: str) -> None:
    registered(runtime, 3, timeout=30)
    started = time.monotonic()
    with pytest.raises(col.InvalidArgumentError, match="peer 2 is not a member of the group of peers 0-1"):
        GROUP_CALLS[kind](runtime, 2, col.new_group([0, 1]))
    assert time.monotonic() - started < 5, "at once, not after the 30 s timeout"
    assert [y[0] for y in run_peers(3, lambda p: runtime.all_reduce(p, np.ones(1)), runtime)] == [3] * 3


def test_a_group_naming_peers_outside_the_job_or_not_a_group(runtime: col.Runtime) -> None:
    early = col.new_group([0, 5])  # no job yet in the default runtime: checked when used
    registered(runtime, 2)
    with pytest.raises(
        col.InvalidArgumentError, match=r"the group names peer 5, but the job's peers are 0\.\.1"
    ):
        runtime.all_reduce(0, np.ones(1), group=early)


def test_a_list_of_peer_ids_is_the_group_it_names(runtime: col.Runtime) -> None:
    """Peer 2 passed group=[2, 1, 0] (the whole job) while the others passed none: it raised alone,
    before taking a step, and its next call joined the step the others were still in: silently
    wrong results (102 for 3) from then on. A list is now the group new_group() makes of it."""
    registered(runtime, 3, timeout=30)

    def body(p: int) -> list[float]:
        whole = runtime.all_reduce(p, np.full(2, 1.0), group=[2, 1, 0] if p == 2 else None)  # type: ignore[arg-type]
        pair = runtime.all_reduce(p, np.full(2, 10.0), group=(0, 1))[0] if p < 2 else 0.0  # type: ignore[arg-type]
        after = runtime.all_reduce(p, np.full(2, 100.0))
        return [float(whole[0]), float(pair), float(after[0])]

    assert run_peers(3, body, runtime) == [[3.0, 20.0, 300.0]] * 2 + [[3.0, 0.0, 300.0]]
    assert runtime.world_size([0, 1]) == 2  # type: ignore[arg-type]
    with pytest.raises(col.InvalidArgumentError, match=r"peer 0 named more than once"):
        runtime.all_reduce(0, np.ones(1), group=[0, 0])  # type: ignore[arg-type]
    with pytest.raises(col.InvalidArgumentError, match=r"group must be a value of new_group\(\) or a list"):
        runtime.all_reduce(0, np.ones(1), group="all")  # type: ignore[arg-type]


@pytest.mark.parametrize("members", [(-1, 0), (1, 0), (0, 0), (), (0, 1.0), (True, 2), "01"])
def test_a_group_made_by_hand_is_checked_when_made(members: Any) -> None:
    """Group((-1, 0, 1)) gave peer 0 a result and peer 1 an IndexError; Group((1, 0)) ranked
    all_gather in that order, not by peer id."""
    with pytest.raises(
        col.InvalidArgumentError, match=r"distinct peer ids in increasing order; make one with"
    ):
        col.Group(members)
    assert (
        col.Group([0, 1]) == col.Group((np.int64(0), np.int64(1))) == col.new_group([1, 0])
    )  # as repr shows
    assert all(type(peer) is int for peer in col.Group((np.int64(0), np.int64(1))).members)


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        ([], "the list of peers is empty"),
        ([0, 2, 0], "peer 0 named more than once"),
        ([1, -1], r"new_group: \[-1\] are not peer ids \(integers >= 0\)"),
        ([0, 1.0], r"\[1.0\] are not peer ids"),
        ([True, 2], r"\[True\] are not peer ids"),
        (3, "new_group takes a list of peer ids, got 3"),
    ],
    ids=["empty", "duplicate", "negative", "float", "bool", "not-a-list"],
)
def test_new_group_rejects_bad_input(ranks: Any, expected: str) -> None:
    with pytest.raises(col.InvalidArgumentError, match=expected):
        col.new_group(ranks)


def test_new_group_checks_the_ranks_once_a_job_exists() -> None:
    run_peers(2, lambda p: col.register(p, "cpu", config(2)))
    with pytest.raises(
        col.InvalidArgumentError, match=r"the group names peers 2-3, but the job's peers are 0\.\.1"
    ):
        col.new_group([0, 2, 3])
    assert col.new_group([1]).members == (1,)
    run_peers(2, col.finish)
