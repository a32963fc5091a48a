"""Reduce operations and the array helpers every algorithm shares.

Algorithms see flat (1-D, C-contiguous) arrays of numpy or CuPy. ``combine`` applies a
reduce op elementwise with ``out=`` so no temporary is allocated; it dispatches on the
array module of its inputs, which is how CuPy arrays take the same code path as numpy ones.
"""

from __future__ import annotations

import enum
import types
from typing import Any

import numpy as np

from collective.errors import InvalidArgumentError

Array = Any  # numpy.ndarray or cupy.ndarray: both expose the array API used here

__all__ = [
    "BITWISE",
    "NUMPY_UFUNCS",
    "Array",
    "ReduceOp",
    "array_module",
    "block",
    "chunk_bounds",
    "combine",
    "copy_into",
    "empty_blocks",
    "transpose_blocks",
]


class ReduceOp(enum.Enum):
    """How the arrays of the peers are combined. MEAN is SUM divided by the job's peer count."""

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
    BAND = "band"  # bitwise and, or, xor: integer dtypes only
    BOR = "bor"
    BXOR = "bxor"

    # Members are singletons compared by identity: hash them by identity too, in C (Enum's own
    # __hash__ is Python code, and ops are dict keys on every call: ufunc tables, signatures).
    __hash__ = object.__hash__

    @classmethod
    def parse(cls, value: ReduceOp | str) -> ReduceOp:
        """``ReduceOp.SUM`` or ``"sum"`` (any case) -> ``ReduceOp.SUM``; raises InvalidArgumentError."""
        if isinstance(value, ReduceOp):
            return value
        if isinstance(value, str):
            op = _BY_NAME.get(value.strip().lower())
            if op is not None:
                return op
        allowed = ", ".join(op.value for op in cls)
        raise InvalidArgumentError(f"unknown reduce op {value!r}: expected one of {allowed}")

    @property
    def ufunc_name(self) -> str:
        """The name of the elementwise ufunc (numpy and CuPy share them) that combines two arrays."""
        return _UFUNC_NAMES[self]


_BY_NAME = {op.value: op for op in ReduceOp}

_UFUNC_NAMES = {
    ReduceOp.SUM: "add",
    ReduceOp.MEAN: "add",
    ReduceOp.MAX: "maximum",
    ReduceOp.MIN: "minimum",
    ReduceOp.PROD: "multiply",
    ReduceOp.BAND: "bitwise_and",
    ReduceOp.BOR: "bitwise_or",
    ReduceOp.BXOR: "bitwise_xor",
}
BITWISE = frozenset([ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR])


NUMPY_UFUNCS = {op: getattr(np, name) for op, name in _UFUNC_NAMES.items()}


def array_module(array: Array) -> types.ModuleType:
    """numpy for numpy arrays, cupy for CuPy arrays (without importing CuPy for numpy input)."""
    if isinstance(array, np.ndarray):
        return np
    module_name = type(array).__module__.split(".")[0]
    if module_name == "cupy":
        import cupy

        return cupy  # type: ignore[no-any-return]
    raise InvalidArgumentError(f"expected a numpy or CuPy array, got {type(array).__name__}")


def combine(op: ReduceOp, a: Array, b: Array, out: Array) -> None:
    """out = op(a, b) elementwise; ``out`` may be ``a`` or ``b``. Commutative, so bit-identical either way."""
    if type(out) is np.ndarray:
        NUMPY_UFUNCS[op](a, b, out=out)
        return
    ufunc = getattr(array_module(out), op.ufunc_name)
    ufunc(a, b, out=out)


def chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(length)`` into ``parts`` contiguous chunks whose sizes differ by at most one.

    >>> chunk_bounds(5, 4)
    [(0, 1), (1, 2), (2, 3), (3, 5)]
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    return [(j * length // parts, (j + 1) * length // parts) for j in range(parts)]


def copy_into(out: Array, src: Array) -> None:
    """out[...] = src (same dtype, same shape), skipped when they are the same buffer (in place)."""
    if out is src:
        return
    if type(out) is np.ndarray:
        out[...] = src  # np.copyto is a Python-level wrapper; the same-dtype copy is the same
        return
    array_module(out).copyto(out, src)


def block(index: int, length: int) -> slice:
    """Block ``index`` of an array cut into blocks of ``length`` elements (blocks ordered by peer).

    >>> block(2, 3)
    slice(6, 9, None)
    """
    return slice(index * length, (index + 1) * length)


def empty_blocks(like: Array, count: int, length: int) -> Array:
    """A new flat array of ``count`` blocks of ``length`` elements, of the type and dtype of ``like``."""
    return array_module(like).empty(count * length, dtype=like.dtype)


def transpose_blocks(rows: Array, out: Array, peers: int) -> None:
    """``out`` block (j, i) = ``rows`` block (i, j), both ``peers`` x ``peers`` blocks in row order.

    Row i of ``rows`` is what peer i sends to every peer; row j of ``out`` is what peer j receives.
    """
    length = rows.size // (peers * peers)
    grid = (peers, peers, length)
    array_module(out).copyto(out.reshape(grid), rows.reshape(grid).transpose(1, 0, 2))
