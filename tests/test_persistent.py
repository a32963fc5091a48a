"""Persistent collectives (collective.persistent): made once, agreed across the group, run by each
use on the same buffers; every failure of a normal call holds for a use, named on every peer."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import collective as col
from collective.calls import AllReduce
from tests.processes import expect_peer_lost, finish_all, start_nodes

JOIN = 30.0


def run_peers(n: int, body: Callable[[col.Runtime, int], Any], timeout: float = 5.0) -> dict[int, Any]:
    """``body(runtime, peer)`` on ``n`` thread peers of one runtime; each peer's result or error."""
    found: dict[int, Any] = {}
    with col.Runtime() as runtime:
        config = col.CollectiveConfig(num_devices=n, timeout=timeout)

        def peer(p: int) -> None:
            runtime.register(p, "cpu", config)
            try:
                found[p] = body(runtime, p)
            except Exception as exc:  # (each peer's error is the test's to check)
                found[p] = exc
            with contextlib.suppress(col.RegistrationError):  # (a body may have finished already)
                runtime.finish(p)

        threads = [threading.Thread(target=peer, args=(p,)) for p in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN)
        assert not any(thread.is_alive() for thread in threads), "a peer hangs"
    return found


def test_every_kind_reads_its_input_at_each_use_and_writes_the_same_buffer() -> None:
    def body(rt: col.Runtime, p: int) -> list[Any]:
        x, block, row = np.zeros(3, np.float32), np.zeros(2, np.int64), np.zeros(8)
        source = np.zeros(2)
        total = rt.all_reduce_init(p, x, out=x)
        mean = rt.all_reduce_init(p, x, op="mean")  # (no out: the first use's result, every time)
        gathered = rt.all_gather_init(p, block)
        scattered = rt.reduce_scatter_init(p, row, op="max")
        sent = rt.broadcast_init(p, source if p == 2 else None)
        met = rt.barrier_init(p)
        seen = []
        for use in range(3):
            x[:] = p + use
            averaged = mean()
            summed = total()
            block[:] = p * 10 + use
            row[:] = np.arange(8) * (p + 1) + use
            source[:] = use
            seen.append(
                (
                    summed is x,
                    averaged is mean.out,
                    summed.tolist(),
                    averaged.tolist(),
                    gathered().tolist(),
                    scattered().tolist(),
                    sent().tolist(),
                    met(),
                )
            )
        for handle in (total, mean, gathered, scattered, sent, met):
            handle.free()
        return seen

    found = run_peers(4, body)
    for p, seen in found.items():
        for use, (in_place, kept, summed, averaged, gathered, scattered, sent, met) in enumerate(seen):
            assert in_place and kept
            assert summed == [4.0 * use + 6.0] * 3 and averaged == [use + 1.5] * 3
            assert gathered == [[q * 10 + use] * 2 for q in range(4)]
            assert scattered == [float(4 * i + use) for i in (2 * p, 2 * p + 1)]
            assert sent == [float(use)] * 2 and met is None


def test_a_strided_input_is_read_at_each_use() -> None:
    def body(rt: col.Runtime, p: int) -> list[Any]:
        base = np.zeros(6, np.float32)
        handle = rt.all_reduce_init(p, base[::2])  # (not contiguous: packed again at each use)
        seen = []
        for use in range(3):
            base[::2] = p + use
            seen.append(handle().tolist())
        handle.free()
        return seen

    for seen in run_peers(2, body).values():
        assert seen == [[1.0] * 3, [3.0] * 3, [5.0] * 3]


def test_a_torch_tensor_is_written_in_place_and_one_moved_fails_every_peer() -> None:
    torch = pytest.importorskip("torch")

    def body(rt: col.Runtime, p: int) -> list[Any]:
        t = torch.zeros(4)
        handle = rt.all_reduce_init(p, t, out=t)
        t.fill_(p + 1)
        first = handle()
        seen: list[Any] = [first is t, t.tolist()]
        if p == 1:
            t.set_(torch.zeros(4))  # (new memory, same shape: a view of the old would be stale)
        try:
            handle()
        except col.InvalidArgumentError as exc:
            seen.append(str(exc))
        seen.append(rt.all_reduce(p, np.ones(1))[0])  # the group is still in step
        return seen

    found = run_peers(2, body)
    for seen in found.values():
        assert seen[:2] == [True, [3.0] * 4]
        assert "a buffer of this persistent all_reduce changed since it was made" in seen[2], seen
        assert "peer 1: a buffer" in seen[2] and "its memory moved (shape (4,) torch.float32)" in seen[2]
        assert seen[3] == 2.0


def test_a_mismatch_or_bad_argument_fails_the_making_on_every_peer() -> None:
    def body(rt: col.Runtime, p: int) -> list[str]:
        said = []
        for make in (
            lambda: rt.all_reduce_init(p, np.zeros(3 + p)),
            lambda: rt.all_reduce_init(p, np.zeros(3), op="sum" if p else "nope"),
            lambda: rt.all_gather_init(p, np.zeros(2, np.float32 if p else np.int32)),
        ):
            try:
                make()
            except col.CollectiveError as exc:
                said.append(f"{type(exc).__name__}: {exc}")
        return said

    found = run_peers(2, body)
    assert found[0] == found[1]
    shape, op, dtype = found[0]
    assert shape == (
        "MismatchError: all_reduce_init #0: peers disagree on shape: peer 0 passed (3,), peer 1 passed (4,)"
    )
    assert op.startswith("InvalidArgumentError") and "peer 0" in op and "nope" in op
    assert dtype.startswith("MismatchError: all_gather_init #2") and "dtype" in dtype


def test_freeing_while_another_uses_is_named_on_both_and_a_freed_handle_refuses() -> None:
    def body(rt: col.Runtime, p: int) -> list[str]:
        said = []
        with rt.all_reduce_init(p, np.ones(2)) as handle:
            handle()
            try:
                handle.free() if p == 1 else handle()
            except col.MismatchError as exc:
                said.append(str(exc))
            try:
                handle()  # (over for both: peer 1 freed it, and peer 0 met that)
            except col.InvalidArgumentError as exc:
                said.append(str(exc))
        said.append(repr(handle))
        return said

    found = run_peers(2, body, timeout=3)
    mismatch = (
        "#2: peers called different collectives: peer 0 passed all_reduce, peer 1 passed all_reduce_free"
    )
    assert found[0][0] == found[1][0] == mismatch
    assert found[0][1] == found[1][1] == "this persistent all_reduce was freed: make another"
    assert [said[-1] for said in found.values()] == [
        "<Persistent all_reduce of peer 0 freed>",
        "<Persistent all_reduce of peer 1 freed>",
    ]


def test_a_use_one_peer_makes_late_times_out_naming_it_and_start_wait_runs_one_use_at_a_time() -> None:
    timed_out = threading.Event()

    def body(rt: col.Runtime, p: int) -> list[Any]:
        said: list[Any] = []
        handle = rt.all_reduce_init(p, np.ones(2))
        if p == 1:  # late: it finds the use failed, with the same error (the group stays in step)
            assert timed_out.wait(JOIN)
        try:
            handle(timeout=0.3)
        except col.CollectiveTimeout as exc:
            said.append(str(exc))
            timed_out.set()
        rt.barrier(p)
        handle.start()
        try:
            handle.start()
        except col.InvalidArgumentError as exc:
            said.append(str(exc))
        said.append(handle.wait().tolist())
        try:
            handle.wait()
        except col.InvalidArgumentError as exc:
            said.append(str(exc))
        handle.free()
        return said

    found = run_peers(2, body)
    late, twice, result, unstarted = found[0]
    assert late == found[1][0] == "all_reduce #1: peers waited 0.3s for peer 1 to call it"
    assert twice == "a use of this persistent all_reduce is running: wait() first"
    assert result == [2.0, 2.0] and found[1][2] == [2.0, 2.0]
    assert unstarted == "wait() on a persistent all_reduce with no use started: call start()"


@pytest.mark.parametrize("shm", [1, 0], ids=["shared-memory", "three-phases"])
def test_persistent_collectives_between_processes(orchestrator: str, shm: int) -> None:
    nodes = start_nodes(orchestrator, f"persistent-{shm}", 2, 1, "persistent", shm=shm)
    assert finish_all(nodes, 60) == [0, 0], [node.output() for node in nodes]
    assert all(node.wait_for("OK 22", 5) for node in nodes)


def test_a_peer_lost_between_uses_is_a_peer_lost_error_on_the_others(orchestrator: str) -> None:
    nodes = start_nodes(orchestrator, "persistent-lost", 3, 1, "persistent", "lost", timeout=30)
    left, _ = nodes[1].wait_for("LEAVING", 60)
    expect_peer_lost([nodes[0], nodes[2]], left, within=5, naming="peer 1")
    assert nodes[1].wait(10) == 0


def test_a_persistent_call_of_a_group_and_a_use_after_finish() -> None:
    def body(rt: col.Runtime, p: int) -> list[Any]:
        said: list[Any] = []
        if p in (1, 3):
            pair = col.new_group([1, 3])
            x = np.full(2, float(p))
            with rt.all_reduce_init(p, x, out=x, group=pair) as handle:
                said.append(handle().tolist())
        said.append(rt.all_reduce(p, np.ones(1))[0])  # (the world's steps are its own)
        later = rt.barrier_init(p)
        rt.finish(p)
        try:
            later()
        except col.RegistrationError as exc:
            said.append(str(exc))
        return said

    found = run_peers(4, body)
    assert found[1][0] == found[3][0] == [4.0, 4.0]
    assert all(said[-2] == 4.0 for said in found.values()), found
    assert all("has finished" in said[-1] for said in found.values()), found


def test_a_repeated_call_runs_kept_and_one_without_out_is_never_kept() -> None:
    """Runtime.repeat: the first run checks and agrees the call, and keeps it; each later one runs
    it again on the same buffer, reading its contents then; a call without ``out`` runs as any
    call each time (its result is the caller's)."""

    def body(rt: col.Runtime, p: int) -> list[Any]:
        x = np.zeros(3)
        call = AllReduce(x, "max", out=x)
        fresh = AllReduce(np.ones(2))
        seen = []
        for use in range(4):
            x[:] = p * 10 + use
            seen.append(rt.repeat(p, call).tolist())
            seen.append(rt.repeat(p, fresh).tolist())
        assert call.kept is not None and fresh.kept is None
        return seen

    found = run_peers(3, body)
    for use in range(4):
        assert all(seen[2 * use] == [20.0 + use] * 3 for seen in found.values()), found
        assert all(seen[2 * use + 1] == [3.0, 3.0] for seen in found.values()), found


def test_thread_peers_fuse_their_kept_calls_again_without_agreeing_or_choosing_anew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Among thread peers, a step of the same kept calls as a step fused before (two handles used in
    turn, as a layer's two all_reduces are) computes the results without the agreement and the
    executor's choice (``choose`` runs for none of the later uses); each use reads its inputs then,
    and a use met by another handle is still a mismatch on every peer, after which both go on."""
    import collective.executors.rendezvous as rendezvous

    chosen: list[str] = []
    real_choose = rendezvous.choose

    def counted(*args: Any) -> Any:
        chosen.append(args[-1])  # (the step's label)
        return real_choose(*args)

    monkeypatch.setattr(rendezvous, "choose", counted)
    counts: dict[int, int] = {}

    def body(rt: col.Runtime, p: int) -> list[Any]:
        x, y = np.zeros(2, np.float32), np.zeros(3, np.int64)
        first, second = rt.all_reduce_init(p, x, out=x), rt.all_reduce_init(p, y, op="max", out=y)
        seen = []
        for use in range(8):
            if use == 1:
                rt.barrier(p)
                if p == 0:
                    counts[0] = len(chosen)
                rt.barrier(p)
            x[:] = p + use
            y[:] = p * 10 + use
            seen.append((first().tolist(), second().tolist()))
        rt.barrier(p)
        if p == 0:
            counts[1] = len(chosen)
        try:
            (first if p == 0 else second)()
        except col.MismatchError as exc:
            seen.append(type(exc).__name__)
        x[:], y[:] = 1, p
        seen.append((first().tolist(), second().tolist()))
        first.free()
        second.free()
        return seen

    found = run_peers(4, body)
    for p, seen in found.items():
        assert not isinstance(seen, Exception), found
        for use in range(8):
            assert seen[use] == ([6.0 + 4 * use] * 2, [30 + use] * 3), (p, seen)
        assert seen[8:] == ["MismatchError", ([4.0] * 2, [3] * 3)], (p, seen)
    # the uses after the first chose nothing (the barriers between them chose their own step)
    assert [label for label in chosen[counts[0] : counts[1]] if "barrier" not in label] == []


def test_an_out_made_read_only_fails_the_use_on_every_peer() -> None:
    """Each use would write through the view made when the handle was: a read-only ``out`` now is
    a changed buffer (the result is not written), on every peer; the group goes on."""

    def body(rt: col.Runtime, p: int) -> list[Any]:
        x, out = np.ones(2), np.zeros(2)
        handle = rt.all_reduce_init(p, x, out=out)
        said: list[Any] = [handle().tolist()]
        out[:] = -1
        out.flags.writeable = p != 0
        try:
            handle()
        except col.InvalidArgumentError as exc:
            said.append(str(exc))
        said.append(out.tolist())
        out.flags.writeable = True
        said.append(handle().tolist())
        handle.free()
        return said

    for said in run_peers(2, body).values():
        assert said[0] == said[3] == [2.0, 2.0] and said[2] == [-1.0, -1.0], said
        told = "peer 0: a buffer of this persistent all_reduce changed since it was made: it is read-only"
        assert told in said[1], said


def test_a_buffer_whose_strides_changed_or_read_as_a_copy_fails_every_peer() -> None:
    """Each use reads and writes through the view made when the handle was: a torch tensor
    transposed in place (same shape, memory and dtype) is refused at the use, on every peer; a
    conjugate view (read as a copy) is refused when the handle is made."""
    torch = pytest.importorskip("torch")

    def body(rt: col.Runtime, p: int) -> list[str]:
        said = []
        square = torch.arange(4.0).reshape(2, 2)
        handle = rt.all_reduce_init(p, square, out=square)
        handle()
        if p == 0:
            square.t_()
        try:
            handle()
        except col.InvalidArgumentError as exc:
            said.append(str(exc))
        try:
            rt.all_reduce_init(p, torch.ones(2, dtype=torch.complex64).conj() if p == 1 else torch.ones(2))
        except col.InvalidArgumentError as exc:
            said.append(str(exc))
        return said

    for strides, conjugate in run_peers(2, body).values():
        assert (
            "peer 0: a buffer of this persistent all_reduce changed since it was made: its strides" in strides
        )
        assert (
            "peer 1: a persistent all_reduce: a conjugate or negative torch view is read as a copy"
            in conjugate
        )
