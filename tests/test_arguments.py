"""Arguments given in unusual forms or got wrong: numpy integers, the ``out`` list of a coalesced
call, a receive's ``out``, tags, timeouts of send and of ``Work.wait``; and reductions combined in
peer order by the Centralized and Direct schedules whichever peer is the root (thread peers)."""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import pytest

import collective as col
from tests.conftest import outcomes_of_peers, run_peers, wait_until

pytestmark = pytest.mark.timeout(60)


def _job(rt: col.Runtime, n: int, strategy: str | None = None, timeout: float = 20.0) -> None:
    strategies = (
        {} if strategy is None else {"local_all_reduce_strategy": strategy, "local_reduce_strategy": strategy}
    )
    config = col.CollectiveConfig(num_devices=n, timeout=timeout, **strategies)
    run_peers(n, lambda p: rt.register(p, "cpu", config), rt)


def test_numpy_integers_name_peers_roots_tags_and_group_members(runtime: col.Runtime) -> None:
    _job(runtime, 3)
    group = col.new_group(np.arange(1, 3))  # members computed with numpy
    assert group.members == (1, 2) and all(type(m) is int for m in group.members)

    def body(p: int) -> Any:
        total = runtime.reduce(p, np.full(2, p + 1.0), root=np.int64(2))
        if p == 0:
            runtime.send(p, np.arange(3.0), dst=np.int32(1), tag=np.uint8(4))
        got = runtime.recv(p, src=np.int64(0), tag=np.int16(4), timeout=5) if p == 1 else None
        in_group = runtime.all_reduce(p, np.ones(1), group=group) if p > 0 else None
        return total, got, in_group

    results = run_peers(3, body, runtime)
    np.testing.assert_array_equal(results[2][0], np.full(2, 6.0))
    assert results[0][0] is None and results[1][0] is None
    np.testing.assert_array_equal(results[1][1], np.arange(3.0))
    np.testing.assert_array_equal(results[2][2], np.full(1, 2.0))
    with pytest.raises(col.InvalidArgumentError, match="not peer ids"):
        col.new_group([np.True_, 1])


def test_numpy_numbers_are_timeouts(runtime: col.Runtime) -> None:
    """np.float32(1.0) as a timeout was an InvalidArgumentError on every peer (wait(): on the caller),
    while peer ids and tags took numpy integers."""
    _job(runtime, 2)

    def body(p: int) -> Any:
        work = runtime.all_reduce(p, np.ones(2), timeout=np.int64(5), async_op=True)
        return float(work.wait(np.float32(5.0))[0]), float(
            runtime.all_reduce(p, np.ones(1), timeout=np.float64(5))[0]
        )

    assert run_peers(2, body, runtime) == [(2.0, 2.0)] * 2
    config = col.CollectiveConfig(num_devices=2, timeout=np.float32(1.5))  # (a ConfigError)
    assert config.timeout == 1.5 and type(config.timeout) is float
    with pytest.raises(col.InvalidArgumentError, match="wait"):
        runtime.all_reduce(0, np.ones(1), async_op=True).wait(np.True_)  # (peer 1 never comes: refused first)


def test_a_numpy_integer_registers_a_peer_and_groups_are_made_while_the_job_forms() -> None:
    """register(np.int64(0)) said the id was outside the job; while peer 0 waited in register,
    world_size() was 0 and new_group([0, 1]) said the job's peers were 0..-1."""
    config = col.CollectiveConfig(num_devices=2, timeout=20)
    first = threading.Thread(target=col.register, args=(np.int64(0), "cpu", config))
    first.start()
    wait_until(col.default_runtime().has_job, 10, "peer 0 registering")
    assert col.world_size() == 2
    assert col.new_group([0, 1]).members == (0, 1)
    col.register(np.int32(1), "cpu", config)
    first.join(10)
    results = run_peers(2, lambda p: col.all_reduce(p, np.ones(1), group=col.new_group([0, 1])))
    assert [float(r[0]) for r in results] == [2.0, 2.0]
    run_peers(2, col.finish)


BAD_OUTS = {  # for an input x
    "shape": lambda x: np.empty((2, *x.shape), x.dtype),  # would broadcast the result
    "dtype": lambda x: np.empty(x.shape, np.int64),  # would truncate the floats
    "read-only": lambda x: np.frombuffer(np.zeros_like(x).tobytes(), x.dtype).reshape(x.shape),
    "strided": lambda x: np.empty(2 * x.size, x.dtype)[::2].reshape(x.shape),
    "no array": lambda x: [0.0] * x.size,
}


@pytest.mark.parametrize("bad", BAD_OUTS, ids=list(BAD_OUTS))
@pytest.mark.parametrize("dtypes", [1, 2], ids=["one-dtype", "two-dtypes"])
def test_a_bad_out_in_a_coalesced_list_fails_every_peer_before_data_moves(
    runtime: col.Runtime, bad: str, dtypes: int
) -> None:
    """With two dtypes the bad out is the second bucket's: still refused before the first moves."""
    _job(runtime, 3, timeout=5)
    lists = [
        [np.full(3, p + 0.75, np.float32), np.full(2, p, np.float64 if dtypes == 2 else np.float32)]
        for p in range(3)
    ]
    written = [np.full(3, -1.0, np.float32) for _ in range(3)]  # the first array's out: never written

    def body(p: int) -> Any:
        outs: list[Any] = [written[p], np.empty_like(lists[p][1])]
        if p == 1:
            outs[1] = BAD_OUTS[bad](lists[p][1])
        return runtime.all_reduce_coalesced(p, lists[p], out=outs)

    outcomes = outcomes_of_peers(3, body, runtime)
    for peer, outcome in enumerate(outcomes):
        assert isinstance(outcome, col.InvalidArgumentError), (peer, outcome)
        assert "peer 1: out[1]: " in str(outcome), outcome  # the item, by its index in the list
    for out in written:
        np.testing.assert_array_equal(out, np.full(3, -1.0, np.float32))
    after = run_peers(3, lambda p: runtime.all_reduce_coalesced(p, lists[p]), runtime)  # still in step
    for result in after:
        np.testing.assert_array_equal(result[0], np.full(3, 0.75 * 3 + 3, np.float32))
        np.testing.assert_array_equal(result[1], np.full(2, 3.0))


def test_coalesced_out_may_be_the_inputs_themselves(runtime: col.Runtime) -> None:
    _job(runtime, 2)
    lists = [[np.full((2, 2), p + 1.0), np.full(3, p + 1, np.int32)] for p in range(2)]
    results = run_peers(2, lambda p: runtime.all_reduce_coalesced(p, lists[p], out=lists[p]), runtime)
    for p in range(2):
        assert results[p][0] is lists[p][0] and results[p][1] is lists[p][1]
        np.testing.assert_array_equal(lists[p][0], np.full((2, 2), 3.0))
        np.testing.assert_array_equal(lists[p][1], np.full(3, 3, np.int32))


def test_a_recv_out_that_cannot_take_the_message_leaves_it_queued(runtime: col.Runtime) -> None:
    _job(runtime, 2)
    runtime.send(0, np.arange(4, dtype=np.float32), dst=1, tag=3)
    refused = {
        "shape": (
            np.empty(5, np.float32),
            r"recv: peer 1: out has shape \(5,\).*peer 0 sent \(4,\) float32.*still there",
        ),
        "dtype": (np.empty(4, np.float64), r"dtype float64; peer 0 sent \(4,\) float32"),
        "read-only": (np.frombuffer(bytes(16), np.float32), "out must be a writeable array"),
        "no array": ([0.0] * 4, "out must be an array"),
    }
    for out, message in refused.values():
        with pytest.raises(col.InvalidArgumentError, match=message):
            runtime.recv(1, src=0, tag=3, timeout=5, out=out)
    strided = np.zeros(8, np.float32)[::2]  # any writeable array of the sender's shape and dtype
    assert runtime.recv(1, src=0, tag=3, timeout=5, out=strided) is strided
    np.testing.assert_array_equal(strided, np.arange(4, dtype=np.float32))


TAG_RANGE = r"tag must be an integer from 0 to 2\*\*63 - 1"


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda rt: rt.send(0, np.ones(2), dst=1, tag=2**63), TAG_RANGE),
        (lambda rt: rt.recv(1, src=0, tag=2**64), TAG_RANGE),
        (lambda rt: rt.send(0, np.ones(2), dst=1, timeout=-1), "timeout must be a finite number"),
        (lambda rt: rt.send(0, np.ones(2), dst=1, timeout="x"), "timeout must be a finite number"),
    ],
    ids=["send-tag-2**63", "recv-tag-2**64", "send-timeout-negative", "send-timeout-text"],
)
def test_tags_and_send_timeouts_are_checked(runtime: col.Runtime, call: Any, expected: str) -> None:
    _job(runtime, 2)
    with pytest.raises(col.InvalidArgumentError, match=expected):
        call(runtime)
    runtime.send(0, np.ones(2), dst=1, tag=2**63 - 1)  # the largest tag travels
    np.testing.assert_array_equal(runtime.recv(1, src=0, tag=2**63 - 1, timeout=5), np.ones(2))


def test_work_wait_takes_none_infinity_or_seconds(runtime: col.Runtime) -> None:
    _job(runtime, 2)

    def body(p: int) -> Any:
        work = runtime.all_reduce(p, np.ones(2), async_op=True)
        for bad in ("1", -1.0, math.nan, True):
            with pytest.raises(col.InvalidArgumentError, match="wait\\(timeout\\) takes seconds"):
                work.wait(bad)
        return work.wait(math.inf), runtime.all_reduce(p, np.ones(1), async_op=True).wait(1e12)

    for first, second in run_peers(2, body, runtime):
        np.testing.assert_array_equal(first, np.full(2, 2.0))
        np.testing.assert_array_equal(second, np.full(1, 2.0))


@pytest.mark.parametrize("strategy", ["centralized", "direct"])
@pytest.mark.parametrize("root", [0, 1, 2])
def test_centralized_and_direct_combine_in_peer_order_whatever_the_root(strategy: str, root: int) -> None:
    """(1e8 + 1) - 1e8 is 0 in float32 and 1e8 + (1 - 1e8) is not: only peer order gives numpy's bits."""
    values = np.array([1e8, 1.0, -1e8], np.float32)
    inputs = [np.full(6, v, np.float32) for v in values]
    expected = (inputs[0] + inputs[1]) + inputs[2]
    with col.Runtime(0, 0) as rt:  # every size through the configured schedule
        _job(rt, 3, strategy)
        results = run_peers(
            3, lambda p: (rt.reduce(p, inputs[p], root=root), rt.all_reduce(p, inputs[p])), rt
        )
        copies = [x.copy() for x in inputs]
        run_peers(3, lambda p: rt.all_reduce(p, copies[p], out=copies[p]), rt)  # in place
        root_copy = inputs[root].copy()
        run_peers(
            3,
            lambda p: rt.reduce(
                p, root_copy if p == root else inputs[p], root=root, out=root_copy if p == root else None
            ),
            rt,
        )
    np.testing.assert_array_equal(results[root][0], expected)
    np.testing.assert_array_equal(root_copy, expected)
    for p, (_, everywhere) in enumerate(results):
        np.testing.assert_array_equal(everywhere, expected)
        np.testing.assert_array_equal(copies[p], expected)


def test_an_out_that_reads_only_as_a_copy_is_refused_on_every_peer(runtime: col.Runtime) -> None:
    """A numpy scalar as out was written through a temporary copy: the caller's out came back
    unchanged (0.0 for 3.0) and a recv lost its message."""
    _job(runtime, 2, timeout=5)
    scalar = "a numpy scalar cannot be written"

    def body(p: int) -> Any:
        with pytest.raises(col.InvalidArgumentError, match=scalar):
            runtime.all_reduce(p, np.float32(p + 1), out=np.float32(0))
        with pytest.raises(col.InvalidArgumentError, match=f"peer 1: out: {scalar}"):
            runtime.broadcast(p, np.float64(5) if p == 0 else None, out=None if p == 0 else np.float64(0))
        with pytest.raises(col.InvalidArgumentError, match=rf"out\[1\]: {scalar}"):
            runtime.all_reduce_coalesced(p, [np.ones(2), np.ones(1)], out=[np.ones(2), np.float64(0)])
        runtime.send(p, np.float64(p + 7), dst=1 - p)
        with pytest.raises(col.InvalidArgumentError, match=f"recv: peer {p}: out: {scalar}"):
            runtime.recv(p, src=1 - p, out=np.float64(0))
        zero_d = np.empty((), np.float64)
        return runtime.recv(p, src=1 - p, out=zero_d), runtime.all_reduce(p, np.float32(p + 1))

    for p, (received, reduced) in enumerate(run_peers(2, body, runtime)):
        assert received.shape == () and received == 1 - p + 7  # the message stayed queued
        assert reduced == 3.0


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_numpy_subclasses_read_as_arrays_and_a_masked_array_is_refused(
    runtime: col.Runtime, tmp_path: Any
) -> None:
    """A list mixing ndarray and memmap was refused as 'not all in host memory'; a list of
    np.matrix raised a bare ValueError after the data moved; a masked array's mask would be lost."""
    _job(runtime, 2, timeout=5)
    maps = [np.memmap(tmp_path / f"out{p}", np.float64, "w+", shape=(3,)) for p in range(2)]

    def body(p: int) -> Any:
        mixed = runtime.all_reduce_coalesced(
            p, [np.full(2, p + 1.0), np.memmap(tmp_path / f"in{p}", np.float64, "w+", shape=(4,))]
        )
        matrices = runtime.all_reduce_coalesced(p, [np.matrix(np.full((2, 3), p + 1.0))] * 2)
        written = runtime.all_reduce(p, np.full(3, p + 1.0), out=maps[p])
        with pytest.raises(col.InvalidArgumentError, match="masked array's mask would be ignored"):
            runtime.all_reduce(p, np.ma.masked_array(np.ones(3), [0, 1, 0]))
        return mixed, matrices, written

    for p, (mixed, matrices, written) in enumerate(run_peers(2, body, runtime)):
        np.testing.assert_array_equal(mixed[0], np.full(2, 3.0))
        np.testing.assert_array_equal(mixed[1], np.zeros(4))
        assert [m.shape for m in matrices] == [(2, 3), (2, 3)]
        np.testing.assert_array_equal(matrices[1], np.full((2, 3), 3.0))
        assert written is maps[p]
        np.testing.assert_array_equal(maps[p], np.full(3, 3.0))


def test_big_endian_arrays_are_computed_in_and_a_long_double_is_refused(runtime: col.Runtime) -> None:
    """Both as between processes (tests/test_shm_executor.py): a long double's layout is the
    platform's, so no peer takes one, in one process or several."""
    _job(runtime, 3, timeout=5)

    def body(p: int) -> Any:
        with pytest.raises(col.InvalidArgumentError, match=r"float128 \(long double\)"):
            runtime.all_reduce(p, np.ones(2, np.longdouble))
        return runtime.all_reduce(p, (np.arange(4) * (p + 1)).astype(">f4"))

    for result in run_peers(3, body, runtime):
        assert result.dtype == np.dtype(">f4")
        np.testing.assert_array_equal(result, np.arange(4) * 6.0)


def test_recv_any_takes_the_earliest_message_of_its_tag_from_any_peer(runtime: col.Runtime) -> None:
    """MPI's ANY_SOURCE: (the sender, the array); a tag of its own; out=; a timeout naming no peer."""
    _job(runtime, 3, timeout=5)
    runtime.send(2, np.array([2.0]), 0, tag=4)
    runtime.send(1, np.array([1.0]), 0, tag=4)
    runtime.send(1, np.array([9.0]), 0, tag=5)
    runtime.send(2, np.array([3.0]), 0, tag=4)
    got = [runtime.recv_any(0, tag=4) for _ in range(2)]
    assert [(source, float(array[0])) for source, array in got] == [(2, 2.0), (1, 1.0)]
    out = np.zeros(1)
    source, filled = runtime.recv_any(0, tag=4, out=out)
    assert source == 2 and filled is out and out[0] == 3.0
    assert runtime.recv(0, 1, tag=5)[0] == 9.0
    with pytest.raises(col.CollectiveTimeout, match="from any peer with tag 4") as caught:
        runtime.recv_any(0, tag=4, timeout=0.1)
    assert caught.value.missing == ()
    with pytest.raises(col.InvalidArgumentError, match="tag must be an integer"):
        runtime.recv_any(0, tag=-1)
    runtime.finish(1)
    runtime.send(2, np.array([5.0]), 0, tag=4)
    runtime.finish(2)  # what it sent is still received; then no peer is left to send: at once
    assert runtime.recv_any(0, tag=4)[0] == 2
    with pytest.raises(col.PeerLostError, match="left the job"):
        runtime.recv_any(0, tag=4, timeout=30)
