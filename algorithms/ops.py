"""Reduce operations and the array helpers every algorithm shares.

Algorithms see flat (1-D, C-contiguous) arrays of numpy or CuPy. ``combine`` applies a
reduce op elementwise with ``out=`` so no temporary is allocated; it dispatches on the
array module of its inputs, which is how CuPy arrays take the same code path as numpy ones.

The block collectives lay one block per peer end to end, ordered by peer; ``Blocks`` says where
each lies (its sizes may differ: all_gather_v, reduce_scatter_v, nodes of different sizes), and
an all_to_all's ``Counts`` matrix says how many elements each peer sends to each.
"""

from __future__ import annotations

import enum
import functools
import itertools
import operator
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from collective.errors import InvalidArgumentError

Array = Any  # numpy.ndarray or cupy.ndarray: both expose the array API used here

__all__ = [
    "BITWISE",
    "HALF_KERNELS_FROM",
    "NUMPY_UFUNCS",
    "Array",
    "Blocks",
    "Counts",
    "ReduceOp",
    "array_module",
    "block",
    "chunk_bounds",
    "column_blocks",
    "combine",
    "copy_into",
    "count_matrix",
    "elementwise",
    "empty",
    "received_blocks",
    "row_blocks",
    "sent_blocks",
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


HALF_KERNELS_FROM = 1 << 14  # elements: from this size a float16 sum or product runs on torch's kernel
_TORCH_KERNELS = {ReduceOp.SUM: "add", ReduceOp.MEAN: "add", ReduceOp.PROD: "mul"}


def elementwise(op: ReduceOp, like: np.ndarray) -> Callable[..., Any]:
    """What computes ``op`` elementwise on numpy arrays like ``like``, called ``(a, b, out)``
    (``out`` by position or by keyword).

    numpy's ufunc, but for large float16 sums and products when torch is already imported (the
    torch backend's processes, any torch user's): numpy works on half precision one element at a
    time (1.3M float16 additions: 4.9 ms here), torch's kernels are vectorised (0.14 ms), and both
    give each element the exact result rounded once to float16, NaN's bits included, so the bits
    are the same (tests/test_algorithms.py compares them, specials included). Not bfloat16 nor
    max and min: torch's vectorised kernels give their NaNs other bits than numpy's.
    """
    if like.size >= HALF_KERNELS_FROM and like.dtype == _FLOAT16 and op in _TORCH_KERNELS:
        torch = sys.modules.get("torch")
        if torch is not None:
            kernel = getattr(torch, _TORCH_KERNELS[op])
            return functools.partial(_torch_kernel, kernel, NUMPY_UFUNCS[op], torch)
    ufunc: Callable[..., Any] = NUMPY_UFUNCS[op]
    return ufunc


_FLOAT16 = np.dtype(np.float16)  # (native byte order: torch reads only that)


def _torch_kernel(kernel: Any, ufunc: Any, torch: Any, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    if not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous):
        ufunc(a, b, out=out)
        return
    with warnings.catch_warnings():  # (a read-only array, e.g. another process's shared memory: only read)
        warnings.simplefilter("ignore", UserWarning)
        kernel(torch.from_numpy(a), torch.from_numpy(b), out=torch.from_numpy(out))


def combine(op: ReduceOp, a: Array, b: Array, out: Array) -> None:
    """out = op(a, b) elementwise; ``out`` may be ``a`` or ``b``. Commutative, so bit-identical either way."""
    if type(out) is np.ndarray:
        elementwise(op, out)(a, b, out=out)
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


def empty(like: Array, size: int) -> Array:
    """A new flat array of ``size`` elements, of the type (numpy or CuPy) and dtype of ``like``."""
    return array_module(like).empty(size, dtype=like.dtype)


class Blocks:
    """Where each peer's block lies in a flat array of blocks ordered by peer (sizes may differ).

    >>> blocks = Blocks([2, 0, 3])
    >>> blocks.of(0), blocks.of(1), blocks.of(2)
    (slice(0, 2, None), slice(2, 2, None), slice(2, 5, None))
    >>> blocks.span(1, 3)  # peers 1 and 2, as range(1, 3)
    slice(2, 5, None)
    >>> blocks.total, len(blocks), blocks.sizes
    (5, 3, (2, 0, 3))
    >>> blocks.select([2, 0])  # those peers' blocks, packed in that order
    Blocks((3, 2))
    >>> Blocks.equal(3, 4) == Blocks([4, 4, 4])
    True
    >>> Blocks([1, -1])
    Traceback (most recent call last):
    ...
    collective.errors.InvalidArgumentError: block sizes must be integers >= 0, got [1, -1]

    Raises InvalidArgumentError for a size that is not an integer >= 0.
    """

    __slots__ = ("_offsets", "sizes")

    sizes: tuple[int, ...]
    _offsets: tuple[int, ...]

    def __init__(self, sizes: Iterable[int]) -> None:
        try:
            given = list(sizes)
        except TypeError:
            raise InvalidArgumentError(f"block sizes must be integers >= 0, got {sizes!r}") from None
        try:
            checked = tuple(operator.index(size) for size in given)
        except TypeError:
            checked = ()  # reported below
        wrong = len(checked) != len(given) or any(isinstance(size, bool) for size in given)
        if wrong or min(checked, default=0) < 0:
            raise InvalidArgumentError(f"block sizes must be integers >= 0, got {given!r}")
        self.sizes = checked
        self._offsets = tuple(itertools.accumulate(checked, initial=0))

    @classmethod
    def equal(cls, count: int, length: int) -> Blocks:
        """``count`` blocks of ``length`` elements each (what ``block(i, length)`` cuts).

        >>> Blocks.equal(2, 3).of(1)
        slice(3, 6, None)
        """
        return cls((length,) * count)

    @property
    def total(self) -> int:
        """The number of elements of all the blocks together."""
        return self._offsets[-1]

    def of(self, index: int) -> slice:
        """The elements of block ``index``."""
        return slice(self._offsets[index], self._offsets[index + 1])

    def span(self, first: int, stop: int) -> slice:
        """The elements of the consecutive blocks ``first`` .. ``stop - 1`` together."""
        return slice(self._offsets[first], self._offsets[stop])

    def select(self, indices: Iterable[int]) -> Blocks:
        """The blocks ``indices`` (in that order) packed end to end: how a relay lays them out."""
        return Blocks(self.sizes[index] for index in indices)

    def __len__(self) -> int:
        return len(self.sizes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Blocks) and other.sizes == self.sizes

    def __hash__(self) -> int:
        return hash(self.sizes)

    def __repr__(self) -> str:
        return f"Blocks({self.sizes!r})"


Counts = Sequence[Sequence[int]]
"""An all_to_all's sizes: ``counts[r][j]`` elements go from peer r to peer j."""


def count_matrix(counts: Counts | None, peers: int, length: int) -> tuple[tuple[int, ...], ...]:
    """``counts`` as a tuple of tuples; None: every peer sends ``length // peers`` to every peer.

    >>> count_matrix(None, 2, 6)
    ((3, 3), (3, 3))
    """
    if counts is None:
        return ((length // peers,) * peers,) * peers
    return tuple(tuple(row) for row in counts)


def sent_blocks(counts: Counts, rank: int) -> Blocks:
    """Where the blocks peer ``rank`` sends lie in its ``src`` (block j goes to peer j)."""
    return Blocks(counts[rank])


def received_blocks(counts: Counts, rank: int) -> Blocks:
    """Where the blocks peer ``rank`` receives lie in its ``dst`` (block i came from peer i).

    >>> received_blocks([[1, 2], [3, 4]], 1)
    Blocks((2, 4))
    """
    return Blocks(row[rank] for row in counts)


def row_blocks(counts: Counts) -> Blocks:
    """Block i: peer i's whole ``src`` (row i), as a center gathers them before the transpose."""
    return Blocks(sum(row) for row in counts)


def column_blocks(counts: Counts) -> Blocks:
    """Block j: peer j's whole ``dst`` (column j), as a center scatters them after the transpose."""
    return Blocks(sum(row[column] for row in counts) for column in range(len(counts)))


def transpose_blocks(rows: Array, out: Array, peers: int, counts: Counts | None = None) -> None:
    """``out`` block (j, i) = ``rows`` block (i, j) for ``peers`` x ``peers`` blocks in row order.

    Row i of ``rows`` is what peer i sends to every peer; row j of ``out`` is what peer j receives.
    Block (i, j) has ``counts[i][j]`` elements (None: ``rows.size // peers**2`` each).

    >>> import numpy as np
    >>> out = np.empty(6, np.int64)
    >>> transpose_blocks(np.array([1, 2, 2, 3, 4, 4]), out, 2, [[1, 2], [1, 2]])
    >>> out.tolist()  # row 0: peer 0's block 0, then peer 1's; row 1: their blocks 1
    [1, 3, 2, 2, 4, 4]
    """
    if counts is not None and len({size for row in counts for size in row}) > 1:
        cells = Blocks(size for row in counts for size in row)  # (i, j) in row order
        columns = Blocks(counts[i][j] for j in range(peers) for i in range(peers))  # (j, i)
        for i, j in itertools.product(range(peers), repeat=2):
            copy_into(out[columns.of(j * peers + i)], rows[cells.of(i * peers + j)])
        return
    length = rows.size // (peers * peers)
    grid = (peers, peers, length)
    array_module(out).copyto(out.reshape(grid), rows.reshape(grid).transpose(1, 0, 2))
