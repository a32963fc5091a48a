"""The collective set on local peers (threads) of one Runtime, against a numpy reference.

all_gather, reduce_scatter, all_to_all, gather, scatter, barrier, send/recv and
all_reduce_coalesced; groups; async work; per-call timeouts. The matrix tests run one job per
(execution path, strategy, peer count) that calls every collective for every dtype, block shape,
op and root in sequence; every peer's results are checked afterwards in the test's thread.

A *block* is what one peer contributes to (or gets from) one slot: all_gather and gather take a
block and stack ``n`` of them; reduce_scatter and all_to_all take ``n`` blocks along axis 0; the
root of a scatter passes ``n`` blocks stacked.
"""

from __future__ import annotations

import gc
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import pytest

import collective as col
import collective.executors.rendezvous
from collective import Centralized, Direct, Ring, Tree
from collective.config import KINDS
from tests.conftest import assert_matches, peer_input, reference, run_peers

STRATEGIES = [Centralized(), Tree(1), Tree(2), Tree(3), Ring(), Direct()]
PEERS = [1, 2, 3, 4, 5]
OPS = ["sum", "mean", "max", "min", "prod"]
# Runtime limits: "fused" is the default (small numpy arrays complete at the rendezvous, mid-size
# ones on the shared path, large ones over the strategy's schedule); "shared" turns fusing off;
# "linked" runs the configured strategy's schedule at every size.
PATHS: dict[str, dict[str, int]] = {
    "fused": {},
    "shared": {"fuse_below": 0},
    "linked": {"fuse_below": 0, "share_below": 0},
}
EXECUTOR = {"fused": "Fused", "shared": "Shared", "linked": "Linked"}
DTYPES: dict[str, Any] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int32": np.dtype(np.int32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
# name -> (block shape, whether every input is a non-contiguous view)
BLOCKS: dict[str, tuple[tuple[int, ...], bool]] = {
    "empty": ((0,), False),
    "1": ((1,), False),
    "17": ((17,), False),
    "2d": ((3, 4), False),
    "2d-view": ((2, 3), True),
}
BIG_BLOCK = ((1 << 20) + 3,)  # float32: just over 4 MiB per block, past the shared path's limit


def config(n: int, strategy: Any = None, timeout: float = 20.0) -> col.CollectiveConfig:
    """A job of ``n`` local peers running ``strategy`` (default Tree(2)) for every collective kind."""
    strategy = strategy or Tree(2)
    return col.CollectiveConfig(
        num_devices=n, timeout=timeout, **{f"local_{kind}_strategy": strategy for kind in KINDS}
    )


def make_input(peer: int, shape: tuple[int, ...], dtype: Any, seed: int, view: bool = False) -> np.ndarray:
    """Small integers (-3..3) in ``dtype``, so sums, products and means are exact in every dtype.

    ``view``: a non-contiguous view (every other column of an array twice as wide).
    """
    full = (*shape[:-1], 2 * shape[-1]) if view else shape
    x = peer_input(peer, full, "float32", seed=seed, small=True).astype(dtype)
    return x[..., ::2] if view else x


@pytest.fixture
def executors_seen(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The class name of every executor chosen while the test runs (to check the path taken)."""
    seen: list[str] = []
    real = collective.executors.rendezvous.choose

    def spy(*args: Any, **kwargs: Any) -> Any:
        executor = real(*args, **kwargs)
        seen.append(type(executor).__name__)
        return executor

    monkeypatch.setattr(collective.executors.rendezvous, "choose", spy)
    return seen


# -- the matrix: every collective, against numpy ---------------------------------------------------


class Case(NamedTuple):
    """One collective every peer runs: ``run(rt, peer)`` on each peer, then ``check(results)``."""

    label: str
    run: Callable[[col.Runtime, int], Any]
    check: Callable[[list[Any]], None]


def _same_bytes(got: Any, expected: np.ndarray) -> None:
    assert isinstance(got, np.ndarray), f"expected an array, got {got!r}"
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got.shape, got.dtype)
    assert got.tobytes() == np.ascontiguousarray(expected).tobytes(), "wrong values"


def cases_for(
    n: int,
    dtype: Any,
    block: tuple[int, ...],
    view: bool,
    seed: int,
    ops: list[str],
    roots: list[int],
    inputs: list[np.ndarray],
    in_place: bool = True,
) -> list[Case]:
    """Every collective over ``n`` peers with blocks ``block`` of ``dtype``.

    Every input made here is appended to ``inputs`` (the caller checks none was written).
    ``in_place``: include all_to_all with out=x.
    """
    k = block[0]
    rows = (n * k, *block[1:])  # reduce_scatter and all_to_all: n blocks along axis 0
    single = [make_input(p, block, dtype, seed, view) for p in range(n)]
    blocked = [make_input(p, rows, dtype, seed + 1, view) for p in range(n)]
    stacks = {r: make_input(r, (n, *block), dtype, seed + 2, view) for r in roots}  # scatter roots
    inputs.extend(single + blocked + list(stacks.values()))
    stacked = np.stack(single)
    cases: list[Case] = []

    def all_gather_check(results: list[Any]) -> None:
        for got in results:  # bit-identical on every peer, and exactly the peers' blocks in rank order
            _same_bytes(got, stacked)

    cases.append(Case("all_gather", lambda rt, p: rt.all_gather(p, single[p]), all_gather_check))

    def all_gather_out(rt: col.Runtime, p: int) -> Any:
        out = np.full((n, *block), 7, dtype)
        return rt.all_gather(p, single[p], out=out), out

    def all_gather_out_check(results: list[Any]) -> None:
        for got, out in results:
            assert got is out
            _same_bytes(out, stacked)

    cases.append(Case("all_gather out=", all_gather_out, all_gather_out_check))

    for op in ops:
        total = reference(blocked, op)

        def rs_check(results: list[Any], total: np.ndarray = total) -> None:
            for p, got in enumerate(results):
                assert_matches(got, total[p * k : (p + 1) * k], n)

        cases.append(
            Case(f"reduce_scatter {op}", lambda rt, p, op=op: rt.reduce_scatter(p, blocked[p], op), rs_check)
        )

    def rs_out(rt: col.Runtime, p: int) -> Any:
        out = np.full(block, 7, dtype)
        return rt.reduce_scatter(p, blocked[p], "sum", out=out), out

    total_sum = reference(blocked, "sum")

    def rs_out_check(results: list[Any]) -> None:
        for p, (got, out) in enumerate(results):
            assert got is out
            assert_matches(out, total_sum[p * k : (p + 1) * k], n)

    cases.append(Case("reduce_scatter out=", rs_out, rs_out_check))

    exchanged = [np.concatenate([blocked[j][p * k : (p + 1) * k] for j in range(n)]) for p in range(n)]

    def a2a_check(results: list[Any]) -> None:
        for p, got in enumerate(results):
            _same_bytes(got, exchanged[p])

    cases.append(Case("all_to_all", lambda rt, p: rt.all_to_all(p, blocked[p]), a2a_check))

    def a2a_in_place(rt: col.Runtime, p: int) -> Any:
        mine = np.ascontiguousarray(blocked[p]).copy()
        return rt.all_to_all(p, mine, out=mine), mine

    def a2a_in_place_check(results: list[Any]) -> None:
        for p, (got, mine) in enumerate(results):
            assert got is mine
            _same_bytes(mine, exchanged[p])

    if in_place:
        cases.append(Case("all_to_all out=x", a2a_in_place, a2a_in_place_check))

    for root in roots:

        def gather(rt: col.Runtime, p: int, root: int = root) -> Any:
            out = np.full((n, *block), 7, dtype) if p == root or p % 2 else None
            return rt.gather(p, single[p], root=root, out=out), out

        def gather_check(results: list[Any], root: int = root) -> None:
            for p, (got, out) in enumerate(results):
                if p == root:
                    assert got is out
                    _same_bytes(got, stacked)
                else:  # None off the root, and an ``out`` given there is left alone
                    assert got is None
                    assert out is None or (out == np.full_like(out, 7)).all()

        cases.append(Case(f"gather root={root}", gather, gather_check))

        def scatter(rt: col.Runtime, p: int, root: int = root) -> Any:
            out = np.full(block, 7, dtype) if p % 2 else None
            return rt.scatter(p, stacks[root] if p == root else None, root=root, out=out), out

        def scatter_check(results: list[Any], root: int = root) -> None:
            for p, (got, out) in enumerate(results):
                assert out is None or got is out
                _same_bytes(got, stacks[root][p])

        cases.append(Case(f"scatter root={root}", scatter, scatter_check))

    def barrier_check(results: list[Any]) -> None:
        assert results == [None] * n

    cases.append(Case("barrier", lambda rt, p: rt.barrier(p), barrier_check))
    return cases


def run_cases(rt: col.Runtime, n: int, cfg: col.CollectiveConfig, cases: list[Case]) -> None:
    """Every peer registers, runs every case in order, finishes; then every case is checked."""

    def body(peer: int) -> list[Any]:
        rt.register(peer, "cpu", cfg)
        results = [case.run(rt, peer) for case in cases]
        rt.finish(peer)
        return results

    per_peer = run_peers(n, body, rt)
    for index, case in enumerate(cases):
        try:
            case.check([per_peer[p][index] for p in range(n)])
        except AssertionError as exc:
            raise AssertionError(f"{case.label}: {exc}") from exc


def _unchanged(inputs: list[np.ndarray], originals: list[bytes]) -> None:
    changed = [
        i for i, (x, before) in enumerate(zip(inputs, originals, strict=True)) if x.tobytes() != before
    ]
    assert not changed, f"inputs {changed} were written"


@pytest.mark.parametrize("path", ["fused", "shared"])
def test_every_new_result_is_an_array_of_its_own(path: str) -> None:
    """No result without ``out=`` shares a byte with another peer's result or with any input (every
    peer of an all_reduce gets the same values: each in its own array, to write as it likes)."""
    n, inputs = 3, []
    cases = cases_for(n, np.float32, (4, 2), False, 3, ["sum"], [1], inputs, in_place=False)
    cases.append(Case("all_reduce", lambda rt, p: rt.all_reduce(p, inputs[p]), lambda results: None))
    cases.append(Case("broadcast", lambda rt, p: rt.broadcast(p, None if p else inputs[0]), lambda r: None))
    cases.append(Case("reduce", lambda rt, p: rt.reduce(p, inputs[p], root=1), lambda r: None))
    with col.Runtime(**PATHS[path]) as rt:

        def body(peer: int) -> list[Any]:
            rt.register(peer, "cpu", config(n))
            results = [case.run(rt, peer) for case in cases]
            rt.finish(peer)
            return results

        per_peer = run_peers(n, body, rt)
    checked = 0
    for index, case in enumerate(cases):
        got = [per_peer[p][index] for p in range(n)]
        got = [r[0] if isinstance(r, tuple) and r[1] is None else r for r in got]  # (result, out) pairs
        arrays = [r for r in got if isinstance(r, np.ndarray)]
        checked += len(arrays)
        for i, a in enumerate(arrays):
            assert not any(np.shares_memory(a, x) for x in inputs), f"{case.label}: a result is an input"
            assert not any(np.shares_memory(a, b) for b in arrays[i + 1 :]), f"{case.label}: results share"
    assert checked >= 6 * n  # all_gather, reduce_scatter, all_to_all, all_reduce, broadcast: every peer;
    # scatter: the peers without out; reduce: the root


@pytest.mark.parametrize("path", list(PATHS))
def test_a_barrier_releases_no_peer_before_every_peer_entered(path: str) -> None:
    n, rounds = 4, 5
    entered = [0] * rounds
    lock = threading.Lock()

    def body(peer: int) -> list[int]:
        rt.register(peer, "cpu", config(n, Ring()))
        seen = []
        for r in range(rounds):
            if peer == r % n:
                time.sleep(0.05)  # one peer late in each round
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


# -- errors: the same on every peer, and the job goes on ----------------------------------------------


@pytest.fixture(params=list(PATHS))
def rt(request: pytest.FixtureRequest) -> Iterator[col.Runtime]:
    """Errors must be the same on the in-process fast paths and over the schedules."""
    with col.Runtime(**PATHS[request.param]) as runtime:
        yield runtime


def run_failing_step(rt: col.Runtime, n: int, step: Callable[[int], Any], timeout: float = 10.0) -> list[Any]:
    """Every peer runs ``step`` (expected to fail), then a good all_reduce; each peer's outcome.

    The all_reduce after the failed step must work on every peer: the job stays usable.
    """

    def body(peer: int) -> Any:
        rt.register(peer, "cpu", config(n, timeout=timeout))
        try:
            outcome: Any = step(peer)
        except col.CollectiveError as exc:
            outcome = exc
        good = rt.all_reduce(peer, np.full(3, peer, np.int64))
        rt.finish(peer)
        return outcome, good

    results = run_peers(n, body, rt)
    for _, good in results:
        np.testing.assert_array_equal(good, np.full(3, n * (n - 1) // 2))
    return [outcome for outcome, _ in results]


def _z(*shape: int, dtype: Any = np.float64) -> np.ndarray:
    return np.zeros(shape, dtype)


MISMATCHES: dict[str, tuple[Callable[[col.Runtime, int], Any], str]] = {
    "all_gather-shape": (
        lambda rt, p: rt.all_gather(p, _z(4) if p == 2 else _z(3)),
        "all_gather #0: peers disagree on shape: peers 0-1 passed (3,), peer 2 passed (4,)",
    ),
    "all_gather-dtype": (
        lambda rt, p: rt.all_gather(p, _z(3, dtype=np.float32 if p == 0 else np.float64)),
        "dtype: peer 0 passed float32, peers 1-2 passed float64",
    ),
    "reduce_scatter-op": (
        lambda rt, p: rt.reduce_scatter(p, _z(6), "max" if p == 1 else "sum"),
        "reduce_scatter #0: peers disagree on op: peers 0, 2 passed sum, peer 1 passed max",
    ),
    "reduce_scatter-shape": (
        lambda rt, p: rt.reduce_scatter(p, _z(6, 2) if p == 0 else _z(6)),
        "shape: peer 0 passed (6, 2), peers 1-2 passed (6,)",
    ),
    "all_to_all-shape": (
        lambda rt, p: rt.all_to_all(p, _z(9) if p == 1 else _z(6)),
        "all_to_all #0: peers disagree on shape: peers 0, 2 passed (6,), peer 1 passed (9,)",
    ),
    "all_to_all-dtype": (
        lambda rt, p: rt.all_to_all(p, _z(6, dtype=np.int32 if p == 2 else np.int64)),
        "dtype: peers 0-1 passed int64, peer 2 passed int32",
    ),
    "gather-root": (
        lambda rt, p: rt.gather(p, _z(2), root=2 if p == 0 else 1),
        "gather #0: peers disagree on root: peer 0 passed 2, peers 1-2 passed 1",
    ),
    "gather-shape": (
        lambda rt, p: rt.gather(p, _z(2) if p else _z(1), root=1),
        "shape: peer 0 passed (1,), peers 1-2 passed (2,)",
    ),
    "scatter-two-roots": (
        lambda rt, p: rt.scatter(p, _z(3, 2) if p < 2 else None, root=p if p < 2 else 0),
        "scatter #0: peers disagree on root: peers 0, 2 passed 0, peer 1 passed 1",
    ),
    "scatter-out-shape": (
        lambda rt, p: rt.scatter(p, _z(3, 2) if p == 0 else None, root=0, out=_z(5) if p == 2 else None),
        "scatter #0: peers disagree on shape: peer 0 passed (2,), peer 2 passed (5,)",
    ),
    "collective": (
        lambda rt, p: rt.all_to_all(p, _z(3)) if p == 1 else rt.all_gather(p, _z(3)),
        "peers called different collectives: peers 0, 2 passed all_gather, peer 1 passed all_to_all",
    ),
    "barrier-vs-all_reduce": (
        lambda rt, p: rt.barrier(p) if p == 0 else rt.all_reduce(p, _z(2)),
        "peers called different collectives: peer 0 passed barrier, peers 1-2 passed all_reduce",
    ),
    "broadcast-no-source": (
        lambda rt, p: rt.broadcast(p, None),
        "broadcast #0: exactly one peer (the root) must pass an array; no peer passed one",
    ),
    "broadcast-two-sources": (
        lambda rt, p: rt.broadcast(p, _z(2) if p != 0 else None),
        "exactly one peer (the root) must pass an array; peers 1-2 passed one",
    ),
}


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_mismatches_are_a_mismatch_error_on_every_peer_naming_both_sides(rt: col.Runtime, name: str) -> None:
    call, expected = MISMATCHES[name]
    for error in run_failing_step(rt, 3, lambda p: call(rt, p)):
        assert isinstance(error, col.MismatchError), error
        assert expected in str(error)


def test_a_scatter_receiver_naming_another_root_is_a_mismatch(rt: col.Runtime) -> None:
    def step(peer: int) -> Any:
        x = np.arange(6.0).reshape(3, 2) if peer == 0 else None
        return rt.scatter(peer, x, root=1 if peer == 2 else 0)

    for error in run_failing_step(rt, 3, step):
        assert isinstance(error, col.MismatchError), error
        assert "root: peers 0-1 passed 0, peer 2 passed 1" in str(error)


INVALID: dict[str, tuple[Callable[[col.Runtime, int], Any], str]] = {
    "reduce_scatter-indivisible": (
        lambda rt, p: rt.reduce_scatter(p, _z(7)),
        "reduce_scatter needs x.shape[0] divisible by the group size 3, got shape (7,)",
    ),
    "reduce_scatter-one-peer-indivisible": (
        lambda rt, p: rt.reduce_scatter(p, _z(4, 2) if p == 1 else _z(3, 2)),
        "peer 1: reduce_scatter needs x.shape[0] divisible by the group size 3, got shape (4, 2)",
    ),
    "reduce_scatter-0d": (
        lambda rt, p: rt.reduce_scatter(p, np.float64(1.0)),
        "reduce_scatter needs x.shape[0] divisible by the group size 3, got a 0-d array",
    ),
    "reduce_scatter-op": (
        lambda rt, p: rt.reduce_scatter(p, _z(3), "avg" if p == 2 else "sum"),
        "peer 2: unknown reduce op 'avg'",
    ),
    "reduce_scatter-out-shape": (
        lambda rt, p: rt.reduce_scatter(p, _z(6), out=_z(6) if p == 0 else None),
        "peer 0: out has shape (6,) and dtype float64; the result has (2,)",
    ),
    "all_to_all-indivisible": (
        lambda rt, p: rt.all_to_all(p, _z(5, 2) if p == 0 else _z(6, 2)),
        "peer 0: all_to_all needs x.shape[0] divisible by the group size 3, got shape (5, 2)",
    ),
    "all_gather-out-shape": (
        lambda rt, p: rt.all_gather(p, _z(2), out=_z(2, 2) if p == 1 else None),
        "peer 1: out has shape (2, 2) and dtype float64; the result has (3, 2)",
    ),
    "all_gather-not-an-array": (
        lambda rt, p: rt.all_gather(p, [1.0] if p == 2 else _z(1)),
        "peer 2: x must be an array (numpy, CuPy, torch, JAX, or anything with __array_interface__ or "
        "__dlpack__), got list",
    ),
    "gather-root-outside": (
        lambda rt, p: rt.gather(p, _z(2), root=3),
        "root 3 is not a peer of the group (peers 0-2)",
    ),
    "scatter-non-root-passes-an-array": (
        lambda rt, p: rt.scatter(p, _z(3, 2) if p in (0, 2) else None, root=0),
        "peer 2: only the root (peer 0) passes an array to scatter; pass None",
    ),
    "scatter-root-rows-not-group-size": (
        lambda rt, p: rt.scatter(p, _z(4, 2) if p == 1 else None, root=1),
        "peer 1: scatter needs x.shape[0] == the group size 3, got shape (4, 2)",
    ),
    "scatter-root-passes-none": (
        lambda rt, p: rt.scatter(p, None, root=2),
        "peer 2: the root (peer 2) must pass an array of shape (group size, ...) to scatter",
    ),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_arguments_are_an_invalid_argument_error_on_every_peer(rt: col.Runtime, name: str) -> None:
    call, expected = INVALID[name]
    for error in run_failing_step(rt, 3, lambda p: call(rt, p)):
        assert isinstance(error, col.InvalidArgumentError) and isinstance(error, ValueError), error
        assert expected in str(error)


# -- arguments checked before the rendezvous -----------------------------------------------------


class _FakeCupyArray:
    """Stands in for a CuPy array: collective.tensors passes anything of module ``cupy`` through."""

    __module__ = "cupy._core.stand_in"

    def __init__(self, n: int) -> None:
        self.shape, self.dtype, self.size = (n,), np.dtype(np.float32), n


EARLY_CHECKED: dict[str, tuple[Callable[[col.Runtime, int], Any], Callable[[col.Runtime, int], Any]]] = {
    # name: (peer 0's bad call, the same collective as the other peers call it)
    "timeout": (
        lambda rt, p: rt.all_gather(p, _z(2), timeout=-1),
        lambda rt, p: rt.all_gather(p, _z(2)),
    ),
    "coalesced-empty": (
        lambda rt, p: rt.all_reduce_coalesced(p, []),
        lambda rt, p: rt.all_reduce_coalesced(p, [_z(2), _z(3)]),
    ),
    "coalesced-mixed-devices": (
        lambda rt, p: rt.all_reduce_coalesced(p, [_z(2), _FakeCupyArray(3)]),
        lambda rt, p: rt.all_reduce_coalesced(p, [_z(2), _z(3)]),
    ),
    "coalesced-out-length": (
        lambda rt, p: rt.all_reduce_coalesced(p, [_z(2), _z(3)], out=[_z(2)]),
        lambda rt, p: rt.all_reduce_coalesced(p, [_z(2), _z(3)]),
    ),
}


@pytest.mark.parametrize("name", list(EARLY_CHECKED))
def test_one_peer_with_an_argument_checked_early_fails_every_peer_and_keeps_steps_aligned(name: str) -> None:
    bad, good = EARLY_CHECKED[name]
    with col.Runtime() as rt:
        errors = run_failing_step(rt, 2, lambda p: bad(rt, p) if p == 0 else good(rt, p), timeout=0.5)
    for error in errors:
        assert isinstance(error, col.InvalidArgumentError), error


@pytest.mark.parametrize("timeout", [0, -1, math.nan, math.inf, "5", True])
def test_an_invalid_timeout_on_every_peer_is_an_invalid_argument_error(rt: col.Runtime, timeout: Any) -> None:
    errors = run_failing_step(rt, 2, lambda p: rt.barrier(p, timeout=timeout))
    for error in errors:
        assert isinstance(error, col.InvalidArgumentError) and "timeout must be" in str(error), error


# -- send / recv ----------------------------------------------------------------------------------


def _registered(rt: col.Runtime, n: int, timeout: float = 20.0) -> None:
    """Register peers 0..n-1 of a job (from threads; they may then be driven from any thread)."""
    run_peers(n, lambda p: rt.register(p, "cpu", config(n, timeout=timeout)), rt)


def test_send_recv_carries_shape_and_dtype_and_copies_at_send(runtime: col.Runtime) -> None:
    arrays = [
        np.full((), 2.5),
        np.zeros((0, 3), np.int32),
        make_input(0, (4, 5), np.float16, seed=1),
        make_input(0, (7,), ml_dtypes.bfloat16, seed=2),
        make_input(0, (3, 4), np.int64, seed=3, view=True),
        make_input(0, (300_000,), np.float32, seed=4),
    ]
    originals = [x.copy() for x in arrays]

    def body(peer: int) -> Any:
        if peer == 0:
            for x in arrays:
                runtime.send(0, x, dst=1)
                x[...] = 0  # the data was copied at send: the receiver still gets the original
            return None
        got = [runtime.recv(1, src=0, timeout=10) for _ in arrays]
        out = np.full((2, 2), 9, np.float32)
        returned = runtime.recv(1, src=0, tag=4, out=out, timeout=10)
        return got, returned is out, out

    _registered(runtime, 2)
    runtime.send(0, np.arange(4, dtype=np.float32).reshape(2, 2), dst=1, tag=4)
    _, (got, is_out, out) = run_peers(2, body, runtime)
    for received, original in zip(got, originals, strict=True):
        _same_bytes(received, original)
    assert is_out
    _same_bytes(out, np.arange(4, dtype=np.float32).reshape(2, 2))


def test_recv_into_an_out_whose_elements_share_memory_is_refused_and_the_message_stays(
    runtime: col.Runtime,
) -> None:
    """[[0, 1, 2], [3, 4, 5]] into np.broadcast_to-like or expanded memory came out [[3, 4, 5]] * 2."""
    _registered(runtime, 2)
    message = np.arange(6.0).reshape(2, 3)
    runtime.send(0, message, dst=1)
    shared = np.lib.stride_tricks.as_strided(np.zeros(3), (2, 3), (0, 8))  # one row, seen twice
    with pytest.raises(col.InvalidArgumentError, match="out has elements that share memory"):
        runtime.recv(1, src=0, out=shared, timeout=5)
    transposed = np.zeros((3, 2)).T  # not contiguous, but its elements are its own: fine
    assert runtime.recv(1, src=0, out=transposed, timeout=5) is transposed
    np.testing.assert_array_equal(transposed, message)


def test_tags_do_not_block_each_other_and_each_src_dst_tag_keeps_its_order(runtime: col.Runtime) -> None:
    _registered(runtime, 3)
    for i in range(10):
        runtime.send(0, np.full(2, i), dst=2, tag=5)
        runtime.send(1, np.full(2, 100 + i), dst=2, tag=5)
        runtime.send(0, np.full(2, 200 + i), dst=2, tag=3)
    # The last tag sent is received first; sources interleave; within (src, dst, tag) the order holds.
    assert [runtime.recv(2, src=0, tag=3, timeout=5)[0] for _ in range(10)] == [200 + i for i in range(10)]
    got_1 = [runtime.recv(2, src=1, tag=5, timeout=5)[0] for _ in range(5)]
    got_0 = [runtime.recv(2, src=0, tag=5, timeout=5)[0] for _ in range(10)]
    got_1 += [runtime.recv(2, src=1, tag=5, timeout=5)[0] for _ in range(5)]
    assert got_0 == list(range(10)) and got_1 == [100 + i for i in range(10)]


def test_two_peers_send_to_each_other_then_receive(runtime: col.Runtime) -> None:
    big = [make_input(p, (1 << 20,), np.float32, seed=7) for p in range(2)]  # 4 MiB: still eager

    def body(peer: int) -> Any:
        other = 1 - peer
        runtime.send(peer, big[peer], dst=other)
        runtime.send(peer, np.full(3, peer), dst=other, tag=1)
        return runtime.recv(peer, src=other, timeout=10), runtime.recv(peer, src=other, tag=1, timeout=10)

    _registered(runtime, 2)
    for peer, (data, small) in enumerate(run_peers(2, body, runtime)):
        _same_bytes(data, big[1 - peer])
        np.testing.assert_array_equal(small, np.full(3, 1 - peer))


def test_recv_without_a_send_times_out_naming_the_source_and_a_later_message_still_arrives(
    runtime: col.Runtime,
) -> None:
    _registered(runtime, 3, timeout=30)
    started = time.monotonic()
    with pytest.raises(col.CollectiveTimeout) as info:
        runtime.recv(0, src=2, tag=7, timeout=0.3)
    assert time.monotonic() - started < 5, "the call's timeout, not the config's 30 s"
    assert info.value.missing == (2,) and isinstance(info.value, TimeoutError)
    assert "waited 0.3s for a message from peer 2 with tag 7" in str(info.value)
    runtime.send(2, np.ones(2), dst=0, tag=7)
    np.testing.assert_array_equal(runtime.recv(0, src=2, tag=7, timeout=5), np.ones(2))


def test_recv_from_a_peer_that_finished_is_a_peer_lost_error(runtime: col.Runtime) -> None:
    finished = threading.Event()

    def body(peer: int) -> Any:
        runtime.register(peer, "cpu", config(3, timeout=30))
        if peer == 1:
            runtime.send(1, np.arange(3), dst=0)
            runtime.finish(1)
            finished.set()
            return None
        if peer == 2:  # blocked in recv while peer 1 finishes: woken at once, not at the timeout
            started = time.monotonic()
            with pytest.raises(col.PeerLostError, match=r"peer 1 left the job \(finish\)") as info:
                runtime.recv(2, src=1)
            assert time.monotonic() - started < 10 and info.value.peers == (1,)
            return None
        assert finished.wait(10)
        sent = runtime.recv(0, src=1, timeout=5)  # what it sent before it left still arrives
        with pytest.raises(col.PeerLostError) as info:
            runtime.recv(0, src=1, timeout=20)
        with pytest.raises(col.PeerLostError, match=r"send: peer 1 left the job \(finish\)"):
            runtime.send(0, np.ones(3), dst=1)  # (it returned: the data waited for nobody)
        return sent, info.value.peers

    sent, peers = run_peers(3, body, runtime)[0]
    np.testing.assert_array_equal(sent, np.arange(3))
    assert peers == (1,)


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda rt: rt.send(0, np.ones(2), dst=2), r"dst=2 is not a peer of the job \(peers 0\.\.1\)"),
        (lambda rt: rt.send(0, np.ones(2), dst=-1), "dst=-1 is not a peer"),
        (lambda rt: rt.send(0, np.ones(2), dst=True), "dst=True is not a peer"),
        (lambda rt: rt.send(0, np.ones(2), dst="1"), "dst='1' is not a peer"),
        (lambda rt: rt.send(0, np.ones(2), dst=0), "peer 0 cannot send to or receive from itself"),
        (lambda rt: rt.send(0, np.ones(2), dst=1, tag=-1), r"tag must be .* to 2\*\*63 - 1, got -1"),
        (lambda rt: rt.send(0, np.ones(2), dst=1, tag=1.5), r"tag must be .* to 2\*\*63 - 1, got 1.5"),
        (lambda rt: rt.send(0, np.ones(2), dst=1, tag=True), r"tag must be .* to 2\*\*63 - 1, got True"),
        (lambda rt: rt.send(0, [1.0], dst=1), "send: peer 0: x must be an array"),
        (lambda rt: rt.recv(1, src=5), "src=5 is not a peer"),
        (lambda rt: rt.recv(1, src=1), "peer 1 cannot send to or receive from itself"),
        (lambda rt: rt.recv(1, src=0, tag=-2), "tag must be an integer from 0"),
        (lambda rt: rt.recv(1, src=0, timeout=-1), "timeout must be a finite number of seconds > 0"),
    ],
    ids=[
        "dst-world",
        "dst-negative",
        "dst-bool",
        "dst-str",
        "dst-self",
        "tag-negative",
        "tag-float",
        "tag-bool",
        "x-list",
        "src-world",
        "src-self",
        "recv-tag",
        "recv-timeout",
    ],
)
def test_bad_peers_tags_and_arrays_in_send_and_recv(runtime: col.Runtime, call: Any, expected: str) -> None:
    _registered(runtime, 2)
    started = time.monotonic()
    with pytest.raises(col.InvalidArgumentError, match=expected):
        call(runtime)
    assert time.monotonic() - started < 5
    runtime.send(0, np.ones(2), dst=1)  # nothing broken
    np.testing.assert_array_equal(runtime.recv(1, src=0, timeout=5), np.ones(2))


# -- all_reduce_coalesced --------------------------------------------------------------------------

COALESCED = [
    ((3, 4), np.float32),
    ((17,), np.int32),
    ((), np.float64),
    ((0,), np.float32),
    ((5,), np.float16),
    ((2, 3), ml_dtypes.bfloat16),
    ((30_000,), np.float32),  # the float32 bucket is past the fused path's 64 KiB
    ((2, 2), np.int32),
]


ONE_DTYPE = [(3, 4), (17,), (), (0,), (2, 0, 3), (2, 3, 5), (9_000,)]  # one dtype: one bucket


@pytest.mark.parametrize("path", list(PATHS))
def test_a_one_dtype_coalesced_list_gives_views_of_one_bucket_in_every_shape(path: str) -> None:
    xs = [[np.full(shape, p + 1.0 + i, np.float32) for i, shape in enumerate(ONE_DTYPE)] for p in range(3)]

    def body(peer: int) -> Any:
        rt.register(peer, "cpu", config(3, Ring()))
        first = rt.all_reduce_coalesced(peer, xs[peer], "sum")
        again = rt.all_reduce_coalesced(peer, tuple(xs[peer]), "max")  # (the same layout, remembered)
        rt.finish(peer)
        return first, again

    with col.Runtime(**PATHS[path]) as rt:
        results = run_peers(3, body, rt)
    for first, again in results:
        for i, shape in enumerate(ONE_DTYPE):
            assert first[i].shape == shape and first[i].dtype == np.float32
            np.testing.assert_array_equal(first[i], np.full(shape, 6.0 + 3 * i, np.float32))
            np.testing.assert_array_equal(again[i], np.full(shape, 3.0 + i, np.float32))
        bases = {id(view.base) for view in first if view.size}
        assert len(bases) == 1  # every result is a view of the one reduced bucket


def test_the_layouts_of_coalesced_lists_are_remembered_within_a_bound(rt: col.Runtime) -> None:
    from collective.calls import coalesced

    _registered(rt, 1)
    for length in range(1, coalesced._MAX_LAYOUTS * 2):  # more distinct lists than it remembers
        got = rt.all_reduce_coalesced(0, [np.ones(2, np.float32)] * length)
        assert len(got) == length and all(g.tolist() == [1.0, 1.0] for g in got)
        assert 1 <= len(coalesced._LAYOUTS) <= coalesced._MAX_LAYOUTS


COALESCED_MISMATCHES: dict[str, tuple[Callable[[int], list[np.ndarray]], str, str]] = {
    # name: (peer p's list, op of peer p, text the MismatchError names)
    "length": (lambda p: [_z(2), _z(3)] if p != 1 else [_z(2)], "sum", "peer 1 passed 1 arrays (2,) float64"),
    "shape": (
        lambda p: [_z(2), _z(4) if p == 2 else _z(3)],
        "sum",
        "peer 2 passed 2 arrays (2,) float64, (4,) float64",
    ),
    "same-size-shape": (  # the buckets have the same size: nothing else would notice
        lambda p: [_z(2, 3) if p == 0 else _z(3, 2)],
        "sum",
        "peer 0 passed 1 arrays (2, 3) float64, peers 1-2 passed 1 arrays (3, 2) float64",
    ),
    "dtype": (
        lambda p: [_z(2), _z(3, dtype=np.int32 if p == 0 else np.float64)],
        "sum",
        "peer 0 passed 2 arrays (2,) float64, (3,) int32",
    ),
    "op": (lambda p: [_z(2)], "max", "op: peers 0, 2 passed sum, peer 1 passed max"),
}


@pytest.mark.parametrize("name", list(COALESCED_MISMATCHES))
def test_coalesced_lists_that_differ_are_a_mismatch_on_every_peer(name: str) -> None:
    make, op, expected = COALESCED_MISMATCHES[name]
    with col.Runtime() as rt:
        errors = run_failing_step(
            rt, 3, lambda p: rt.all_reduce_coalesced(p, make(p), op if p == 1 else "sum"), timeout=0.5
        )
    for error in errors:
        assert isinstance(error, col.MismatchError), error
        assert "all_reduce_coalesced #0" in str(error) and expected in str(error)


def test_a_coalesced_list_with_a_non_array_item_is_invalid_on_every_peer(rt: col.Runtime) -> None:
    errors = run_failing_step(rt, 2, lambda p: rt.all_reduce_coalesced(p, [_z(2), "x" if p else _z(1)]))
    for error in errors:
        assert isinstance(error, col.InvalidArgumentError), error
        assert "peer 1: every item of the list must be an array" in str(error)


def test_a_coalesced_op_a_later_dtype_cannot_take_fails_before_any_array_is_written(rt: col.Runtime) -> None:
    """bxor over int32 and float32 arrays: the int32 bucket ran (its out written), then the float32
    one failed with "invalid arguments, so no peer ran it"."""
    outs: dict[int, list[np.ndarray]] = {}

    def step(peer: int) -> Any:
        xs = [np.full(3, 5, np.int32), np.ones(2, np.float32)]
        outs[peer] = [x.copy() for x in xs]
        return rt.all_reduce_coalesced(peer, xs, "bxor", out=outs[peer])

    for error in run_failing_step(rt, 2, step):
        assert isinstance(error, col.InvalidArgumentError), error
        assert "bxor" in str(error) and "float32" in str(error), error
    for written in outs.values():
        np.testing.assert_array_equal(written[0], np.full(3, 5, np.int32))  # untouched


def test_a_large_coalesced_object_array_is_invalid_on_every_peer(rt: col.Runtime) -> None:
    """Its bucket (past the pool's threshold) cannot come from the pool's byte blocks: the dtype is
    refused by the call on every peer, not by the pool on one."""
    errors = run_failing_step(
        rt, 2, lambda p: rt.all_reduce_coalesced(p, [np.empty(20_000 if p == 0 else 10, object)])
    )
    for error in errors:
        assert isinstance(error, col.InvalidArgumentError), error
        assert "unsupported dtype object" in str(error)


# -- groups ----------------------------------------------------------------------------------------


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
        _same_bytes(got["all_gather"], np.stack(members))
        assert_matches(got["all_reduce"], mean, 3)
        assert_matches(got["reduce_scatter"], mean[2 * rank : 2 * rank + 2], 3)
        _same_bytes(got["all_to_all"], np.concatenate([m[2 * rank : 2 * rank + 2] for m in members]))
        assert (got["gather"] is None) == (peer != 3)
        _same_bytes(got["scatter"], stack[rank])
        assert (got["reduce"] is None) == (peer != 1)
        _same_bytes(got["broadcast"], xs[3])
        assert_matches(got["coalesced"][0], mean, 3)
        assert_matches(got["coalesced"][1], mean[0], 3)
    _same_bytes(results[3]["gather"], np.stack(members))
    assert_matches(results[1]["reduce"], reference(members, "sum"), 3)
    for peer in other.members:
        assert_matches(results[peer]["all_reduce"], reference([xs[0], xs[2]], "mean"), 2)
    for got in results:
        assert_matches(got["world"], reference(xs, "mean"), n)


def test_a_group_of_one_completes_alone(runtime: col.Runtime) -> None:
    _registered(runtime, 3)
    alone = col.new_group([2])
    x = np.arange(6.0).reshape(3, 2)
    _same_bytes(runtime.all_gather(2, x, group=alone), x[None])
    _same_bytes(runtime.all_reduce(2, x, "mean", group=alone), x)
    _same_bytes(runtime.scatter(2, x[None], root=2, group=alone), x)
    _same_bytes(runtime.all_to_all(2, x, group=alone), x)
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


CALL_TIMEOUT = 3.0  # per call in the tests below; a call still running 2 s after its partners was not woken


def _drive(rt: col.Runtime, bodies: list[Callable[[], Any]], within: float) -> list[Any]:
    """Run each body in a thread of its own; each one's result or exception.

    Threads still running after ``within`` seconds fail the test as a hang (the job is reset to
    free them first).
    """
    outcomes: list[Any] = [None] * len(bodies)

    def target(index: int) -> None:
        try:
            outcomes[index] = bodies[index]()
        except BaseException as exc:
            outcomes[index] = exc

    threads = [
        threading.Thread(target=target, args=(i,), name=f"driver-{i}", daemon=True)
        for i in range(len(bodies))
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + within
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        rt.reset()
        for thread in threads:
            thread.join(10)
        raise AssertionError(f"{stuck} still running after {within:g} s: not woken")
    return outcomes


@pytest.mark.parametrize("path", ["fused", "linked"])
def test_a_peer_waiting_in_two_groups_at_once_is_woken_for_each(path: str) -> None:
    def call(peer: int, members: list[int], wait: float = 0.0) -> Callable[[], Any]:
        def body() -> Any:
            time.sleep(wait)
            return rt.all_reduce(peer, np.ones(2), group=col.new_group(members), timeout=CALL_TIMEOUT)

        return body

    with col.Runtime(**PATHS[path]) as rt:
        _registered(rt, 3, timeout=30)
        # Peer 0 waits in both groups from two threads before its partners call (0.5 s later).
        bodies = [call(0, [0, 1]), call(0, [0, 2]), call(2, [0, 2], 0.5), call(1, [0, 1], 0.5)]
        for got in _drive(rt, bodies, within=CALL_TIMEOUT - 0.5):
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
        _registered(rt, 4, timeout=30)
        bodies = [lambda p=p, g=g: body(p, g) for p, g in drivers]
        results = _drive(rt, bodies, within=CALL_TIMEOUT + 1)
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
    "all_reduce": lambda rt, p, g: rt.all_reduce(p, _z(2), group=g),
    "all_gather": lambda rt, p, g: rt.all_gather(p, _z(2), group=g),
    "reduce_scatter": lambda rt, p, g: rt.reduce_scatter(p, _z(2), group=g),
    "all_to_all": lambda rt, p, g: rt.all_to_all(p, _z(2), group=g),
    "gather": lambda rt, p, g: rt.gather(p, _z(2), root=0, group=g),
    "scatter": lambda rt, p, g: rt.scatter(p, None, root=0, group=g),
    "broadcast": lambda rt, p, g: rt.broadcast(p, None, group=g),
    "barrier": lambda rt, p, g: rt.barrier(p, group=g),
    "coalesced": lambda rt, p, g: rt.all_reduce_coalesced(p, [_z(2)], group=g),
    "async": lambda rt, p, g: rt.all_reduce(p, _z(2), group=g, async_op=True),
}


@pytest.mark.parametrize("kind", list(GROUP_CALLS))
def test_a_peer_outside_the_group_is_refused_at_once(runtime: col.Runtime, kind: str) -> None:
    _registered(runtime, 3, timeout=30)
    started = time.monotonic()
    with pytest.raises(col.InvalidArgumentError, match="peer 2 is not a member of the group of peers 0-1"):
        GROUP_CALLS[kind](runtime, 2, col.new_group([0, 1]))
    assert time.monotonic() - started < 5, "at once, not after the 30 s timeout"
    assert [y[0] for y in run_peers(3, lambda p: runtime.all_reduce(p, np.ones(1)), runtime)] == [3] * 3


def test_a_group_naming_peers_outside_the_job_or_not_a_group(runtime: col.Runtime) -> None:
    early = col.new_group([0, 5])  # no job yet in the default runtime: checked when used
    _registered(runtime, 2)
    with pytest.raises(
        col.InvalidArgumentError, match=r"the group names peer 5, but the job's peers are 0\.\.1"
    ):
        runtime.all_reduce(0, np.ones(1), group=early)


def test_a_list_of_peer_ids_is_the_group_it_names(runtime: col.Runtime) -> None:
    """Peer 2 passed group=[2, 1, 0] (the whole job) while the others passed none: it raised alone,
    before taking a step, and its next call joined the step the others were still in: silently
    wrong results (102 for 3) from then on. A list is now the group new_group() makes of it."""
    _registered(runtime, 3, timeout=30)

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


# -- async work ------------------------------------------------------------------------------------

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
        mismatch = rt.all_gather(peer, _z(2 + peer), async_op=True)
        invalid = rt.reduce_scatter(peer, _z(3), async_op=True)
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
    _registered(runtime, 2)
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
        if peer == 1:
            time.sleep(0.05)  # let peer 0 queue some work first
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
    _registered(runtime, 3, timeout=30)
    kw: dict[str, Any] = {"async_op": True, "timeout": CALL_TIMEOUT}
    pair_1, pair_2 = col.new_group([0, 1]), col.new_group([0, 2])

    def scenario() -> None:
        first = runtime.all_reduce(0, np.ones(2), group=pair_1, **kw)
        second = runtime.all_reduce(0, np.ones(2), group=pair_2, **kw)
        time.sleep(0.5)  # both of peer 0's Works now wait for their partners
        np.testing.assert_array_equal(runtime.all_reduce(2, np.ones(2), group=pair_2), [2, 2])
        np.testing.assert_array_equal(second.wait(CALL_TIMEOUT - 1), [2, 2])
        assert not first.is_completed(), "waits for peer 1 only, not for the other group"
        np.testing.assert_array_equal(runtime.all_reduce(1, np.ones(2), group=pair_1), [2, 2])
        np.testing.assert_array_equal(first.wait(CALL_TIMEOUT - 1), [2, 2])

    (outcome,) = _drive(runtime, [scenario], within=2 * CALL_TIMEOUT)
    if outcome is not None:
        raise outcome


def _new_threads(before: set[threading.Thread], within: float) -> list[threading.Thread]:
    """Threads started since ``before`` that are still alive after waiting up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        alive = [t for t in threading.enumerate() if t not in before]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


def test_dropped_work_leaks_no_thread_once_it_completes(runtime: col.Runtime) -> None:
    _registered(runtime, 2)
    before = set(threading.enumerate())
    baseline = threading.active_count()
    for i in range(20):  # never waited: completed by peer 1's calls below, or timed out
        runtime.all_reduce(0, np.full(2, i), async_op=True)
    runtime.all_gather(0, np.ones(1), timeout=0.2, async_op=True)  # peer 1 never calls this one
    gc.collect()
    assert any(t.name.startswith("collective-") for t in threading.enumerate() if t not in before)
    for i in range(20):
        np.testing.assert_array_equal(runtime.all_reduce(1, np.full(2, i)), [2 * i, 2 * i])
    leaked = _new_threads(before, within=10)
    assert not leaked, f"threads left behind: {leaked}"
    assert threading.active_count() <= baseline


def test_finish_lets_the_peers_queued_work_end_first(runtime: col.Runtime) -> None:
    """finish() used to return at once: the queued calls were dropped and their wait() raised
    RegistrationError 'peer 0 has finished'."""
    _registered(runtime, 2)
    works = [runtime.all_reduce(0, np.full(2, i), async_op=True) for i in range(5)]
    finishing = threading.Thread(target=runtime.finish, args=(0,))
    finishing.start()
    time.sleep(0.2)
    assert finishing.is_alive()  # peer 1 has not called yet: the works wait, and so does finish
    for i in range(5):
        np.testing.assert_array_equal(runtime.all_reduce(1, np.full(2, i)), [2 * i, 2 * i])
    finishing.join(10)
    assert not finishing.is_alive()
    for i, work in enumerate(works):
        np.testing.assert_array_equal(work.wait(5), [2 * i, 2 * i])
    with pytest.raises(col.RegistrationError, match="peer 0 has finished"):
        runtime.all_reduce(0, np.ones(2))


# -- per-call timeouts -----------------------------------------------------------------------------

TIMED: dict[str, Callable[..., Any]] = {
    "all_gather": lambda rt, p, **kw: rt.all_gather(p, _z(2), **kw),
    "reduce_scatter": lambda rt, p, **kw: rt.reduce_scatter(p, _z(2), **kw),
    "all_to_all": lambda rt, p, **kw: rt.all_to_all(p, _z(2), **kw),
    "gather": lambda rt, p, **kw: rt.gather(p, _z(2), root=1, **kw),
    "scatter": lambda rt, p, **kw: rt.scatter(p, _z(2, 3) if p == 0 else None, root=0, **kw),
    "barrier": lambda rt, p, **kw: rt.barrier(p, **kw),
    "coalesced": lambda rt, p, **kw: rt.all_reduce_coalesced(p, [_z(2), _z(3, dtype=np.int32)], **kw),
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
            time.sleep(1.0)  # past the config's 0.5 s
        return runtime.all_gather(peer, np.full(2, peer), timeout=20)

    def body(peer: int) -> Any:
        runtime.register(peer, "cpu", config(2, timeout=0.5))
        return step(peer)

    for got in run_peers(2, body, runtime):
        np.testing.assert_array_equal(got, [[0, 0], [1, 1]])
