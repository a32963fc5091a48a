"""all_reduce_coalesced: one collective over many arrays (a model's gradients, say).

The arrays are packed into one flat bucket per dtype (one copy in), each bucket is all-reduced as
one array, and the results come back as views of the reduced bucket in the caller's shapes (or
copied into ``out``). Every bucket's call carries the list of every array's shape and dtype, so a
peer whose list differs is a MismatchError on every peer before any data moves. One dtype (the
usual case) is one rendezvous and one schedule, whatever the number of arrays.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

from collective.algorithms.ops import Array, array_module
from collective.arrays import dtype_problem
from collective.calls.base import parse_op
from collective.calls.collectives import Coalesced
from collective.errors import InvalidArgumentError
from collective.pool import pool
from collective.tensors import native, writable

__all__ = ["MAX_LAYOUTS", "coalesced_all_reduce", "remembered_layouts"]

_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")


def coalesced_all_reduce(
    xs: Sequence[Array], op: Any, out: Sequence[Array] | None, execute: Callable[[Coalesced], Array]
) -> list[Array]:
    """Reduce every array of ``xs``; ``execute`` runs one bucket's call and returns its flat result.

    A list that cannot be used (empty, not arrays, ``out`` of another length) still takes one step,
    whose call carries the problem: every peer gets the InvalidArgumentError and stays in step.
    """
    if not isinstance(xs, list | tuple):
        xs = ()
    elif out is None and set(map(type, xs)) == {np.ndarray}:  # the usual case: numpy arrays, results new
        kinds = set(map(_DTYPE, xs))
        if len(kinds) == 1:  # one dtype: one bucket, one call, and the views of its result
            layout = _layout(tuple(map(_SHAPE, xs)), next(iter(kinds)))
            return layout.views(execute(_bucket(list(xs), op, layout.parts, layout.total)))
    problem = None
    arrays: list[Any] = []
    backs: list[Any] | None = None
    outs: list[Any] | None = None
    try:
        if set(map(type, xs)) == {np.ndarray}:  # the usual case, without a frame per array
            arrays = list(xs)
        else:
            converted = [native(x) for x in xs]
            arrays, backs = [array for array, _ in converted], [back for _, back in converted]
    except InvalidArgumentError as exc:  # (an unreadable tensor): still a step, failed on every peer
        problem = f"the list: {exc}"
    if isinstance(out, list | tuple):
        outs = []
        for index, item in enumerate(out):
            try:
                outs.append(writable(item))
            except InvalidArgumentError as exc:
                problem = problem or f"out[{index}]: {exc}"
    if problem is None and (backs is not None or out is not None or not xs):
        problem = _problem(xs, arrays, out)
    if problem is not None:
        _refuse(problem, op, execute)
    dtypes = list(map(_DTYPE, arrays))
    shapes = list(map(_SHAPE, arrays))
    kinds = set(dtypes)
    for dtype in kinds - _NAMES.keys():
        _NAMES[dtype] = str(dtype)  # numpy 2 builds a dtype's name anew every time: ~5 us
    parts = tuple(zip(shapes, map(_NAMES.__getitem__, dtypes), strict=True))
    if len(kinds) == 1:
        by_dtype: list[Sequence[int]] = [range(len(arrays))]
    else:
        groups: dict[Any, list[int]] = {}
        for index, dtype in enumerate(dtypes):
            groups.setdefault(dtype, []).append(index)
        by_dtype = list(groups.values())
    results: list[Array] = [None] * len(arrays)
    checks = None if outs is None else list(zip(outs, arrays, strict=True))  # all with the first bucket
    parsed, _ = parse_op(op)  # (an unknown op fails the first bucket's call anyway)
    for dtype in kinds if parsed is not None and len(kinds) > 1 else ():  # every bucket's op, checked
        if (wrong := dtype_problem(np.dtype(dtype), parsed)) is not None:  # before any bucket's data moves
            _refuse(f"the list: {wrong}", op, execute)
    for indices in by_dtype:
        its = _layout(tuple(shapes[i] for i in indices), dtypes[indices[0]])  # (its views, its size)
        reduced = execute(_bucket([arrays[i] for i in indices], op, parts, its.total, checks))
        checks = None
        for i, view in zip(indices, its.views(reduced), strict=True):
            if outs is not None:
                outs[i][...] = view
                results[i] = out[i]  # type: ignore[index]
            else:
                results[i] = view if backs is None else backs[i](view)
    return results


def _refuse(problem: str, op: Any, execute: Callable[[Coalesced], Array]) -> NoReturn:
    """One step whose call carries ``problem``: every peer gets the InvalidArgumentError, in step."""
    execute(Coalesced.refused(problem, op=op))  # raises the problem on every peer
    raise AssertionError("unreachable: a refused call raises")


def _bucket(
    arrays: list[Array], op: Any, parts: Any, size: int, outs: list[tuple[Any, Any]] | None = None
) -> Coalesced:
    """The call reducing ``arrays`` (one dtype, ``size`` elements in all) as one flat bucket, in place.
    ``outs`` (the first bucket's call): every (out, input) of the list, checked with the call, so a
    bad one fails every peer before any data moves.

    A numpy bucket comes from the result pool (collective.pool): a fresh one per call would pay
    its page faults every time. The results are views of the bucket. It is packed only when an
    executor reads the call's ``source()``; the shared-memory executor reads the arrays themselves
    (``unpacked()``) and writes the reduction straight into the bucket, one copy fewer.
    """
    if type(arrays[0]) is np.ndarray:  # packed (if ever) by one np.concatenate(axis=None)
        bucket = pool.empty((size,), arrays[0].dtype)
        return Coalesced(bucket, op, parts, out=bucket, pieces=arrays, outs=outs)
    pieces = [array.reshape(-1) for array in arrays]
    xp = array_module(arrays[0])  # CuPy: packed on the device at once
    bucket = xp.concatenate(pieces) if len(pieces) > 1 else xp.ascontiguousarray(pieces[0]).copy()
    return Coalesced(bucket, op, parts, out=bucket, outs=outs)


_NAMES: dict[Any, str] = {}  # dtype -> its name, as parts carry it


class _Layout:
    """What one list's shapes and dtype make of it, worked out once per distinct list: its parts
    (as every bucket's call carries them), its element count, and where each array's view lies
    in the reduced bucket (a slice, and the shape to give it, None for 1-D)."""

    __slots__ = ("cuts", "dtype", "parts", "total")

    def __init__(self, shapes: tuple[tuple[int, ...], ...], dtype: Any) -> None:
        self.dtype = dtype
        name = _NAMES.setdefault(dtype, str(dtype))  # numpy 2 builds a dtype's name anew every time
        self.parts = tuple((shape, name) for shape in shapes)
        self.cuts: list[tuple[slice, tuple[int, ...] | None]] = []
        offset = 0
        for shape in shapes:
            end = offset + math.prod(shape)
            self.cuts.append((slice(offset, end), None if len(shape) == 1 else shape))
            offset = end
        self.total = offset

    def views(self, flat: Array) -> list[Array]:
        """The arrays of the list as views of ``flat`` (a bucket of ``total`` elements)."""
        return [flat[cut] if shape is None else flat[cut].reshape(shape) for cut, shape in self.cuts]


_LAYOUTS: dict[tuple[Any, Any], _Layout] = {}
MAX_LAYOUTS = 64  # distinct lists remembered (a training loop has one or a few)


def remembered_layouts() -> int:
    """How many distinct lists (their shapes and dtype) are remembered now: at most MAX_LAYOUTS
    (for tests of state growth)."""
    return len(_LAYOUTS)


def _layout(shapes: tuple[tuple[int, ...], ...], dtype: Any) -> _Layout:
    found = _LAYOUTS.get((shapes, dtype))
    if found is None:
        if len(_LAYOUTS) >= MAX_LAYOUTS:
            _LAYOUTS.clear()
        found = _LAYOUTS[(shapes, dtype)] = _Layout(shapes, dtype)
    return found


def _problem(xs: Any, arrays: list[Any], out: Any) -> str | None:
    if not isinstance(xs, list | tuple) or not xs:
        return "all_reduce_coalesced takes a non-empty list of arrays"
    if not all(hasattr(array, "dtype") and hasattr(array, "shape") for array in arrays):
        return "every item of the list must be an array"
    if len({type(array) is np.ndarray for array in arrays}) > 1:
        return "the arrays of one list must all be in host memory (numpy, torch CPU, ...) or all CuPy arrays"
    if out is not None and (
        not isinstance(out, list | tuple) or len(out) != len(xs) or any(o is None for o in out)
    ):
        return f"out must be a list of {len(xs)} arrays, one per input"
    return None
