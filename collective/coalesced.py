"""all_reduce_coalesced: one collective over many arrays (a model's gradients, say).

The arrays are packed into one flat bucket per dtype (one copy in), each bucket is all-reduced as
one array, and the results come back as views of the reduced bucket in the caller's shapes (or
copied into ``out``). Every bucket's call carries the list of every array's shape and dtype, so a
peer whose list differs is a MismatchError on every peer before any data moves. One dtype (the
usual case) is one rendezvous and one schedule, whatever the number of arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from collective.algorithms.ops import Array, array_module
from collective.calls import Coalesced
from collective.pool import pool
from collective.tensors import native

__all__ = ["coalesced_all_reduce"]


def coalesced_all_reduce(
    xs: Sequence[Array], op: Any, out: Sequence[Array] | None, execute: Callable[[Coalesced], Array]
) -> list[Array]:
    """Reduce every array of ``xs``; ``execute`` runs one bucket's call and returns its flat result.

    A list that cannot be used (empty, not arrays, ``out`` of another length) still takes one step,
    whose call carries the problem: every peer gets the InvalidArgumentError and stays in step.
    """
    converted = [native(x) for x in xs] if isinstance(xs, list | tuple) else []
    arrays = [array for array, _ in converted]
    problem = _problem(xs, arrays, out)
    if problem is not None:
        refused = Coalesced(np.zeros(0, np.float32), op, ())
        refused.refuse(problem)
        execute(refused)  # raises the problem on every peer
        raise AssertionError("unreachable: a refused call raises")
    parts = tuple([(tuple(x.shape), _name(x.dtype)) for x in arrays])
    by_dtype: dict[Any, list[int]] = {}
    for index, x in enumerate(arrays):
        by_dtype.setdefault(x.dtype, []).append(index)
    results: list[Array] = [None] * len(arrays)
    for indices in by_dtype.values():
        reduced = execute(_bucket([arrays[i] for i in indices], op, parts))
        offset = 0
        for i in indices:
            shape = arrays[i].shape
            size = arrays[i].size
            view = reduced[offset : offset + size].reshape(shape)
            offset += size
            if out is not None:
                native(out[i])[0][...] = view
                results[i] = out[i]
            else:
                results[i] = converted[i][1](view)
    return results


def _bucket(arrays: list[Array], op: Any, parts: Any) -> Coalesced:
    """The call reducing ``arrays`` (one dtype) as one flat bucket, in place.

    A numpy bucket comes from the result pool (collective.pool): a fresh one per call would pay
    its page faults every time. The results are views of the bucket, reduced in place.
    """
    pieces = [array.reshape(-1) for array in arrays]
    if type(arrays[0]) is np.ndarray:
        bucket = pool.empty((sum([piece.size for piece in pieces]),), arrays[0].dtype)
        np.concatenate(pieces, out=bucket)
    else:
        xp = array_module(arrays[0])
        bucket = xp.concatenate(pieces) if len(pieces) > 1 else xp.ascontiguousarray(pieces[0]).copy()
    return Coalesced(bucket, op, parts, out=bucket)


@functools.cache
def _name(dtype: Any) -> str:
    """``str(dtype)``, once per dtype (numpy 2 builds the name anew every time: ~5 us)."""
    return str(dtype)


def _problem(xs: Any, arrays: list[Any], out: Any) -> str | None:
    if not isinstance(xs, list | tuple) or not xs:
        return "all_reduce_coalesced takes a non-empty list of arrays"
    if not all(hasattr(array, "dtype") and hasattr(array, "shape") for array in arrays):
        return "every item of the list must be an array"
    if out is not None and (
        not isinstance(out, list | tuple) or len(out) != len(xs) or any(o is None for o in out)
    ):
        return f"out must be a list of {len(xs)} arrays, one per input"
    return None
