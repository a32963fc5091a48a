"""The uneven collectives (all_gather_v, reduce_scatter_v, all_to_all_v): what they return, and
their errors on every peer. Their results on every path are in the conformance matrix
(tests/test_matrix.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import collective as col
from tests.conftest import run_peers

# ``rt``: a Runtime for each in-process path (tests/conftest.py).


def on_every_peer(rt: col.Runtime, n: int, step: Callable[[int], Any]) -> list[Any]:
    """Every peer runs ``step`` then a good all_reduce (the job goes on); each peer's outcome."""

    def body(peer: int) -> Any:
        rt.register(peer, "cpu", col.CollectiveConfig(num_devices=n, timeout=10))
        try:
            outcome: Any = step(peer)
        except col.CollectiveError as exc:
            outcome = exc
        after = rt.all_reduce(peer, np.ones(2))
        rt.finish(peer)
        assert (after == n).all()
        return [outcome]  # (a list: run_peers takes an exception returned for a peer's failure)

    return [outcome for (outcome,) in run_peers(n, body, rt)]


def rows(peer: int, count: int, width: int = 2) -> np.ndarray:
    return np.arange(count * width, dtype=np.float32).reshape(count, width) + 100 * peer


def test_all_gather_v_returns_every_peers_rows_as_views_of_out(rt: col.Runtime) -> None:
    counts = [2, 0, 3]
    outs = [np.empty((5, 2), np.float32) for _ in counts]

    def step(peer: int) -> Any:
        return rt.all_gather_v(peer, rows(peer, counts[peer]), out=outs[peer])

    for peer, got in enumerate(on_every_peer(rt, 3, step)):
        assert [piece.shape for piece in got] == [(2, 2), (0, 2), (3, 2)]
        for source, piece in enumerate(got):
            np.testing.assert_array_equal(piece, rows(source, counts[source]))
            assert piece.base is outs[peer] or np.shares_memory(piece, outs[peer])


def test_reduce_scatter_v_gives_each_rank_its_rows_and_mean_divides(rt: col.Runtime) -> None:
    sizes = [1, 3, 0]
    xs = [np.arange(8, dtype=np.float64).reshape(4, 2) * (peer + 1) for peer in range(3)]
    total = sum(xs) / 3
    starts = [0, 1, 4, 4]
    got = on_every_peer(rt, 3, lambda peer: rt.reduce_scatter_v(peer, xs[peer], sizes, "mean"))
    for peer, result in enumerate(got):
        np.testing.assert_array_equal(result, total[starts[peer] : starts[peer + 1]])


def test_all_to_all_v_gives_the_rows_each_peer_sent_in_source_order(rt: col.Runtime) -> None:
    sends = [[1, 0, 2], [0, 0, 1], [3, 1, 0]]
    xs = [np.arange(sum(row), dtype=np.int64) + 10 * peer for peer, row in enumerate(sends)]
    got = on_every_peer(rt, 3, lambda peer: rt.all_to_all_v(peer, xs[peer], sends[peer]))
    for peer, pieces in enumerate(got):
        for source, piece in enumerate(pieces):
            start = sum(sends[source][:peer])
            np.testing.assert_array_equal(piece, xs[source][start : start + sends[source][peer]])


def test_uneven_collectives_on_a_group_and_asynchronously(runtime: col.Runtime) -> None:
    group = col.new_group([1, 3])

    def body(peer: int) -> Any:
        runtime.register(peer, "cpu", col.CollectiveConfig(num_devices=4, timeout=10))
        result = None
        if peer in (1, 3):
            work = runtime.all_gather_v(peer, rows(peer, peer), group=group, async_op=True)
            result = work.wait()
        runtime.finish(peer)
        return result

    got = run_peers(4, body, runtime)
    for peer in (1, 3):
        np.testing.assert_array_equal(got[peer][0], rows(1, 1))
        np.testing.assert_array_equal(got[peer][1], rows(3, 3))


ERRORS: dict[str, tuple[Callable[[col.Runtime, int], Any], type[Exception], str]] = {
    "all_gather_v 0-d": (
        lambda rt, p: rt.all_gather_v(p, np.float32(p) if p == 1 else rows(p, 1)),
        col.InvalidArgumentError,
        "peer 1: all_gather_v needs an array of at least one dimension",
    ),
    "all_gather_v widths": (
        lambda rt, p: rt.all_gather_v(p, rows(p, 2, width=3 if p == 0 else 2)),
        col.MismatchError,
        "shape: peer 0 passed (3,), peers 1-2 passed (2,)",
    ),
    "all_gather_v out rows": (
        lambda rt, p: rt.all_gather_v(p, rows(p, 1), out=np.empty((4 if p == 2 else 3, 2), np.float32)),
        col.InvalidArgumentError,
        "all_gather_v: rank 2's out has 4 rows, its result 3",
    ),
    "all_gather_v recv_sizes": (
        lambda rt, p: rt.all_gather_v(p, rows(p, p), recv_sizes=[0, 1, 3] if p == 2 else None),
        col.InvalidArgumentError,
        "all_gather_v: rank 2 expects 3 rows from rank 2, which sends 2",
    ),
    "reduce_scatter_v sum": (
        lambda rt, p: rt.reduce_scatter_v(p, rows(p, 3), [1, 1, 2] if p == 1 else [1, 1, 1]),
        col.InvalidArgumentError,
        "peer 1: sizes [1, 1, 2] sum to 4 rows; x has 3",
    ),
    "reduce_scatter_v sizes differ": (
        lambda rt, p: rt.reduce_scatter_v(p, rows(p, 3), [0, 1, 2] if p == 0 else [1, 1, 1]),
        col.MismatchError,
        "sizes: peer 0 passed (0, 1, 2), peers 1-2 passed (1, 1, 1)",
    ),
    "reduce_scatter_v length": (
        lambda rt, p: rt.reduce_scatter_v(p, rows(p, 3), [3]),
        col.InvalidArgumentError,
        "sizes must be a list of 3 integers >= 0, one per rank, got (3,)",
    ),
    "reduce_scatter_v negative": (
        lambda rt, p: rt.reduce_scatter_v(p, rows(p, 3), [4, -1, 0]),
        col.InvalidArgumentError,
        "sizes must be a list of 3 integers >= 0",
    ),
    "reduce_scatter_v not a list": (
        lambda rt, p: rt.reduce_scatter_v(p, rows(p, 3), 3),
        col.InvalidArgumentError,
        "sizes must be a list of 3 row counts, one per rank, got 3",
    ),
    "reduce_scatter_v out rows": (
        lambda rt, p: rt.reduce_scatter_v(p, rows(p, 3), [1, 1, 1], out=np.empty((2, 2), np.float32)),
        col.InvalidArgumentError,
        "out has 2 rows; rank 0 gets sizes[0] = 1",
    ),
    "all_to_all_v sum": (
        lambda rt, p: rt.all_to_all_v(p, rows(p, 2), [1, 1, 1]),
        col.InvalidArgumentError,
        "send_sizes [1, 1, 1] sum to 3 rows; x has 2",
    ),
    "all_to_all_v recv_sizes": (
        lambda rt, p: rt.all_to_all_v(p, rows(p, 3), [1, 1, 1], recv_sizes=[1, 2, 0] if p == 1 else None),
        col.InvalidArgumentError,
        "all_to_all_v: rank 1 expects 2 rows from rank 1, which sends 1; "
        "rank 1 expects 0 rows from rank 2, which sends 1",
    ),
    "all_to_all_v out rows": (
        lambda rt, p: rt.all_to_all_v(
            p, rows(p, 3), [1, 1, 1], out=np.empty((2 if p == 0 else 3, 2), np.float32)
        ),
        col.InvalidArgumentError,
        "all_to_all_v: rank 0's out has 2 rows, its result 3",
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_a_bad_uneven_call_fails_every_peer_and_the_job_goes_on(rt: col.Runtime, name: str) -> None:
    call, kind, expected = ERRORS[name]
    for outcome in on_every_peer(rt, 3, lambda p: call(rt, p)):
        assert isinstance(outcome, kind), outcome
        assert expected in str(outcome), str(outcome)
