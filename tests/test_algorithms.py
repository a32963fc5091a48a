"""The algorithms alone, over simulated recording links: results, ownership, message/byte counts."""

from __future__ import annotations

import doctest
import itertools
import math

import numpy as np
import pytest

from collective.algorithms import ops, ring, strategies
from collective.algorithms.ops import Blocks, ReduceOp, chunk_bounds, transpose_blocks
from collective.algorithms.ring import DEFAULT_SEGMENT_BYTES
from collective.algorithms.strategies import Centralized, Direct, Ring, Strategy, Tree, resolve_all_reduce
from collective.algorithms.tree import children
from collective.errors import InvalidArgumentError
from tests.conftest import peer_input, reference
from tests.recording import Network, RecordingLink

STRATEGIES = [Centralized(), Tree(1), Tree(2), Tree(3), Tree(5), Ring(), Direct()]
SIZES = [1, 2, 3, 4, 5, 8]
LENGTHS = [0, 1, 3, 17, 1000]


def ids(value: object) -> str:
    return str(value)


def _inputs(n: int, length: int, dtype: str = "int64") -> list[np.ndarray]:
    return [peer_input(peer, (length,), dtype) for peer in range(n)]


def _expected_all_reduce_traffic(
    strategy: Strategy, n: int, length: int, itemsize: int
) -> list[tuple[int, int]]:
    """(messages sent, bytes sent) per peer from the textbook schedule."""
    nbytes = length * itemsize
    match resolve_all_reduce(strategy, length, n):
        case Centralized():
            return [((n - 1), (n - 1) * nbytes)] + [(1, nbytes)] * (n - 1)
        case Tree(arity):
            out = []
            for rank in range(n):
                down = len(children(rank, n, arity))
                up = 1 if rank else 0
                out.append((up + down, (up + down) * nbytes))
            return out
        case Ring():
            chunk = [(hi - lo) * itemsize for lo, hi in chunk_bounds(length, n)]
            if n == 1:
                return [(0, 0)]
            return [(2 * (n - 1), 2 * nbytes - chunk[(r + 1) % n] - chunk[(r + 2) % n]) for r in range(n)]
        case Direct():  # n-1 chunks out in each phase: every other peer's chunk, then (n-1) x its own
            chunk = [(hi - lo) * itemsize for lo, hi in chunk_bounds(length, n)]
            return [(2 * (n - 1), nbytes - chunk[r] + (n - 1) * chunk[r]) for r in range(n)]
    raise AssertionError(strategy)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
@pytest.mark.parametrize("length", LENGTHS)
def test_all_reduce_result_traffic_and_ownership(strategy: Strategy, n: int, length: int) -> None:
    inputs = _inputs(n, length)
    originals = [x.copy() for x in inputs]
    outputs = [np.full(length, -1, np.int64) for _ in range(n)]
    network = Network(n)
    network.run(
        lambda link: strategies.all_reduce(
            strategy, link, inputs[link.rank], outputs[link.rank], ReduceOp.SUM
        )
    )
    expected = reference(inputs, "sum")
    for peer in range(n):
        np.testing.assert_array_equal(outputs[peer], expected)
        np.testing.assert_array_equal(inputs[peer], originals[peer])  # the input is never written
    assert network.violations == []
    sent = [(t.sent_messages, t.sent_bytes) for t in network.traffic]
    assert sent == _expected_all_reduce_traffic(strategy, n, length, 8)
    total_sent = sum(t.sent_bytes for t in network.traffic)
    assert total_sent == sum(t.received_bytes for t in network.traffic)


@pytest.mark.parametrize("n", [4, 5])
def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_array(n: int) -> None:
    length = 1000 * n  # divisible: every chunk the same size
    inputs = _inputs(n, length)
    outputs = [np.empty(length, np.int64) for _ in range(n)]
    network = Network(n)
    network.run(
        lambda link: strategies.all_reduce(Ring(), link, inputs[link.rank], outputs[link.rank], ReduceOp.SUM)
    )
    for traffic in network.traffic:
        assert traffic.sent_messages == traffic.received_messages == 2 * (n - 1)
        assert traffic.sent_bytes == 2 * (n - 1) * length * 8 // n


@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
@pytest.mark.parametrize("n", [1, 3, 4])
def test_all_reduce_in_place(strategy: Strategy, n: int) -> None:
    """dst may be src itself (the runtime's out=x): the schedules only read what they have not written."""
    buffers = _inputs(n, 17)
    expected = reference(buffers, "sum")
    network = Network(n)
    network.run(
        lambda link: strategies.all_reduce(
            strategy, link, buffers[link.rank], buffers[link.rank], ReduceOp.SUM
        )
    )
    for buffer in buffers:
        np.testing.assert_array_equal(buffer, expected)
    assert network.violations == []


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
@pytest.mark.parametrize("op", ["sum", "max", "prod"])
def test_reduce_every_root(strategy: Strategy, n: int, op: str) -> None:
    length = 17
    inputs = [peer_input(peer, (length,), "int64", small=True) for peer in range(n)]
    expected = reference(inputs, op)
    for root in range(n):
        out = np.full(length, -7, np.int64)
        network = Network(n)
        network.run(
            lambda link, root=root, out=out: strategies.reduce(
                strategy, link, root, inputs[link.rank], out if link.rank == root else None, ReduceOp(op)
            )
        )
        np.testing.assert_array_equal(out, expected)
        assert network.violations == []
        sent = [t.sent_messages for t in network.traffic]
        received = [t.received_messages for t in network.traffic]
        match strategy:
            case Centralized():
                assert sent == [0 if r == root else 1 for r in range(n)]
                assert received[root] == n - 1
            case Tree(arity):
                for rank in range(n):
                    position = (rank - root) % n
                    assert sent[rank] == (0 if position == 0 else 1)
                    assert received[rank] == len(children(position, n, arity))
            case Ring():  # 17 elements are one segment: a chain root+1 -> ... -> root
                for rank in range(n):
                    position = (rank - root - 1) % n
                    assert sent[rank] == (0 if position == n - 1 else 1)
                    assert received[rank] == (0 if position == 0 else 1)
            case Direct():  # reduce-scatter (n-1 out, n-1 in), then every owner sends its chunk to the root
                for rank in range(n):
                    assert sent[rank] == (n - 1) + (0 if rank == root else 1)
                    assert received[rank] == (n - 1) + (n - 1 if rank == root else 0)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_broadcast_every_root(strategy: Strategy, n: int) -> None:
    length = 17
    data = peer_input(99, (length,), "float32")
    for root in range(n):
        buffers = [data.copy() if rank == root else np.zeros(length, np.float32) for rank in range(n)]
        network = Network(n)
        network.run(
            lambda link, root=root, buffers=buffers: strategies.broadcast(
                strategy, link, root, buffers[link.rank]
            )
        )
        for buffer in buffers:
            assert buffer.tobytes() == data.tobytes()
        assert network.violations == []
        received = [t.received_messages for t in network.traffic]
        sent_total = sum(t.sent_messages for t in network.traffic)
        if isinstance(strategy, Direct):  # scatter, then all-gather: a non-root gets its chunk + n-1 chunks
            assert received == [0 if rank == root else n for rank in range(n)]
            assert sent_total == 2 * (n - 1) + (n - 1) * (n - 2)
        else:  # the whole array once to every other peer
            assert received == [0 if rank == root else 1 for rank in range(n)]
            assert sent_total == n - 1


def test_ring_reduce_and_broadcast_pipeline_in_segments() -> None:
    n, length = 4, 3 * DEFAULT_SEGMENT_BYTES // 8 + 5  # 4 segments of float64
    segments = math.ceil(length * 8 / DEFAULT_SEGMENT_BYTES)
    assert segments == 4
    inputs = _inputs(n, length, "float64")
    out = np.empty(length)
    network = Network(n)
    network.run(
        lambda link: strategies.reduce(
            Ring(), link, 2, inputs[link.rank], out if link.rank == 2 else None, ReduceOp.SUM
        )
    )
    np.testing.assert_allclose(out, reference(inputs, "sum"))
    # chain 3 -> 0 -> 1 -> 2: the head only sends, the root only receives, each once per segment
    assert [t.sent_messages for t in network.traffic] == [segments, segments, 0, segments]
    assert [t.received_messages for t in network.traffic] == [segments, segments, segments, 0]
    assert all(t.sent_bytes in (0, length * 8) for t in network.traffic)
    buffers = [inputs[0].copy() if r == 0 else np.zeros(length) for r in range(n)]
    network = Network(n)
    network.run(lambda link: strategies.broadcast(Ring(), link, 0, buffers[link.rank]))
    assert all(np.array_equal(b, inputs[0]) for b in buffers)
    assert [t.sent_messages for t in network.traffic] == [segments, segments, segments, 0]


def test_ring_falls_back_to_tree_below_one_element_per_peer(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG", logger="collective.algorithms.strategies")
    assert resolve_all_reduce(Ring(), 3, 4) == Tree(2)
    assert "falling back to tree:2" in caplog.text
    assert resolve_all_reduce(Ring(), 4, 4) == Ring()
    assert resolve_all_reduce(Tree(3), 0, 4) == Tree(3)


@pytest.mark.parametrize(("length", "parts"), [(5, 4), (17, 4), (4, 4), (0, 3), (1000, 7), (3, 1)])
def test_chunk_bounds_cover_the_array_with_sizes_within_one(length: int, parts: int) -> None:
    bounds = chunk_bounds(length, parts)
    assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 0


def test_ring_refuses_fewer_elements_than_peers() -> None:
    network = Network(3)
    with pytest.raises(AssertionError, match="at least 3 elements"):
        network.run(lambda link: ring.all_reduce(link, np.ones(2), np.ones(2), ReduceOp.SUM))


def test_recording_link_catches_a_write_to_a_lent_buffer() -> None:
    """The ownership check itself works: an algorithm that reuses a sent buffer too early is caught."""

    def careless(link: RecordingLink) -> None:
        buffer = np.arange(4.0)
        if link.rank == 0:
            link.send(1, buffer)
            buffer += 1  # written before peer 1 consumed it and before flush()
        else:
            link.recv_into(0, np.empty(4))

    network = Network(2)
    network.run(careless)
    assert network.violations == ["peer 0 wrote to a buffer lent to peer 1"]


def test_the_ops_doctests_hold() -> None:
    failures, tried = doctest.testmod(ops)
    assert tried > 0 and failures == 0


@pytest.mark.parametrize("sizes", [[1, -1], [True, 2], [1.0], 3, ["2"], [None]], ids=repr)
def test_blocks_refuse_what_is_not_a_size(sizes: object) -> None:
    with pytest.raises(InvalidArgumentError, match="block sizes must be integers >= 0"):
        Blocks(sizes)  # type: ignore[arg-type]


def test_blocks_are_values() -> None:
    blocks = Blocks(np.array([2, 0, 3]))  # numpy integers are sizes too
    assert blocks == Blocks([2, 0, 3]) == Blocks((2, 0, 3)) and hash(blocks) == hash(Blocks([2, 0, 3]))
    assert blocks != Blocks([2, 3]) and blocks.sizes == (2, 0, 3)
    assert [blocks.of(i) for i in range(3)] == [slice(0, 2), slice(2, 2), slice(2, 5)]
    assert blocks.span(0, 3) == slice(0, 5) and blocks.span(1, 1) == slice(2, 2)
    assert Blocks([]).total == 0 and Blocks.equal(4, 0).total == 0
    assert Blocks.equal(3, 5).of(2) == ops.block(2, 5)


@pytest.mark.parametrize("peers", [1, 2, 3, 5])
def test_transpose_blocks_by_counts(peers: int) -> None:
    rng = np.random.default_rng(peers)
    for counts in (rng.integers(0, 4, (peers, peers)).tolist(), [[3] * peers] * peers, [[0] * peers] * peers):
        rows = [np.arange(sum(row)) + 100 * i for i, row in enumerate(counts)]
        sent = [np.split(row, np.cumsum(counts[i])[:-1]) for i, row in enumerate(rows)]
        expected = np.concatenate([sent[i][j] for j in range(peers) for i in range(peers)]).astype(np.int64)
        out = np.empty(expected.size, np.int64)
        transpose_blocks(np.concatenate(rows).astype(np.int64), out, peers, counts)
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_large_half_precision_reductions_give_numpys_bits_with_or_without_torch(
    dtype: str, op: ReduceOp
) -> None:
    """A large float16 sum or product runs on torch's kernel when torch is imported (~30x faster):
    the same bits as numpy's ufunc, infinities, NaN and signed zeros included."""
    import ml_dtypes

    from collective.algorithms.ops import HALF_KERNELS_FROM, NUMPY_UFUNCS, combine, elementwise

    pytest.importorskip("torch")  # (loads it: the kernel path is taken where it applies)
    kind = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(3)
    a, b = ((rng.standard_normal(HALF_KERNELS_FROM + 7) * 300).astype(kind) for _ in range(2))
    a[:6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 60000.0]
    b[:6] = [1.0, -np.inf, np.nan, -0.0, -0.0, 60000.0]
    out = np.empty_like(a)
    with np.errstate(all="ignore"):
        combine(op, a, b, out)
        want = NUMPY_UFUNCS[op](a, b)
    assert out.view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
    uses_torch = dtype == "float16" and op in (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.PROD)
    assert (elementwise(op, a) is not NUMPY_UFUNCS[op]) == uses_torch
