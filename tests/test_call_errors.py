"""Mismatched calls and invalid arguments of the collective set on local peers (threads): the same
error on every peer, on every path (the ``rt`` fixture), and the job goes on.

A mismatch names both sides ("peers 0-1 passed (3,), peer 2 passed (4,)"); an invalid argument
names the peer that passed it. Arguments checked before the rendezvous still fail every peer and
keep their steps aligned. (Errors of async calls, send/recv, coalesced lists and groups are with
those: tests/test_async.py, test_p2p.py, test_coalesced.py, test_groups.py.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import collective as col
from tests.peers import run_failing_step, zeros

MISMATCHES: dict[str, tuple[Callable[[col.Runtime, int], Any], str]] = {
    "all_gather-shape": (
        lambda rt, p: rt.all_gather(p, zeros(4) if p == 2 else zeros(3)),
        "all_gather #0: peers disagree on shape: peers 0-1 passed (3,), peer 2 passed (4,)",
    ),
    "all_gather-dtype": (
        lambda rt, p: rt.all_gather(p, zeros(3, dtype=np.float32 if p == 0 else np.float64)),
        "dtype: peer 0 passed float32, peers 1-2 passed float64",
    ),
    "reduce_scatter-op": (
        lambda rt, p: rt.reduce_scatter(p, zeros(6), "max" if p == 1 else "sum"),
        "reduce_scatter #0: peers disagree on op: peers 0, 2 passed sum, peer 1 passed max",
    ),
    "reduce_scatter-shape": (
        lambda rt, p: rt.reduce_scatter(p, zeros(6, 2) if p == 0 else zeros(6)),
        "shape: peer 0 passed (6, 2), peers 1-2 passed (6,)",
    ),
    "all_to_all-shape": (
        lambda rt, p: rt.all_to_all(p, zeros(9) if p == 1 else zeros(6)),
        "all_to_all #0: peers disagree on shape: peers 0, 2 passed (6,), peer 1 passed (9,)",
    ),
    "all_to_all-dtype": (
        lambda rt, p: rt.all_to_all(p, zeros(6, dtype=np.int32 if p == 2 else np.int64)),
        "dtype: peers 0-1 passed int64, peer 2 passed int32",
    ),
    "gather-root": (
        lambda rt, p: rt.gather(p, zeros(2), root=2 if p == 0 else 1),
        "gather #0: peers disagree on root: peer 0 passed 2, peers 1-2 passed 1",
    ),
    "gather-shape": (
        lambda rt, p: rt.gather(p, zeros(2) if p else zeros(1), root=1),
        "shape: peer 0 passed (1,), peers 1-2 passed (2,)",
    ),
    "scatter-two-roots": (
        lambda rt, p: rt.scatter(p, zeros(3, 2) if p < 2 else None, root=p if p < 2 else 0),
        "scatter #0: peers disagree on root: peers 0, 2 passed 0, peer 1 passed 1",
    ),
    "scatter-out-shape": (
        lambda rt, p: rt.scatter(
            p, zeros(3, 2) if p == 0 else None, root=0, out=zeros(5) if p == 2 else None
        ),
        "scatter #0: peers disagree on shape: peer 0 passed (2,), peer 2 passed (5,)",
    ),
    "collective": (
        lambda rt, p: rt.all_to_all(p, zeros(3)) if p == 1 else rt.all_gather(p, zeros(3)),
        "peers called different collectives: peers 0, 2 passed all_gather, peer 1 passed all_to_all",
    ),
    "barrier-vs-all_reduce": (
        lambda rt, p: rt.barrier(p) if p == 0 else rt.all_reduce(p, zeros(2)),
        "peers called different collectives: peer 0 passed barrier, peers 1-2 passed all_reduce",
    ),
    "broadcast-no-source": (
        lambda rt, p: rt.broadcast(p, None),
        "broadcast #0: exactly one peer (the root) must pass an array; no peer passed one",
    ),
    "broadcast-two-sources": (
        lambda rt, p: rt.broadcast(p, zeros(2) if p != 0 else None),
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
        lambda rt, p: rt.reduce_scatter(p, zeros(7)),
        "reduce_scatter needs x.shape[0] divisible by the group size 3, got shape (7,)",
    ),
    "reduce_scatter-one-peer-indivisible": (
        lambda rt, p: rt.reduce_scatter(p, zeros(4, 2) if p == 1 else zeros(3, 2)),
        "peer 1: reduce_scatter needs x.shape[0] divisible by the group size 3, got shape (4, 2)",
    ),
    "reduce_scatter-0d": (
        lambda rt, p: rt.reduce_scatter(p, np.float64(1.0)),
        "reduce_scatter needs x.shape[0] divisible by the group size 3, got a 0-d array",
    ),
    "reduce_scatter-op": (
        lambda rt, p: rt.reduce_scatter(p, zeros(3), "avg" if p == 2 else "sum"),
        "peer 2: unknown reduce op 'avg'",
    ),
    "reduce_scatter-out-shape": (
        lambda rt, p: rt.reduce_scatter(p, zeros(6), out=zeros(6) if p == 0 else None),
        "peer 0: out has shape (6,) and dtype float64; the result has (2,)",
    ),
    "all_to_all-indivisible": (
        lambda rt, p: rt.all_to_all(p, zeros(5, 2) if p == 0 else zeros(6, 2)),
        "peer 0: all_to_all needs x.shape[0] divisible by the group size 3, got shape (5, 2)",
    ),
    "all_gather-out-shape": (
        lambda rt, p: rt.all_gather(p, zeros(2), out=zeros(2, 2) if p == 1 else None),
        "peer 1: out has shape (2, 2) and dtype float64; the result has (3, 2)",
    ),
    "all_gather-not-an-array": (
        lambda rt, p: rt.all_gather(p, [1.0] if p == 2 else zeros(1)),
        "peer 2: x must be an array (numpy, CuPy, torch, JAX, or anything with __array_interface__ or "
        "__dlpack__), got list",
    ),
    "gather-root-outside": (
        lambda rt, p: rt.gather(p, zeros(2), root=3),
        "root 3 is not a peer of the group (peers 0-2)",
    ),
    "scatter-non-root-passes-an-array": (
        lambda rt, p: rt.scatter(p, zeros(3, 2) if p in (0, 2) else None, root=0),
        "peer 2: only the root (peer 0) passes an array to scatter; pass None",
    ),
    "scatter-root-rows-not-group-size": (
        lambda rt, p: rt.scatter(p, zeros(4, 2) if p == 1 else None, root=1),
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
        lambda rt, p: rt.all_gather(p, zeros(2), timeout=-1),
        lambda rt, p: rt.all_gather(p, zeros(2)),
    ),
    "coalesced-empty": (
        lambda rt, p: rt.all_reduce_coalesced(p, []),
        lambda rt, p: rt.all_reduce_coalesced(p, [zeros(2), zeros(3)]),
    ),
    "coalesced-mixed-devices": (
        lambda rt, p: rt.all_reduce_coalesced(p, [zeros(2), _FakeCupyArray(3)]),
        lambda rt, p: rt.all_reduce_coalesced(p, [zeros(2), zeros(3)]),
    ),
    "coalesced-out-length": (
        lambda rt, p: rt.all_reduce_coalesced(p, [zeros(2), zeros(3)], out=[zeros(2)]),
        lambda rt, p: rt.all_reduce_coalesced(p, [zeros(2), zeros(3)]),
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
