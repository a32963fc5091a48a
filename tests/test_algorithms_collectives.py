"""The block collectives (all_gather, reduce_scatter, all_to_all, gather, scatter, barrier) alone.

Over simulated recording links: results against numpy, bit-identical copies, the Link ownership
rule, and the exact messages and bytes each peer sends under every strategy. A few also run over
the in-process transport with buffers large enough to be lent rather than copied.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from collective.algorithms import ring, strategies, tree
from collective.algorithms.ops import BITWISE, Blocks, ReduceOp
from collective.algorithms.strategies import Centralized, Direct, Ring, Strategy, Tree
from collective.errors import InvalidArgumentError
from collective.transport.inproc import COPY_BELOW, Exchange, InProcessLink
from tests.collective_costs import Traffic, expected_traffic, in_subtree, subtree_size
from tests.conftest import assert_matches, peer_input, reference
from tests.recording import Network, RecordingLink, run_links

STRATEGIES = [Centralized(), Tree(1), Tree(2), Tree(3), Ring(), Direct()]
PEERS = [1, 2, 3, 4, 5, 7]
BLOCKS = [0, 1, 17, 1000]  # elements per block
DTYPES = ["float32", "float64", "int32", "float16"]


def ids(value: object) -> str:
    return str(value)


def sent(network: Network) -> Traffic:
    return [(t.sent_messages, t.sent_bytes) for t in network.traffic]


def run(n: int, body: Callable[[RecordingLink], Any]) -> Network:
    """Run ``body`` on a fresh recording network; every message consumed, no ownership violation."""
    network = Network(n)
    network.run(body)
    assert network.violations == []
    assert sum(t.sent_bytes for t in network.traffic) == sum(t.received_bytes for t in network.traffic)
    return network


def inputs(n: int, length: int, dtype: str, small: bool = False) -> list[np.ndarray]:
    return [peer_input(peer, (length,), dtype, small=small) for peer in range(n)]


def unchanged(arrays: list[np.ndarray], originals: list[np.ndarray]) -> bool:
    return all(a.tobytes() == o.tobytes() for a, o in zip(arrays, originals, strict=True))


def blocks_of(array: np.ndarray, n: int) -> list[np.ndarray]:
    return np.split(array, n)


# -- all_gather -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n", PEERS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_all_gather(strategy: Strategy, n: int, block: int, dtype: str) -> None:
    src = inputs(n, block, dtype)
    originals = [x.copy() for x in src]
    dst = [np.full(n * block, 7, dtype) for _ in range(n)]
    network = run(n, lambda link: strategies.all_gather(strategy, link, src[link.rank], dst[link.rank]))
    expected = np.concatenate(src).tobytes()
    assert all(d.tobytes() == expected for d in dst)  # copies: bit-identical on every peer
    assert unchanged(src, originals)
    assert sent(network) == expected_traffic("all_gather", strategy, n, block * np.dtype(dtype).itemsize)


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_all_gather_in_place(strategy: Strategy, n: int) -> None:
    """``src`` may be this peer's own block of ``dst`` (no copy in): no schedule writes it early."""
    blocks = inputs(n, 17, "int32")
    dst = [np.zeros(n * 17, np.int32) for _ in range(n)]
    for rank in range(n):
        dst[rank][17 * rank : 17 * (rank + 1)] = blocks[rank]
    run(
        n,
        lambda link: strategies.all_gather(
            strategy, link, dst[link.rank][17 * link.rank : 17 * (link.rank + 1)], dst[link.rank]
        ),
    )
    assert all(d.tobytes() == np.concatenate(blocks).tobytes() for d in dst)


@pytest.mark.parametrize("sizes", [[5, 0, 9, 3], [8, 8, 8, 8], [0, 0, 1, 0]])
def test_ring_all_gather_relays_its_blocks_in_segments(sizes: list[int]) -> None:
    """Each block travels in pieces of at most ``segment_bytes`` (an empty one as one empty
    message), every piece relayed as soon as it arrived: the same result, more messages."""
    n, segment = len(sizes), 3 * 4  # 3 float32 elements per piece
    blocks = Blocks(sizes)
    src = [peer_input(peer, (sizes[peer],), "float32") for peer in range(n)]
    dst = [np.full(sum(sizes), 7, np.float32) for _ in range(n)]
    network = run(n, lambda link: ring.all_gather(link, src[link.rank], dst[link.rank], blocks, segment))
    assert all(d.tobytes() == np.concatenate(src).tobytes() for d in dst)
    pieces = [max(1, -(-size // 3)) for size in sizes]
    for rank, traffic in enumerate(network.traffic):  # blocks rank, rank-1, ..., rank-(n-2) leave it
        relayed = [(rank - step) % n for step in range(n - 1)]
        assert traffic.sent_messages == sum(pieces[b] for b in relayed)
        assert traffic.sent_bytes == 4 * sum(sizes[b] for b in relayed)


# -- reduce_scatter -------------------------------------------------------------------------


def _reduce_scatter(
    strategy: Strategy, src: list[np.ndarray], op: ReduceOp
) -> tuple[list[np.ndarray], Network]:
    n = len(src)
    block = src[0].size // n
    dst = [np.full(block, 7, src[0].dtype) for _ in range(n)]
    network = run(
        n, lambda link: strategies.reduce_scatter(strategy, link, src[link.rank], dst[link.rank], op)
    )
    return dst, network


def _in_peer_order(strategy: Strategy) -> bool:
    """Direct and Centralized combine each block in peer order 0, 1, ..., n-1, as numpy does here."""
    return isinstance(strategy, Direct | Centralized)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n", PEERS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_reduce_scatter_sum(strategy: Strategy, n: int, block: int, dtype: str) -> None:
    src = inputs(n, n * block, dtype)
    originals = [x.copy() for x in src]
    dst, network = _reduce_scatter(strategy, src, ReduceOp.SUM)
    expected = blocks_of(reference(src, "sum"), n)
    for rank in range(n):
        if _in_peer_order(strategy):
            assert dst[rank].tobytes() == expected[rank].tobytes()
        else:
            assert_matches(dst[rank], expected[rank], n)
    assert unchanged(src, originals)
    assert sent(network) == expected_traffic("reduce_scatter", strategy, n, block * np.dtype(dtype).itemsize)


@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda op: op.value)
@pytest.mark.parametrize("n", [1, 3, 4, 7])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_reduce_scatter_every_op(strategy: Strategy, n: int, op: ReduceOp) -> None:
    """Small integers in floats (integers for the bitwise ops): every op is exact in any order, so
    every schedule matches bit for bit."""
    src = inputs(n, n * 17, "int64" if op in BITWISE else "float64", small=True)
    dst, _ = _reduce_scatter(strategy, src, op)
    expected = blocks_of(reference(src, "sum" if op is ReduceOp.MEAN else op.value), n)  # MEAN sums here
    for rank in range(n):
        assert dst[rank].tobytes() == expected[rank].tobytes()


@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_reduce_scatter_is_deterministic(strategy: Strategy) -> None:
    """Rounding depends on the schedule's fixed order only, not on which message arrives first."""
    src = inputs(5, 5 * 301, "float32")
    first, _ = _reduce_scatter(strategy, src, ReduceOp.SUM)
    for _ in range(3):
        again, _ = _reduce_scatter(strategy, src, ReduceOp.SUM)
        assert [a.tobytes() for a in again] == [f.tobytes() for f in first]


# -- all_to_all -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float16"])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n", PEERS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_all_to_all(strategy: Strategy, n: int, block: int, dtype: str) -> None:
    src = inputs(n, n * block, dtype)
    originals = [x.copy() for x in src]
    dst = [np.full(n * block, 7, dtype) for _ in range(n)]
    network = run(n, lambda link: strategies.all_to_all(strategy, link, src[link.rank], dst[link.rank]))
    for receiver in range(n):
        expected = np.concatenate([blocks_of(src[sender], n)[receiver] for sender in range(n)])
        assert dst[receiver].tobytes() == expected.tobytes()
    assert unchanged(src, originals)
    assert sent(network) == expected_traffic("all_to_all", strategy, n, block * np.dtype(dtype).itemsize)


# -- gather and scatter, every root -----------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n", PEERS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_gather_every_root(strategy: Strategy, n: int, block: int) -> None:
    for dtype in ("float32", "int32"):
        src = inputs(n, block, dtype)
        expected = np.concatenate(src).tobytes()
        for root in range(n):
            out = np.full(n * block, 7, dtype)
            network = run(
                n,
                lambda link, root=root, out=out, src=src: strategies.gather(
                    strategy, link, root, src[link.rank], out if link.rank == root else None
                ),
            )
            assert out.tobytes() == expected, f"root {root}, {dtype}"
            itemsize = np.dtype(dtype).itemsize
            assert sent(network) == expected_traffic("gather", strategy, n, block * itemsize, root)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n", PEERS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_scatter_every_root(strategy: Strategy, n: int, block: int) -> None:
    for dtype in ("float64", "float16"):
        whole = peer_input(99, (n * block,), dtype)
        original = whole.copy()
        for root in range(n):
            dst = [np.full(block, 7, dtype) for _ in range(n)]
            network = run(
                n,
                lambda link, root=root, dst=dst, whole=whole: strategies.scatter(
                    strategy, link, root, whole if link.rank == root else None, dst[link.rank]
                ),
            )
            for rank, part in enumerate(blocks_of(whole, n)):
                assert dst[rank].tobytes() == part.tobytes(), f"root {root}, peer {rank}, {dtype}"
            assert whole.tobytes() == original.tobytes()
            itemsize = np.dtype(dtype).itemsize
            assert sent(network) == expected_traffic("scatter", strategy, n, block * itemsize, root)


@pytest.mark.parametrize(("n", "arity"), [(1, 2), (7, 2), (7, 3), (12, 3), (20, 2), (6, 1), (9, 4)])
def test_tree_subtrees_in_preorder(n: int, arity: int) -> None:
    """The packing order of Tree gather/scatter: a position, then each child's subtree in turn."""
    for position in range(n):
        order = tree.subtree(position, n, arity)
        assert sorted(order) == [q for q in range(n) if in_subtree(position, q, arity)]
        assert tree.subtree_size(position, n, arity) == len(order)
        offset = 1
        for child in tree.children(position, n, arity):
            size = subtree_size(child, n, arity)
            assert order[offset : offset + size] == tree.subtree(child, n, arity)
            offset += size
    if (n, arity) == (7, 2):
        assert tree.subtree(0, 7, 2) == [0, 1, 3, 4, 2, 5, 6]


# -- barrier --------------------------------------------------------------------------------


def _barrier_rounds(
    strategy: Strategy, links: list[Any], late: int, rounds: int = 2
) -> list[tuple[int, str]]:
    """Each peer enters ``rounds`` barriers in a row, ``late`` always a little after the others."""
    events: list[tuple[int, str]] = []
    lock = threading.Lock()

    def body(link: Any) -> None:
        for index in range(rounds):
            if link.rank == late:
                time.sleep(0.003)  # (kept: the late peer under test; the checks hold whoever enters first)
            with lock:
                events.append((index, "in"))
            strategies.barrier(strategy, link)
            with lock:
                events.append((index, "out"))

    run_links(links, body)
    return events


def _assert_separated(events: list[tuple[int, str]], n: int, rounds: int = 2) -> None:
    for index in range(rounds):
        mine = [kind for round_, kind in events if round_ == index]
        assert mine == ["in"] * n + ["out"] * n, f"round {index}: {mine}"


@pytest.mark.parametrize("n", PEERS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_barrier_waits_for_every_peer(strategy: Strategy, n: int) -> None:
    for late in range(n):
        network = Network(n)
        events = _barrier_rounds(strategy, network.links(), late)
        assert network.violations == []
        _assert_separated(events, n)
        assert sent(network) == [(2 * m, 0) for m, _ in expected_traffic("barrier", strategy, n, 0)]


# -- over the in-process transport ------------------------------------------------------------


def inproc_links(n: int, timeout: float = 10.0) -> list[Any]:
    exchange = Exchange(tuple(range(n)), "collectives test")
    deadline = time.monotonic() + timeout
    return [InProcessLink(exchange, rank, deadline) for rank in range(n)]


LARGE = COPY_BELOW // 4 + 3  # float32 elements per block: every block is lent, not copied


def _every_collective(
    strategy: Strategy,
    n: int,
    block: int,
    device: Callable[[np.ndarray], Any] = np.asarray,
    host: Callable[[Any], np.ndarray] = np.asarray,
) -> None:
    """Each collective in turn over one in-process exchange, on arrays made by ``device``."""
    src = inputs(n, n * block, "float32")
    whole = np.concatenate([x[:block] for x in src])  # gather's result, scatter's source
    root = n - 1

    def body(link: Any) -> dict[str, np.ndarray]:
        r = link.rank
        mine, source = device(src[r]), device(whole) if r == root else None
        sizes = {"all_gather": n, "reduce_scatter": 1, "all_to_all": n, "gather": n, "scatter": 1}
        out = {name: device(np.empty(blocks * block, np.float32)) for name, blocks in sizes.items()}
        strategies.all_gather(strategy, link, mine[:block], out["all_gather"])
        strategies.reduce_scatter(strategy, link, mine, out["reduce_scatter"], ReduceOp.SUM)
        strategies.all_to_all(strategy, link, mine, out["all_to_all"])
        strategies.gather(strategy, link, root, mine[:block], out["gather"] if r == root else None)
        strategies.scatter(strategy, link, root, source, out["scatter"])
        strategies.barrier(strategy, link)
        link.flush()  # the inputs above are lent until then
        return {name: host(array) for name, array in out.items()}

    results = run_links(inproc_links(n), body)
    total = blocks_of(reference(src, "sum"), n)
    for r, out in enumerate(results):
        assert out["all_gather"].tobytes() == whole.tobytes()
        assert_matches(out["reduce_scatter"], total[r], n)
        assert out["all_to_all"].tobytes() == np.concatenate([blocks_of(x, n)[r] for x in src]).tobytes()
        assert out["scatter"].tobytes() == blocks_of(whole, n)[r].tobytes()
    assert results[root]["gather"].tobytes() == whole.tobytes()


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_every_collective_over_the_inprocess_link(strategy: Strategy, n: int) -> None:
    _every_collective(strategy, n, LARGE)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_cupy_arrays_over_the_inprocess_link(strategy: Strategy) -> None:
    """CuPy arrays take the same schedules (skipped without CuPy or a CUDA device)."""
    cupy = pytest.importorskip("cupy")
    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver
        devices = 0
    if devices == 0:
        pytest.skip("no CUDA device")
    _every_collective(strategy, 3, 17, cupy.asarray, cupy.asnumpy)
    _every_collective(strategy, 4, LARGE, cupy.asarray, cupy.asnumpy)
    _every_uneven_collective(strategy, cupy.asarray, cupy.asnumpy)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_barrier_over_the_inprocess_link(strategy: Strategy) -> None:
    n = 5
    events = _barrier_rounds(strategy, inproc_links(n), late=2, rounds=1)
    _assert_separated(events, n, rounds=1)


# -- arguments checked before any message ----------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda link: strategies.all_gather("ring", link, np.ones(4), np.ones(11)),
            "all_gather on peer 0: dst has 11 elements of float64; expected 3 peers x 4",
        ),
        (
            lambda link: strategies.all_gather("ring", link, np.ones(4), np.ones(12, np.float32)),
            "12 elements of float32; expected 3 peers x 4 (src's size) = 12 elements of float64",
        ),
        (
            lambda link: strategies.reduce_scatter("direct", link, np.ones(10), np.ones(3), ReduceOp.SUM),
            "reduce_scatter on peer 0: src has 10 elements",
        ),
        (
            lambda link: strategies.all_to_all("tree", link, np.ones(10), np.ones(10)),
            "a multiple of 3 peers",
        ),
        (
            lambda link: strategies.all_to_all(Direct(), link, np.ones(9), np.ones(6)),
            "must have the same dtype and size",
        ),
        (
            lambda link: strategies.gather("centralized", link, 3, np.ones(2), np.ones(6)),
            "gather on peer 0: root 3 is outside the group of 3 peers",
        ),
        (
            lambda link: strategies.gather("centralized", link, 0, np.ones(2), None),
            "gather on peer 0 (the root) needs dst, got None",
        ),
        (
            lambda link: strategies.scatter(Tree(2), link, -1, None, np.ones(2)),
            "root -1 is outside",
        ),
        (
            lambda link: strategies.scatter(Tree(2), link, 0, np.ones(5), np.ones(2)),
            "scatter on peer 0: src has 5 elements",
        ),
    ],
)
def test_bad_arguments_raise_before_any_message(call: Callable[[Any], None], message: str) -> None:
    network = Network(3)
    link = network.links()[0]
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(link)
    assert sent(network) == [(0, 0)] * 3


# -- uneven blocks ---------------------------------------------------------------------------

UNEVEN_PEERS = [1, 2, 3, 4, 5]
PATTERNS = ["mixed", "zeros", "empty", "last"]


def sizes_of(pattern: str, n: int) -> list[int]:
    """One block size per peer: "zeros" leaves peer 0 (the center) and every other peer empty."""
    return {
        "mixed": [(5 * p + 3) % 7 for p in range(n)],  # 3 1 6 4 2
        "zeros": [0 if p % 2 == 0 else 3 * p + 1 for p in range(n)],  # 0 4 0 10 0
        "empty": [0] * n,
        "last": [0] * (n - 1) + [17],  # only the last peer has data
    }[pattern]


def counts_of(pattern: str, n: int) -> list[list[int]]:
    """all_to_all's counts[r][j]: the elements peer r sends to peer j."""
    cell: Callable[[int, int], int] = {
        "mixed": lambda r, j: (2 * r + 3 * j + r * j) % 5,
        "zeros": lambda r, j: 0 if (r + j) % 3 == 0 else r + 2 * j + 1,
        "empty": lambda r, j: 0,
        "last": lambda r, j: 5 if j == n - 1 else 0,  # everyone sends to the last peer only
    }[pattern]
    return [[cell(r, j) for j in range(n)] for r in range(n)]


def split(array: np.ndarray, blocks: Blocks) -> list[np.ndarray]:
    return [array[blocks.of(i)] for i in range(len(blocks))]


def _subtree_bytes(per_peer: list[int], position: int, arity: int, root: int) -> int:
    n = len(per_peer)
    return sum(per_peer[(q + root) % n] for q in range(n) if in_subtree(position, q, arity))


def _heap(n: int, root: int, arity: int, up: Callable[[int], int], down: Callable[[int], int]) -> list[int]:
    """Bytes sent per peer: ``up(p)`` to its parent (but the root), ``down(c)`` to each child c."""
    out = []
    for rank in range(n):
        position = (rank - root) % n
        below = [q for q in range(1, n) if (q - 1) // arity == position]
        out.append((up(position) if position else 0) + sum(down(child) for child in below))
    return out


def uneven_bytes(collective: str, strategy: Strategy, b: list[int], root: int = 0) -> list[int]:
    """Bytes each peer sends when peer i's block has ``b[i]`` bytes (docs/algorithms): the same
    schedules, each message as large as the blocks it carries."""
    n, total = len(b), sum(b)
    nothing: Callable[[int], int] = lambda _: 0  # noqa: E731
    match collective, strategy:
        case "all_gather", Ring():  # every block but the one of the peer to the right
            return [total - b[(r + 1) % n] for r in range(n)]
        case "all_gather", Direct():
            return [(n - 1) * b[r] for r in range(n)]
        case "all_gather", Centralized():
            return [(n - 1) * total, *b[1:]]
        case "all_gather", Tree(arity):
            return _heap(n, 0, arity, lambda p: _subtree_bytes(b, p, arity, 0), lambda c: total)
        case "reduce_scatter", (Ring() | Direct()):  # every block but its own
            return [total - b[r] for r in range(n)]
        case "reduce_scatter", Centralized():
            return [total - b[0]] + [total] * (n - 1)
        case "reduce_scatter", Tree(arity):
            return _heap(n, 0, arity, lambda p: total, lambda c: _subtree_bytes(b, c, arity, 0))
        case "gather", (Centralized() | Direct()):
            return [0 if r == root else b[r] for r in range(n)]
        case "gather", Tree(arity):
            return _heap(n, root, arity, lambda p: _subtree_bytes(b, p, arity, root), nothing)
        case "gather", Ring():  # chain position p: its own block and the p blocks before it
            positions = [(r - root - 1) % n for r in range(n)]
            return [
                0 if p == n - 1 else sum(b[(r - i) % n] for i in range(p + 1))
                for r, p in zip(range(n), positions, strict=True)
            ]
        case "scatter", (Centralized() | Direct()):
            return [total - b[root] if r == root else 0 for r in range(n)]
        case "scatter", Tree(arity):
            return _heap(n, root, arity, nothing, lambda c: _subtree_bytes(b, c, arity, root))
        case "scatter", Ring():  # p hops from the root: the blocks of the n-1-p peers after it
            return [sum(b[(r + 1 + i) % n] for i in range(n - 1 - (r - root) % n)) for r in range(n)]
    raise AssertionError((collective, strategy))


def uneven_all_to_all_bytes(strategy: Strategy, c: list[list[int]]) -> list[int]:
    """Bytes each peer sends when peer r sends ``c[r][j]`` bytes to peer j."""
    n = len(c)
    rows = [sum(row) for row in c]
    columns = [sum(row[j] for row in c) for j in range(n)]
    match strategy:
        case Ring() | Direct():
            return [rows[r] - c[r][r] for r in range(n)]
        case Centralized():
            return [sum(columns[1:]), *rows[1:]]
        case Tree(arity):
            return _heap(
                n,
                0,
                arity,
                lambda p: _subtree_bytes(rows, p, arity, 0),
                lambda q: _subtree_bytes(columns, q, arity, 0),
            )
    raise AssertionError(strategy)


def uneven_traffic(collective: str, strategy: Strategy, sent_bytes: list[int], root: int = 0) -> Traffic:
    """The equal schedule's messages, with ``sent_bytes`` per peer."""
    messages = [m for m, _ in expected_traffic(collective, strategy, len(sent_bytes), 0, root)]
    return list(zip(messages, sent_bytes, strict=True))


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("n", UNEVEN_PEERS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_all_gather_uneven(strategy: Strategy, n: int, pattern: str) -> None:
    sizes = sizes_of(pattern, n)
    src = [peer_input(peer, (sizes[peer],), "float32") for peer in range(n)]
    originals = [x.copy() for x in src]
    dst = [np.full(sum(sizes), 7, np.float32) for _ in range(n)]
    network = run(
        n, lambda link: strategies.all_gather(strategy, link, src[link.rank], dst[link.rank], sizes)
    )
    expected = np.concatenate(src).tobytes()
    assert all(d.tobytes() == expected for d in dst)
    assert unchanged(src, originals)
    assert sent(network) == uneven_traffic(
        "all_gather", strategy, uneven_bytes("all_gather", strategy, [4 * s for s in sizes])
    )


@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_all_gather_uneven_in_place(strategy: Strategy) -> None:
    blocks = Blocks([5, 0, 17, 2])
    src = [peer_input(peer, (blocks.sizes[peer],), "int32") for peer in range(4)]
    dst = [np.zeros(blocks.total, np.int32) for _ in range(4)]
    for rank in range(4):
        dst[rank][blocks.of(rank)] = src[rank]
    run(
        4,
        lambda link: strategies.all_gather(
            strategy, link, dst[link.rank][blocks.of(link.rank)], dst[link.rank], blocks
        ),
    )
    assert all(d.tobytes() == np.concatenate(src).tobytes() for d in dst)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("n", UNEVEN_PEERS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_reduce_scatter_uneven(strategy: Strategy, n: int, pattern: str, dtype: str) -> None:
    blocks = Blocks(sizes_of(pattern, n))
    src = inputs(n, blocks.total, dtype)
    originals = [x.copy() for x in src]
    dst = [np.full(blocks.sizes[rank], 7, dtype) for rank in range(n)]
    network = run(
        n,
        lambda link: strategies.reduce_scatter(
            strategy, link, src[link.rank], dst[link.rank], ReduceOp.SUM, blocks
        ),
    )
    expected = split(reference(src, "sum"), blocks)  # sequential, in peer order
    for rank in range(n):
        if _in_peer_order(strategy):
            assert dst[rank].tobytes() == expected[rank].tobytes()
        else:
            assert_matches(dst[rank], expected[rank], n)
    assert unchanged(src, originals)
    itemsize = np.dtype(dtype).itemsize
    sent_bytes = uneven_bytes("reduce_scatter", strategy, [itemsize * s for s in blocks.sizes])
    assert sent(network) == uneven_traffic("reduce_scatter", strategy, sent_bytes)


@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda op: op.value)
@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_reduce_scatter_uneven_every_op(strategy: Strategy, n: int, op: ReduceOp) -> None:
    """Exact values (small integers): every schedule matches the sequential reduction bit for bit."""
    blocks = Blocks(sizes_of("zeros", n))
    src = inputs(n, blocks.total, "int64" if op in BITWISE else "float64", small=True)
    dst = [np.full(size, 7, src[0].dtype) for size in blocks.sizes]
    run(n, lambda link: strategies.reduce_scatter(strategy, link, src[link.rank], dst[link.rank], op, blocks))
    expected = split(reference(src, "sum" if op is ReduceOp.MEAN else op.value), blocks)  # MEAN sums here
    assert [d.tobytes() for d in dst] == [e.tobytes() for e in expected]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("n", UNEVEN_PEERS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_all_to_all_uneven(strategy: Strategy, n: int, pattern: str) -> None:
    counts = counts_of(pattern, n)
    src = [peer_input(peer, (sum(counts[peer]),), "float64") for peer in range(n)]
    originals = [x.copy() for x in src]
    dst = [np.full(sum(row[rank] for row in counts), 7.0) for rank in range(n)]
    network = run(
        n, lambda link: strategies.all_to_all(strategy, link, src[link.rank], dst[link.rank], counts)
    )
    for receiver in range(n):
        expected = [split(src[sender], Blocks(counts[sender]))[receiver] for sender in range(n)]
        assert dst[receiver].tobytes() == np.concatenate(expected).tobytes()
    assert unchanged(src, originals)
    sent_bytes = uneven_all_to_all_bytes(strategy, [[8 * c for c in row] for row in counts])
    assert sent(network) == uneven_traffic("all_to_all", strategy, sent_bytes)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("n", UNEVEN_PEERS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_gather_uneven_every_root(strategy: Strategy, n: int, pattern: str) -> None:
    blocks = Blocks(sizes_of(pattern, n))
    src = [peer_input(peer, (blocks.sizes[peer],), "int16") for peer in range(n)]
    for root in range(n):
        out = np.full(blocks.total, 7, np.int16)
        network = run(
            n,
            lambda link, root=root, out=out: strategies.gather(
                strategy, link, root, src[link.rank], out if link.rank == root else None, blocks
            ),
        )
        assert out.tobytes() == np.concatenate(src).tobytes(), f"root {root}"
        sent_bytes = uneven_bytes("gather", strategy, [2 * s for s in blocks.sizes], root)
        assert sent(network) == uneven_traffic("gather", strategy, sent_bytes, root), f"root {root}"


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("n", UNEVEN_PEERS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_scatter_uneven_every_root(strategy: Strategy, n: int, pattern: str) -> None:
    blocks = Blocks(sizes_of(pattern, n))
    whole = peer_input(99, (blocks.total,), "float64")
    original = whole.copy()
    for root in range(n):
        dst = [np.full(size, 7.0) for size in blocks.sizes]
        network = run(
            n,
            lambda link, root=root, dst=dst: strategies.scatter(
                strategy, link, root, whole if link.rank == root else None, dst[link.rank], blocks
            ),
        )
        for rank, part in enumerate(split(whole, blocks)):
            assert dst[rank].tobytes() == part.tobytes(), f"root {root}, peer {rank}"
        assert whole.tobytes() == original.tobytes()
        sent_bytes = uneven_bytes("scatter", strategy, [8 * s for s in blocks.sizes], root)
        assert sent(network) == uneven_traffic("scatter", strategy, sent_bytes, root), f"root {root}"


def _messages(n: int, body: Callable[[RecordingLink], Any]) -> list[list[tuple[int, int]]]:
    """Every peer's messages in sending order: (destination, bytes)."""
    return [t.messages for t in run(n, body).traffic]


@pytest.mark.parametrize("block", [0, 17])
@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_equal_blocks_given_explicitly_send_what_none_sends(strategy: Strategy, n: int, block: int) -> None:
    """``blocks=None`` is ``Blocks.equal(n, B)`` (or its sizes), message for message, bit for bit."""
    src = inputs(n, n * block, "float32")
    equal, sizes, counts = Blocks.equal(n, block), [block] * n, [[block] * n for _ in range(n)]
    root = n - 1

    def every(blocks: Any, matrix: Any) -> Callable[[RecordingLink], dict[str, bytes]]:
        def body(link: RecordingLink) -> dict[str, bytes]:
            r, mine = link.rank, src[link.rank]
            lengths = {"ag": n * block, "rs": block, "aa": n * block, "g": n * block, "s": block}
            out = {name: np.zeros(length, np.float32) for name, length in lengths.items()}
            strategies.all_gather(strategy, link, mine[:block], out["ag"], blocks)
            strategies.reduce_scatter(strategy, link, mine, out["rs"], ReduceOp.SUM, blocks)
            strategies.all_to_all(strategy, link, mine, out["aa"], matrix)
            strategies.gather(strategy, link, root, mine[:block], out["g"] if r == root else None, blocks)
            strategies.scatter(strategy, link, root, mine if r == root else None, out["s"], blocks)
            return {name: array.tobytes() for name, array in out.items()}

        return body

    reference_network = Network(n)
    reference_results = reference_network.run(every(None, None))
    for blocks, matrix in [(equal, counts), (sizes, counts)]:
        network = Network(n)
        assert network.run(every(blocks, matrix)) == reference_results
        assert [t.messages for t in network.traffic] == [t.messages for t in reference_network.traffic]


def _every_uneven_collective(
    strategy: Strategy,
    device: Callable[[np.ndarray], Any] = np.asarray,
    host: Callable[[Any], np.ndarray] = np.asarray,
) -> None:
    """Blocks large enough to be lent next to empty and small ones, over the in-process link."""
    n, root = 4, 2
    blocks = Blocks([LARGE, 0, 5, LARGE + 1])
    cell = [0, LARGE, 3]  # empty, lent, copied
    counts = [[cell[(r + j) % 3] for j in range(n)] for r in range(n)]
    src = inputs(n, blocks.total, "float32")
    rows = [peer_input(peer, (sum(counts[peer]),), "float32") for peer in range(n)]

    def body(link: Any) -> dict[str, np.ndarray]:
        r = link.rank
        whole, row = device(src[r]), device(rows[r])
        mine = whole[blocks.of(r)]
        lengths = {"all_gather": blocks.total, "reduce_scatter": blocks.sizes[r], "gather": blocks.total}
        lengths |= {"all_to_all": sum(row[r] for row in counts), "scatter": blocks.sizes[r]}
        out = {name: device(np.empty(length, np.float32)) for name, length in lengths.items()}
        strategies.all_gather(strategy, link, mine, out["all_gather"], blocks)
        strategies.reduce_scatter(strategy, link, whole, out["reduce_scatter"], ReduceOp.SUM, blocks)
        strategies.all_to_all(strategy, link, row, out["all_to_all"], counts)
        strategies.gather(strategy, link, root, mine, out["gather"] if r == root else None, blocks)
        strategies.scatter(strategy, link, root, whole if r == root else None, out["scatter"], blocks)
        link.flush()  # the inputs above are lent until then
        return {name: host(array) for name, array in out.items()}

    results = run_links(inproc_links(n), body)
    gathered = np.concatenate([src[r][blocks.of(r)] for r in range(n)])
    total = split(reference(src, "sum"), blocks)
    for r, out in enumerate(results):
        assert out["all_gather"].tobytes() == gathered.tobytes()
        assert_matches(out["reduce_scatter"], total[r], n)
        received = [split(rows[sender], Blocks(counts[sender]))[r] for sender in range(n)]
        assert out["all_to_all"].tobytes() == np.concatenate(received).tobytes()
        assert out["scatter"].tobytes() == src[root][blocks.of(r)].tobytes()
    assert results[root]["gather"].tobytes() == gathered.tobytes()


@pytest.mark.parametrize("strategy", STRATEGIES, ids=ids)
def test_uneven_blocks_over_the_inprocess_link(strategy: Strategy) -> None:
    _every_uneven_collective(strategy)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda link: strategies.all_gather("ring", link, np.ones(2), np.ones(5), [2, 3]),
            "all_gather on peer 0: blocks must have one size per peer: got 2 sizes [2, 3] for 3 peers",
        ),
        (
            lambda link: strategies.all_gather("ring", link, np.ones(2), np.ones(5), [2, -1, 4]),
            "all_gather on peer 0: block sizes must be integers >= 0, got [2, -1, 4]",
        ),
        (
            lambda link: strategies.all_gather("ring", link, np.ones(2), np.ones(5), [2, 1.5, 4]),
            "block sizes must be integers >= 0, got [2, 1.5, 4]",
        ),
        (
            lambda link: strategies.all_gather("ring", link, np.ones(3), np.ones(5), [2, 1, 2]),
            "all_gather on peer 0: src has 3 elements; the blocks [2, 1, 2] give peer 0 2",
        ),
        (
            lambda link: strategies.all_gather("tree", link, np.ones(2), np.ones(6), [2, 1, 2]),
            "all_gather on peer 0: dst has 6 elements of float64; expected the blocks' total 5 elements",
        ),
        (
            lambda link: strategies.all_gather(Direct(), link, np.ones(2), np.ones(5, np.int32), [2, 1, 2]),
            "dst has 5 elements of int32; expected the blocks' total 5 elements of float64",
        ),
        (
            lambda link: strategies.reduce_scatter(
                "ring", link, np.ones(7), np.ones(1), ReduceOp.SUM, [1, 2, 3]
            ),
            "reduce_scatter on peer 0: src has 7 elements of float64; expected the blocks' total 6",
        ),
        (
            lambda link: strategies.reduce_scatter(
                "ring", link, np.ones(6), np.ones(2), ReduceOp.SUM, [1, 2, 3]
            ),
            "reduce_scatter on peer 0: dst has 2 elements; the blocks [1, 2, 3] give peer 0 1",
        ),
        (
            lambda link: strategies.gather("ring", link, 1, np.ones(3), None, [2, 0, 1]),
            "gather on peer 0: src has 3 elements; the blocks [2, 0, 1] give peer 0 2",
        ),
        (
            lambda link: strategies.gather("ring", link, 0, np.ones(2), np.ones(2), [2, 0, 1]),
            "gather on peer 0: dst has 2 elements of float64; expected the blocks' total 3",
        ),
        (
            lambda link: strategies.scatter(Tree(3), link, 0, np.ones(4), np.ones(2), [2, 0, 1]),
            "scatter on peer 0: src has 4 elements of float64; expected the blocks' total 3",
        ),
        (
            lambda link: strategies.all_to_all("ring", link, np.ones(3), np.ones(3), [[1, 1, 1], [1, 1, 1]]),
            "all_to_all on peer 0: counts must be 3 x 3",
        ),
        (
            lambda link: strategies.all_to_all(
                "ring", link, np.ones(3), np.ones(3), [[1, 1, 1]] * 2 + [[1, -1, 1]]
            ),
            "all_to_all on peer 0: counts must be rows of sizes >= 0",
        ),
        (
            lambda link: strategies.all_to_all(
                "ring", link, np.ones(3), np.ones(5), [[1, 1, 1], [2, 0, 0], [1, 0, 0]]
            ),
            "all_to_all on peer 0: src has 3 elements of float64 and dst 5 of float64; counts send 3 "
            "(row 0) and receive 4 (column 0)",
        ),
        (
            lambda link: strategies.all_to_all(
                "ring", link, np.ones(3), np.ones(3, np.float32), [[1, 1, 1]] * 3
            ),
            "dst 3 of float32; counts send 3 (row 0) and receive 3 (column 0), of one dtype",
        ),
    ],
)
def test_bad_blocks_raise_before_any_message(call: Callable[[Any], None], message: str) -> None:
    network = Network(3)
    link = network.links()[0]
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        call(link)
    assert sent(network) == [(0, 0)] * 3
