"""Normal calls that come again on the same arrays run kept (collective.persistent.kept): as uses
of a persistent call, their input read anew, and made anew whenever anything they were checked
for could have changed: the arrays' layout, ``out``'s writability, the op, the group, the job."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import numpy as np
import pytest

import collective as col
from collective.persistent.kept import KEPT_CALLS, REPEAT_VARIABLE
from tests.processes import finish_all, start_nodes
from tests.test_persistent import run_peers


def _kept(rt: col.Runtime, p: int) -> list[Any]:
    """Peer ``p``'s kept calls, oldest first (not those only noted once)."""
    noted = (rt._kept_calls or {}).items()
    return [kept.call for key, kept in noted if key[0] == p and hasattr(kept, "call")]


def test_calls_on_the_same_arrays_run_kept_and_read_their_inputs_each_time() -> None:
    def body(rt: col.Runtime, p: int) -> list[Any]:
        x, out = np.zeros(3, np.float32), np.zeros(3, np.float32)
        block, gathered = np.zeros(2), np.zeros((3, 2))
        row, part = np.zeros(6), np.zeros(2)
        source, sent = np.zeros(2), np.zeros(2)
        seen, calls = [], []
        for use in range(4):
            x[:] = p + use
            block[:] = p * 10 + use
            row[:] = np.arange(6) * (p + 1) + use
            source[:] = use
            summed = rt.all_reduce(p, x, out=out)
            biggest = rt.all_reduce(p, x, "max", out=x)  # (in place: another call, kept apart)
            rt.all_gather(p, block, out=gathered)
            rt.reduce_scatter(p, row, "max", out=part)
            rt.broadcast(p, source if p == 1 else None, out=sent)
            assert rt.barrier(p) is None  # (no arrays: kept by its peer and group)
            results = (out.tolist(), biggest.tolist(), gathered.tolist(), part.tolist(), sent.tolist())
            seen.append((summed is out, *results))
            calls.append(_kept(rt, p))
        return [seen, [len(c) for c in calls], all(a is b for a, b in zip(calls[1], calls[-1], strict=True))]

    for p, (seen, counts, same) in run_peers(3, body).items():
        assert counts == [0, 6, 6, 6] and same, (counts, same)  # kept at the second call, then the same
        for use, (returned, summed, biggest, gathered, part, sent) in enumerate(seen):
            assert returned and summed == [3.0 * use + 3.0] * 3 and biggest == [use + 2.0] * 3
            assert gathered == [[q * 10 + use] * 2 for q in range(3)]
            assert part == [float(3 * i + use) for i in (2 * p, 2 * p + 1)]
            assert sent == [float(use)] * 2


def test_a_changed_array_runs_anew_and_a_read_only_out_fails_every_peer() -> None:
    def body(rt: col.Runtime, p: int) -> list[Any]:
        x, out = np.ones(6), np.zeros(6)
        said: list[Any] = [rt.all_reduce(p, x, out=out).tolist(), rt.all_reduce(p, x, out=out).tolist()]
        x.shape = out.shape = (2, 3)  # the same arrays, another shape
        said.append(rt.all_reduce(p, x, out=out).tolist())
        x.dtype = out.dtype = np.int64  # ... and another dtype (the same bytes, read as integers)
        x[:] = p
        said.append(rt.all_reduce(p, x, out=out).tolist())
        if p == 0:
            out.flags.writeable = False
        try:
            rt.all_reduce(p, x, out=out)
        except col.InvalidArgumentError as exc:
            said.append(str(exc))
        out.flags.writeable = True
        x[:] = 1
        said.append(rt.all_reduce(p, x, out=out).tolist())  # the group is still in step
        return said

    found = run_peers(2, body)
    for said in found.values():
        assert said[:2] == [[2.0] * 6] * 2 and said[2] == [[2.0] * 3] * 2 and said[3] == [[1] * 3] * 2, said
        assert "out" in said[4] and "writ" in said[4], said[4]  # every peer: named by peer 0's check
        assert said[5] == [[2] * 3] * 2, said


def test_a_kept_call_that_meets_another_call_is_a_mismatch_on_every_peer() -> None:
    def body(rt: col.Runtime, p: int) -> list[Any]:
        x, out = np.ones(4), np.zeros(4)
        said: list[Any] = [rt.all_reduce(p, x, out=out)[0], rt.all_reduce(p, x, out=out)[0]]
        try:  # peer 0 calls what it kept; peer 1 another op on the same arrays
            rt.all_reduce(p, x, "sum" if p == 0 else "max", out=out)
        except col.MismatchError as exc:
            said.append(type(exc).__name__)
        said.append(rt.all_reduce(p, x, out=out)[0])
        return said

    assert run_peers(2, body) == {p: [2.0, 2.0, "MismatchError", 2.0] for p in (0, 1)}


def test_a_kept_barrier_that_meets_another_call_is_a_mismatch_on_every_peer() -> None:
    def body(rt: col.Runtime, p: int) -> list[Any]:
        rt.barrier(p)
        rt.barrier(p)
        said: list[Any] = [len(_kept(rt, p))]
        try:  # peer 0 calls the barrier it kept; peer 1 an all_reduce
            if p == 0:
                rt.barrier(p)
            else:
                rt.all_reduce(p, np.ones(2))
        except col.MismatchError as exc:
            said.append(type(exc).__name__)
        rt.barrier(p)  # (the group is still in step)
        said.append(rt.all_reduce(p, np.ones(1))[0])
        return said

    assert run_peers(2, body) == {p: [1, "MismatchError", 2.0] for p in (0, 1)}


def test_calls_are_not_kept_when_turned_off_nor_beyond_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    peers = 1

    def many(rt: col.Runtime, p: int) -> list[int]:
        x, outs = np.ones(2), [np.zeros(2) for _ in range(KEPT_CALLS + 8)]
        for _ in range(KEPT_CALLS + 8):
            assert rt.all_reduce(p, x, out=np.zeros(2))[0] == peers  # (a new out each time: never kept)
        never = len(_kept(rt, p))
        for out in outs:  # (each out twice: kept)
            rt.all_reduce(p, x, out=out)
            rt.all_reduce(p, x, out=out)
        return [never, len(_kept(rt, p)), len(rt._kept_calls or {})]

    def twice(rt: col.Runtime, p: int) -> int:
        x, out = np.ones(2), np.zeros(2)
        rt.all_reduce(p, x, out=out)
        rt.all_reduce(p, x, out=out)
        rt.all_reduce(p, x, out=out, async_op=True).wait()  # (asynchronous: never kept)
        rt.all_reduce(p, x)  # (no out: never kept)
        return len(_kept(rt, p))

    assert run_peers(peers, many) == {0: [0, KEPT_CALLS, KEPT_CALLS]}
    assert run_peers(2, twice) == {0: 1, 1: 1}
    monkeypatch.setenv(REPEAT_VARIABLE, "0")
    assert run_peers(2, twice) == {0: 0, 1: 0}


def test_a_call_kept_in_one_job_is_made_anew_in_the_next() -> None:
    x, out = np.ones(3), np.zeros(3)
    kept: list[Any] = []
    with col.Runtime() as rt:
        for job, peers in (("first", 2), ("second", 3)):
            config = col.CollectiveConfig(num_devices=peers, timeout=5.0, job=job)
            results: dict[int, Any] = {}

            def peer(p: int, config: Any = config, results: dict[int, Any] = results) -> None:
                rt.register(p, "cpu", config)
                mine, into = (x, out) if p == 0 else (np.ones(3), np.zeros(3))
                results[p] = [rt.all_reduce(p, mine, out=into)[0] for _ in range(2)]
                if p == 0:
                    kept.extend(_kept(rt, 0))
                rt.finish(p)

            threads = [threading.Thread(target=peer, args=(p,)) for p in range(peers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert results == {p: [float(peers)] * 2 for p in range(peers)}, (job, results)
    assert len(kept) == 2 and kept[0] is not kept[1]  # (the second job's made anew, kept in its place)


@pytest.mark.parametrize("handle", [False, True], ids=["kept", "persistent"])
def test_a_peer_alone_in_its_group_reads_its_input_at_each_call(handle: bool) -> None:
    """A one-peer group (and a job of one peer): its step's result is made when the step is decided
    (the fused path), so a use cannot run that step again; each use reads the input anew."""

    def body(rt: col.Runtime, p: int) -> list[Any]:
        alone = col.new_group([p])
        x, out, gathered, part, sent = np.zeros(2), np.zeros(2), np.zeros((1, 2)), np.zeros(2), np.zeros(2)
        made = [
            lambda: rt.all_reduce(p, x, out=out, group=alone),
            lambda: rt.all_gather(p, x, out=gathered, group=alone),
            lambda: rt.reduce_scatter(p, x, out=part, group=alone),
            lambda: rt.broadcast(p, x, out=sent, group=alone),
        ]
        if handle:
            made = [
                rt.all_reduce_init(p, x, out=out, group=alone),
                rt.all_gather_init(p, x, out=gathered, group=alone),
                rt.reduce_scatter_init(p, x, out=part, group=alone),
                rt.broadcast_init(p, x, out=sent, group=alone),
            ]
        seen = []
        for use in range(4):
            x[:] = 10 * p + use
            for call in made:
                call()
            seen.append([out.tolist(), gathered.tolist(), part.tolist(), sent.tolist()])
        return seen

    for p, seen in run_peers(2, body).items():
        for use, (summed, gathered, part, sent) in enumerate(seen):
            value = [10.0 * p + use] * 2
            assert summed == part == sent == value and gathered == [value], (p, use, seen)


def test_a_peer_that_finishes_lets_its_kept_calls_go() -> None:
    held: dict[int, Any] = {}

    def body(rt: col.Runtime, p: int) -> int:
        x, out = np.ones(2), np.zeros(2)
        rt.all_reduce(p, x, out=out)
        rt.all_reduce(p, x, out=out)
        held[p] = weakref.ref(x)
        count = len(_kept(rt, p))
        rt.finish(p)
        return count + 10 * len(_kept(rt, p))

    assert run_peers(2, body) == {0: 1, 1: 1}  # (kept, then let go by finish)
    gc.collect()
    assert all(ref() is None for ref in held.values()), "a finished peer's kept call holds its arrays"


@pytest.mark.parametrize("shm", [1, 0], ids=["shared-memory", "three-phases"])
def test_kept_calls_between_processes(orchestrator: str, shm: int) -> None:
    nodes = start_nodes(orchestrator, f"kept-{shm}", 2, 1, "kept", shm=shm)
    assert finish_all(nodes, 60) == [0, 0], [node.output() for node in nodes]
    assert all(node.wait_for("OK 15", 5) for node in nodes)
