"""all_reduce_coalesced on local peers (threads): a one-dtype list is views of one bucket, layouts
are remembered within a bound, and lists that differ or cannot be used fail every peer before
any array is written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import collective as col
from collective import Ring
from collective.calls.coalesced import MAX_LAYOUTS, remembered_layouts
from tests.conftest import PATHS, run_peers
from tests.peers import config, registered, run_failing_step, zeros

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
    registered(rt, 1)
    for length in range(1, MAX_LAYOUTS * 2):  # more distinct lists than it remembers
        got = rt.all_reduce_coalesced(0, [np.ones(2, np.float32)] * length)
        assert len(got) == length and all(g.tolist() == [1.0, 1.0] for g in got)
        assert 1 <= remembered_layouts() <= MAX_LAYOUTS


COALESCED_MISMATCHES: dict[str, tuple[Callable[[int], list[np.ndarray]], str, str]] = {
    # name: (peer p's list, op of peer p, text the MismatchError names)
    "length": (
        lambda p: [zeros(2), zeros(3)] if p != 1 else [zeros(2)],
        "sum",
        "peer 1 passed 1 arrays (2,) float64",
    ),
    "shape": (
        lambda p: [zeros(2), zeros(4) if p == 2 else zeros(3)],
        "sum",
        "peer 2 passed 2 arrays (2,) float64, (4,) float64",
    ),
    "same-size-shape": (  # the buckets have the same size: nothing else would notice
        lambda p: [zeros(2, 3) if p == 0 else zeros(3, 2)],
        "sum",
        "peer 0 passed 1 arrays (2, 3) float64, peers 1-2 passed 1 arrays (3, 2) float64",
    ),
    "dtype": (
        lambda p: [zeros(2), zeros(3, dtype=np.int32 if p == 0 else np.float64)],
        "sum",
        "peer 0 passed 2 arrays (2,) float64, (3,) int32",
    ),
    "op": (lambda p: [zeros(2)], "max", "op: peers 0, 2 passed sum, peer 1 passed max"),
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
    errors = run_failing_step(rt, 2, lambda p: rt.all_reduce_coalesced(p, [zeros(2), "x" if p else zeros(1)]))
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
