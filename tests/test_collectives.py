"""The public API on local peers (threads) against a numpy reference; a barrier holds every peer
until the last one enters; a result made without ``out=`` is an array of its own."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import collective as col
from collective import Centralized, Direct, Ring, Tree
from tests import peers
from tests.conftest import PATHS, assert_matches, peer_input, reference, run_peers, wait_until

STRATEGIES = [Centralized(), Tree(1), Tree(2), Tree(3), Tree(5), Ring(), Direct()]
PEERS = [1, 2, 3, 4, 5, 8]
OPS = ["sum", "mean", "max", "min", "prod"]


def config(n: int, strategy: Any = None, timeout: float = 20.0) -> col.CollectiveConfig:
    strategy = strategy or Tree(2)
    return col.CollectiveConfig(
        num_devices=n,
        local_all_reduce_strategy=strategy,
        local_reduce_strategy=strategy,
        local_broadcast_strategy=strategy,
        timeout=timeout,
    )


@pytest.mark.parametrize("n", PEERS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=str)
def test_every_op_and_root(link_runtime: col.Runtime, strategy: Any, n: int) -> None:
    """Every op for all_reduce and reduce at every root, broadcast from every root, in one job.

    17 elements (not divisible by the peer counts) and 3 (fewer than peers: the Ring fallback).
    """
    rt = link_runtime
    cfg = config(n, strategy)
    lengths = [17, 3]
    inputs = {
        (length, p): peer_input(p, (length,), "float64", seed=length, small=True)
        for length in lengths
        for p in range(n)
    }

    def body(peer: int) -> list[Any]:
        rt.register(peer, "cpu", cfg)
        results = []
        for length in lengths:
            x = inputs[(length, peer)]
            for op in OPS:
                results.append(("all_reduce", length, op, None, rt.all_reduce(peer, x, op)))
                for root in range(n):
                    results.append(("reduce", length, op, root, rt.reduce(peer, x, op, root=root)))
            for root in range(n):
                results.append(
                    ("broadcast", length, None, root, rt.broadcast(peer, x if peer == root else None))
                )
        rt.finish(peer)
        return results

    per_peer = run_peers(n, body, rt)
    for index, (kind, length, op, root, _) in enumerate(per_peer[0]):
        xs = [inputs[(length, p)] for p in range(n)]
        got = [per_peer[p][index][4] for p in range(n)]
        if kind == "broadcast":
            assert all(g.tobytes() == xs[root].tobytes() for g in got)
        elif kind == "reduce":
            assert all(g is None for p, g in enumerate(got) if p != root)
            assert_matches(got[root], reference(xs, op), n)
        else:
            assert_matches(got[0], reference(xs, op), n)
            assert all(g.tobytes() == got[0].tobytes() for g in got), (
                "all_reduce results differ between peers"
            )


DTYPES = [
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "complex64",
    "bfloat16",
]
SHAPES = {
    "0-d": (),
    "empty": (0,),
    "empty-2d": (3, 0),
    "1": (1,),
    "3": (3,),
    "17": (17,),
    "1000": (1000,),
    "2d-view": (40, 30),  # sliced below into a non-contiguous view
    "over-4MiB": ((4 << 20) // 4 + 3,),
}


def _dtype(name: str) -> Any:
    if name == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.dtype(name)


def _inputs(shape_name: str, dtype: Any, n: int, small: bool) -> list[np.ndarray]:
    shape = SHAPES[shape_name]
    if shape_name == "over-4MiB" and np.dtype(dtype).itemsize != 4:
        shape = ((4 << 20) // np.dtype(dtype).itemsize + 3,)
    xs = [
        peer_input(p, shape, dtype if np.dtype(dtype).name != "bfloat16" else "float32", small=small)
        for p in range(n)
    ]
    xs = [x.astype(dtype) for x in xs]
    if shape_name == "2d-view":
        xs = [x[::2, 1::3] for x in xs]
        assert not xs[0].flags.c_contiguous
    return xs


# The over-4MiB case runs for one dtype of each kind and width class, the rest for every dtype.
BIG_DTYPES = {"float16", "float32", "int64", "bfloat16"}
DTYPE_SHAPE_CASES = [
    (dtype, shape) for dtype in DTYPES for shape in SHAPES if shape != "over-4MiB" or dtype in BIG_DTYPES
]


@pytest.mark.parametrize("path", ["tree:2", "ring", "direct", "fused", "shared"])
@pytest.mark.parametrize(("dtype_name", "shape_name"), DTYPE_SHAPE_CASES)
def test_dtypes_and_shapes(dtype_name: str, shape_name: str, path: str) -> None:
    """all_reduce (sum, and max or for complex prod), reduce mean, broadcast; inputs never written.

    "tree:2", "ring" and "direct" run those algorithms at every size; "fused" is the default
    runtime (arrays up to 64 KiB complete at the rendezvous, up to 4 MiB on the shared path);
    "shared" takes the shared path for every array up to 4 MiB.
    """
    fast_paths = {"fused": {}, "shared": {"fuse_below": 0}}
    runtime = col.Runtime(**fast_paths.get(path, {"fuse_below": 0, "share_below": 0}))
    strategy = "tree:2" if path in fast_paths else path
    dtype = _dtype(dtype_name)
    n = 4
    xs = _inputs(shape_name, dtype, n, small=False)
    originals = [x.copy() for x in xs]
    second_op = "prod" if dtype_name.startswith("complex") else "max"
    cfg = config(n, strategy)

    def body(peer: int) -> tuple[Any, ...]:
        runtime.register(peer, "cpu", cfg)
        x = xs[peer]
        out = (
            runtime.all_reduce(peer, x, "sum"),
            runtime.all_reduce(peer, x, second_op),
            runtime.reduce(peer, x, "mean", root=3),
            runtime.broadcast(peer, x if peer == 1 else None),
        )
        runtime.finish(peer)
        return out

    with runtime:
        results = run_peers(n, body, runtime)
    for peer in range(n):
        total, other, mean, copied = results[peer]
        assert total.shape == xs[0].shape and total.dtype == xs[0].dtype
        assert total.tobytes() == results[0][0].tobytes() and other.tobytes() == results[0][1].tobytes()
        assert copied.shape == xs[1].shape and copied.tobytes() == np.ascontiguousarray(xs[1]).tobytes()
        assert (mean is None) == (peer != 3)
        np.testing.assert_array_equal(xs[peer], originals[peer])
    assert_matches(results[0][0], reference(xs, "sum"), n)
    assert_matches(results[0][1], reference(xs, second_op), n)
    assert_matches(results[3][2], reference(xs, "mean"), n)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "int8", "uint64", "complex64"])
def test_prod_and_min_every_dtype_kind(link_runtime: col.Runtime, dtype_name: str) -> None:
    dtype = _dtype(dtype_name)
    n = 3
    xs = [x.astype(dtype) for x in (peer_input(p, (17,), "float32", small=True) for p in range(n))]
    if dtype_name in ("int8", "uint64"):
        xs = [peer_input(p, (17,), dtype_name, small=True) for p in range(n)]
    ops = ["prod", "sum"] if dtype_name == "complex64" else ["prod", "min"]

    def body(peer: int) -> list[np.ndarray]:
        link_runtime.register(peer, "cpu", config(n, Ring()))
        out = [link_runtime.all_reduce(peer, xs[peer], op) for op in ops]
        link_runtime.finish(peer)
        return out

    results = run_peers(n, body, link_runtime)
    for i, op in enumerate(ops):
        assert_matches(results[1][i], reference(xs, op), n)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype_name", ["int8", "uint16", "int64"])
def test_bitwise_ops_on_integers_and_refused_on_floats_by_every_peer(fused: bool, dtype_name: str) -> None:
    """band / bor / bxor (MPI's and torch's): all_reduce, reduce, reduce_scatter and a coalesced
    list, fused at the rendezvous or by the strategies' schedules; floats are refused everywhere."""
    n = 3
    xs = [peer_input(p, (4 * n,), dtype_name) * np.array(37 + p, dtype_name) for p in range(n)]
    rt = col.Runtime() if fused else col.Runtime(fuse_below=0, share_below=0)

    def body(peer: int) -> Any:
        rt.register(peer, "cpu", config(n, Ring()))
        got = {op: rt.all_reduce(peer, xs[peer], op) for op in ("band", "bor", "bxor")}
        got["reduce"] = rt.reduce(peer, xs[peer], col.ReduceOp.BXOR, root=2)
        got["reduce_scatter"] = rt.reduce_scatter(peer, xs[peer], "BOR")
        got["coalesced"] = rt.all_reduce_coalesced(peer, [xs[peer], xs[peer][:3]], "band")
        with pytest.raises(col.InvalidArgumentError, match=r"op bxor \(bitwise\) takes integer dtypes"):
            rt.all_reduce(peer, np.ones(3, np.float32), "bxor")
        return got

    with rt:
        results = run_peers(n, body, rt)
    for peer, got in enumerate(results):
        for op in ("band", "bor", "bxor"):
            np.testing.assert_array_equal(got[op], reference(xs, op))
        assert (got["reduce"] is None) == (peer != 2)
        np.testing.assert_array_equal(got["reduce_scatter"], reference(xs, "bor")[4 * peer : 4 * peer + 4])
        np.testing.assert_array_equal(got["coalesced"][1], reference(xs, "band")[:3])
    np.testing.assert_array_equal(results[2]["reduce"], reference(xs, "bxor"))


def test_out_buffers_and_in_place(runtime: col.Runtime) -> None:
    n = 3
    xs = [peer_input(p, (1000,), "float32") for p in range(n)]
    expected = reference(xs, "sum")

    def body(peer: int) -> tuple[Any, ...]:
        runtime.register(peer, "cpu", config(n, Ring()))
        out = np.empty(1000, np.float32)
        returned = runtime.all_reduce(peer, xs[peer], out=out)
        in_place = xs[peer].copy()
        same = runtime.all_reduce(peer, in_place, out=in_place)
        received = np.zeros(1000, np.float32)
        b = runtime.broadcast(peer, xs[peer] if peer == 2 else None, out=received)
        root_out = np.zeros(1000, np.float32)
        r = runtime.reduce(peer, xs[peer], "max", root=0, out=root_out)
        runtime.finish(peer)
        return returned is out, out, same is in_place, in_place, b is received, received, r, root_out

    for peer, (is_out, out, is_same, in_place, is_received, received, r, root_out) in enumerate(
        run_peers(n, body, runtime)
    ):
        assert is_out and is_same and is_received
        assert_matches(out, expected, n)
        assert_matches(in_place, expected, n)
        assert received.tobytes() == xs[2].tobytes()
        if peer == 0:
            assert r is root_out
            np.testing.assert_array_equal(root_out, reference(xs, "max"))
        else:
            assert r is None and not root_out.any()  # out is left alone off the root


def test_module_level_api_and_a_second_job_with_another_peer_count() -> None:
    """The default runtime: register / finish / register again, then a job of a different size."""
    for n, rounds in [(4, 2), (2, 1), (3, 1)]:
        for _ in range(rounds):
            cfg = col.CollectiveConfig(num_devices=n, timeout=20)

            def body(peer: int, n: int = n, cfg: col.CollectiveConfig = cfg) -> np.ndarray:
                col.register(peer, "cpu", cfg)
                y = col.all_reduce(peer, np.full(5, peer + 1, np.int32))
                col.finish(peer)
                return y

            for y in run_peers(n, body):
                np.testing.assert_array_equal(y, np.full(5, n * (n + 1) // 2, np.int32))


def test_string_strategies_and_enum_ops(link_runtime: col.Runtime) -> None:
    cfg = col.CollectiveConfig(
        num_devices=3,
        local_all_reduce_strategy="ring",
        local_reduce_strategy="tree:3",
        local_broadcast_strategy="centralized",
        timeout=20,
    )
    assert (cfg.local_all_reduce_strategy, cfg.local_reduce_strategy) == (Ring(), Tree(3))

    def body(peer: int) -> tuple[Any, ...]:
        link_runtime.register(peer, "cpu", cfg)
        x = np.arange(6, dtype=np.int64) + peer
        out = (
            link_runtime.all_reduce(peer, x, col.ReduceOp.MAX),
            link_runtime.reduce(peer, x, "MIN", root=1),
        )
        link_runtime.finish(peer)
        return out

    results = run_peers(3, body, link_runtime)
    np.testing.assert_array_equal(results[0][0], np.arange(6) + 2)
    np.testing.assert_array_equal(results[1][1], np.arange(6))


# -- barriers, and results that own their memory ---------------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
def test_a_barrier_releases_no_peer_before_every_peer_entered(path: str) -> None:
    n, rounds = 4, 5
    entered = [0] * rounds
    lock = threading.Lock()

    def others_wait_in_the_barrier(peer: int) -> None:
        """One peer late in each round: it enters once every other peer waits inside the barrier."""
        others = tuple(p for p in range(n) if p != peer)
        wait_until(lambda: rt.waiting() == others, 10, f"peers {others} waiting in the barrier")

    def body(peer: int) -> list[int]:
        rt.register(peer, "cpu", peers.config(n, Ring()))
        seen = []
        for r in range(rounds):
            if peer == r % n:
                others_wait_in_the_barrier(peer)
            with lock:
                entered[r] += 1
            rt.barrier(peer)
            with lock:
                seen.append(entered[r])
        rt.finish(peer)
        return seen

    with col.Runtime(**PATHS[path]) as rt:
        for seen in run_peers(n, body, rt):
            assert seen == [n] * rounds


def _calls_with_new_results(
    n: int, inputs: list[np.ndarray]
) -> list[tuple[str, Callable[[col.Runtime, int], Any]]]:
    """(label, ``run(rt, peer)``) of every collective over ``n`` peers on blocks of (4, 2) float32,
    roots 1, with and without ``out``; every input made here is appended to ``inputs`` (the peers'
    blocks first)."""
    block, dtype = (4, 2), np.float32
    single = [peers.make_input(p, block, dtype, 3) for p in range(n)]
    blocked = [peers.make_input(p, (n * block[0], *block[1:]), dtype, 4) for p in range(n)]
    stack = peers.make_input(1, (n, *block), dtype, 5)  # the scatter root's
    inputs.extend([*single, *blocked, stack])

    def all_gather_out(rt: col.Runtime, p: int) -> Any:
        out = np.full((n, *block), 7, dtype)
        return rt.all_gather(p, single[p], out=out), out

    def reduce_scatter_out(rt: col.Runtime, p: int) -> Any:
        out = np.full(block, 7, dtype)
        return rt.reduce_scatter(p, blocked[p], "sum", out=out), out

    def gather(rt: col.Runtime, p: int) -> Any:
        out = np.full((n, *block), 7, dtype) if p == 1 or p % 2 else None
        return rt.gather(p, single[p], root=1, out=out), out

    def scatter(rt: col.Runtime, p: int) -> Any:
        out = np.full(block, 7, dtype) if p % 2 else None
        return rt.scatter(p, stack if p == 1 else None, root=1, out=out), out

    calls: list[tuple[str, Callable[[col.Runtime, int], Any]]] = [
        ("all_gather", lambda rt, p: rt.all_gather(p, single[p])),
        ("all_gather out=", all_gather_out),
        ("reduce_scatter sum", lambda rt, p: rt.reduce_scatter(p, blocked[p], "sum")),
        ("reduce_scatter out=", reduce_scatter_out),
        ("all_to_all", lambda rt, p: rt.all_to_all(p, blocked[p])),
        ("gather root=1", gather),
        ("scatter root=1", scatter),
        ("barrier", lambda rt, p: rt.barrier(p)),
        ("all_reduce", lambda rt, p: rt.all_reduce(p, inputs[p])),
        ("broadcast", lambda rt, p: rt.broadcast(p, None if p else inputs[0])),
        ("reduce", lambda rt, p: rt.reduce(p, inputs[p], root=1)),
    ]
    return calls


@pytest.mark.parametrize("path", ["fused", "shared"])
def test_every_new_result_is_an_array_of_its_own(path: str) -> None:
    """No result without ``out=`` shares a byte with another peer's result or with any input (every
    peer of an all_reduce gets the same values: each in its own array, to write as it likes)."""
    n, inputs = 3, []
    calls = _calls_with_new_results(n, inputs)
    with col.Runtime(**PATHS[path]) as rt:

        def body(peer: int) -> list[Any]:
            rt.register(peer, "cpu", peers.config(n))
            results = [run(rt, peer) for _, run in calls]
            rt.finish(peer)
            return results

        per_peer = run_peers(n, body, rt)
    checked = 0
    for index, (label, _) in enumerate(calls):
        got = [per_peer[p][index] for p in range(n)]
        got = [r[0] if isinstance(r, tuple) and r[1] is None else r for r in got]  # (result, out) pairs
        arrays = [r for r in got if isinstance(r, np.ndarray)]
        checked += len(arrays)
        for i, a in enumerate(arrays):
            assert not any(np.shares_memory(a, x) for x in inputs), f"{label}: a result is an input"
            assert not any(np.shares_memory(a, b) for b in arrays[i + 1 :]), f"{label}: results share"
    assert checked >= 6 * n  # all_gather, reduce_scatter, all_to_all, all_reduce, broadcast: every peer;
    # scatter: the peers without out; reduce: the root
