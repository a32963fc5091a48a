"""The uneven collectives: every rank's block has its own number of rows.

* ``AllGatherV``: each rank passes its own rows (x.shape[0] may differ, the rest of the shape
  and the dtype agree); every rank gets every rank's array, a list in rank order.
* ``ReduceScatterV``: every rank passes the same ``sizes`` (one number of rows per rank, summing
  to x.shape[0]); rank i gets op over every rank's rows of block i (sizes[i] rows).
* ``AllToAllV``: rank r passes ``send_sizes`` (rows of x for each rank, in rank order); rank j
  gets, as a list in source rank order, the rows every rank sent it.

What a rank states only for itself (its rows, its send sizes) travels in its signature's
``table`` and is agreed like any field: the agreed call holds every rank's, so every rank knows
every block's size before any data moves. ``out=`` is one array of all the rows a rank gets; its
number of rows is checked once the call is agreed, the same way on every rank.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from collective.algorithms.ops import Array, ReduceOp
from collective.arrays import Device, check_array, check_out, integer
from collective.calls.base import Call
from collective.calls.movement import Exchange, Movement, ReducedBlocks, Stack
from collective.calls.signature import Rules, Signature
from collective.errors import InvalidArgumentError

__all__ = ["AllGatherV", "AllToAllV", "ReduceScatterV"]


def _sizes(value: Any, size: int, name: str) -> tuple[tuple[int, ...] | None, str | None]:
    """``value`` as one number of rows >= 0 per rank of a group of ``size`` (or the problem)."""
    try:
        sizes = tuple(map(integer, value))
    except TypeError:
        return None, f"{name} must be a list of {size} row counts, one per rank, got {value!r}"
    if len(sizes) != size or any(s is None or s < 0 for s in sizes):
        return None, f"{name} must be a list of {size} integers >= 0, one per rank, got {value!r}"
    return sizes, None  # type: ignore[return-value]


def _listed(value: Any) -> Any:
    """A list of sizes read once (a generator, an array), or ``value`` itself when it is no sequence."""
    try:
        return tuple(value)
    except TypeError:
        return value


def _split(whole: Any, rows: list[int]) -> list[Any]:
    """Views of ``whole`` (its rows in blocks of ``rows``), in order."""
    starts = list(itertools.accumulate(rows, initial=0))
    return [whole[starts[k] : starts[k + 1]] for k in range(len(rows))]


class _Uneven(Call):
    """A call whose ``out`` holds a number of rows known once the call is agreed."""

    __slots__ = ()
    reduces = False

    def check_rows(self, device: Device) -> str | None:
        """x has rows, and ``out`` (if given) matches it but for its number of rows."""
        problem = check_array(self.x, device, self.op if self.reduces else None)
        if problem is None and self.x.ndim == 0:
            return f"{self.kind} needs an array of at least one dimension (its rows), got a 0-d array"
        if problem is None and self.out is not None:
            rows = self.out.shape[0] if self.out.ndim else -1
            source = None if self.out_apart else self.x
            problem = check_out(self.out, device, (rows, *self.x.shape[1:]), self.x.dtype, source)
        return problem

    def out_rows(self) -> int:
        return -1 if self.out is None else int(self.out.shape[0])

    def finish(self, result: Array | None, agreed: Signature, size: int) -> Any:
        whole = super().finish(result, agreed, size)
        return None if whole is None else _split(whole, self.blocks_of(agreed, size))

    def blocks_of(self, agreed: Signature, size: int) -> list[int]:
        """The rows of each piece of this rank's result, in rank order."""
        raise NotImplementedError


class _Gathered(_Uneven):
    """An uneven call whose every rank states its own sizes (its ``table`` row: what it sends, then
    its ``out``'s rows and the rows it expects from each rank, ``recv_sizes``, if it passed them);
    once agreed, every rank checks every rank's ``out`` and expectations the same way."""

    __slots__ = ("receives_given",)
    rules = Rules(("shape", "dtype"), gathered=True)

    def __init__(self, x: Any = None, out: Any = None, recv_sizes: Any = None) -> None:
        super().__init__(x, out=out)
        self.receives_given = None if recv_sizes is None else _listed(recv_sizes)

    def expected(self, size: int) -> tuple[tuple[int, ...], str | None]:
        """The rows this rank expects from each rank (empty: it did not say), or the problem."""
        if self.receives_given is None:
            return (), None
        sizes, problem = _sizes(self.receives_given, size, "recv_sizes")
        return sizes or (), problem

    def stated(self, sends: tuple[int, ...], size: int) -> Signature:
        """This rank's call: the trailing shape and dtype, and its table row."""
        row = (*sends, self.out_rows(), *self.expected(size)[0])
        return Signature(
            self.kind, None, None, tuple(self.x.shape[1:]), self.x.dtype, table=((self.rank, row),)
        )

    def sent(self, rows: list[tuple[int, ...]], size: int) -> list[list[int]]:
        """Rows rank k sends rank j (``[k][j]``), from every rank's table row."""
        raise NotImplementedError

    def checked(self, agreed: Signature, size: int) -> list[list[int]]:
        """``sent`` of the agreed call, once every rank's ``out`` and ``recv_sizes`` agree with it
        (InvalidArgumentError, the same on every rank, otherwise)."""
        rows = agreed.rows(size)
        sent = self.sent(rows, size)
        wrong = []
        for rank, row in enumerate(rows):
            got = [sent[k][rank] for k in range(size)]
            out_rows, expectation = row[self.out_at(size)], row[self.out_at(size) + 1 :]
            if out_rows not in (-1, sum(got)):
                wrong.append(f"rank {rank}'s out has {out_rows} rows, its result {sum(got)}")
            wrong += [
                f"rank {rank} expects {want} rows from rank {k}, which sends {got[k]}"
                for k, want in enumerate(expectation)
                if want != got[k]
            ]
        if wrong:
            raise InvalidArgumentError(f"{self.kind}: " + "; ".join(wrong))
        return sent

    def out_at(self, size: int) -> int:
        """Where a table row holds the rank's ``out`` rows (after what it sends)."""
        raise NotImplementedError


class AllGatherV(_Gathered):
    """Every rank's x on every rank, a list in rank order (rows may differ between ranks).
    ``recv_sizes`` (optional): the rows a rank expects from each rank, checked before data moves."""

    __slots__ = ()
    kind = "all_gather_v"
    strategy_kind = "all_gather"

    @classmethod
    def refused(cls, problem: str, root: Any = None, op: Any = "sum") -> Call:
        call = cls(None)
        call.refuse(problem)
        return call

    def check(self, device: Device, size: int, rank: int) -> str | None:
        return self.check_rows(device) or self.expected(size)[1]

    def describe(self, op: ReduceOp | None, problem: str | None) -> Signature:
        if problem is not None:
            return Signature(self.kind, error=problem)
        return self.stated((int(self.x.shape[0]),), len(self.receives_given or ()))

    def out_at(self, size: int) -> int:
        return 1

    def sent(self, rows: list[tuple[int, ...]], size: int) -> list[list[int]]:
        return [[row[0] if row else 0] * size for row in rows]

    def blocks_of(self, agreed: Signature, size: int) -> list[int]:
        return [row[0] for row in agreed.rows(size)]

    def result_shape(self, agreed: Signature, size: int, rank: int) -> tuple[int, ...] | None:
        assert agreed.shape is not None
        return (sum(self.blocks_of(agreed, size)), *agreed.shape)

    def moves(self, agreed: Signature, size: int) -> Movement:
        """(A node's locally agreed call knows its own ranks' rows only: enough for its contribution.)"""
        complete = len(agreed.table) == size
        sent = self.checked(agreed, size) if complete else self.sent(agreed.rows(size), size)
        width = math.prod(agreed.shape or ())
        return Stack(size, agreed.dtype, [row[0] * width for row in sent])


class ReduceScatterV(_Uneven):
    """Rank i gets op over every rank's rows of block i (``sizes[i]`` rows; the same ``sizes``
    on every rank, summing to x.shape[0])."""

    __slots__ = ("sizes_given",)
    kind = "reduce_scatter_v"
    strategy_kind = "reduce_scatter"
    rules = Rules(("op", "shape", "dtype", "sizes"))
    reduces = True

    def __init__(self, x: Any = None, sizes: Any = (), op: Any = "sum", out: Any = None) -> None:
        super().__init__(x, op, out=out)
        self.sizes_given = _listed(sizes)

    @classmethod
    def refused(cls, problem: str, root: Any = None, op: Any = "sum") -> Call:
        call = cls(None, (), op)
        call.refuse(problem)
        return call

    def _parsed(self, size: int) -> tuple[tuple[int, ...] | None, str | None]:
        sizes, problem = _sizes(self.sizes_given, size, "sizes")
        if sizes is not None and self.x is not None and self.x.ndim and sum(sizes) != self.x.shape[0]:
            return None, f"sizes {list(sizes)} sum to {sum(sizes)} rows; x has {self.x.shape[0]}"
        return sizes, problem

    def check(self, device: Device, size: int, rank: int) -> str | None:
        problem = self.check_rows(device)
        sizes, wrong = self._parsed(size)
        problem = problem or wrong
        if (
            problem is None
            and sizes is not None
            and self.out is not None
            and self.out.shape[0] != sizes[rank]
        ):
            problem = f"out has {self.out.shape[0]} rows; rank {rank} gets sizes[{rank}] = {sizes[rank]}"
        return problem

    def describe(self, op: ReduceOp | None, problem: str | None) -> Signature:
        if problem is not None:
            return Signature(self.kind, op, error=problem)
        sizes, _ = self._parsed(len(self.sizes_given))
        assert sizes is not None
        return Signature(self.kind, op, None, tuple(self.x.shape), self.x.dtype, sizes=sizes)

    def result_shape(self, agreed: Signature, size: int, rank: int) -> tuple[int, ...] | None:
        assert agreed.shape is not None
        return (agreed.sizes[rank], *agreed.shape[1:])

    def finish(self, result: Array | None, agreed: Signature, size: int) -> Any:
        return Call.finish(self, result, agreed, size)

    def moves(self, agreed: Signature, size: int) -> Movement:
        assert agreed.op is not None and agreed.shape is not None
        width = math.prod(agreed.shape[1:])
        return ReducedBlocks(size, agreed.dtype, agreed.op, [s * width for s in agreed.sizes])


class AllToAllV(_Gathered):
    """Rank r sends ``send_sizes[j]`` rows of x to rank j (in rank order); rank j gets a list, in
    source rank order, of the rows each rank sent it. ``recv_sizes`` (optional): the rows a rank
    expects from each rank, checked against what they send before any data moves."""

    __slots__ = ("sends_given",)
    kind = "all_to_all_v"
    strategy_kind = "all_to_all"

    def __init__(self, x: Any = None, send_sizes: Any = (), out: Any = None, recv_sizes: Any = None) -> None:
        super().__init__(x, out=out, recv_sizes=recv_sizes)
        self.sends_given = _listed(send_sizes)

    @classmethod
    def refused(cls, problem: str, root: Any = None, op: Any = "sum") -> Call:
        call = cls(None, ())
        call.refuse(problem)
        return call

    def _parsed(self, size: int) -> tuple[tuple[int, ...] | None, str | None]:
        sizes, problem = _sizes(self.sends_given, size, "send_sizes")
        if sizes is not None and self.x is not None and self.x.ndim and sum(sizes) != self.x.shape[0]:
            return None, f"send_sizes {list(sizes)} sum to {sum(sizes)} rows; x has {self.x.shape[0]}"
        return sizes, problem

    def check(self, device: Device, size: int, rank: int) -> str | None:
        return self.check_rows(device) or self._parsed(size)[1] or self.expected(size)[1]

    def describe(self, op: ReduceOp | None, problem: str | None) -> Signature:
        if problem is not None:
            return Signature(self.kind, error=problem)
        size = len(self.sends_given)
        sizes, _ = self._parsed(size)
        assert sizes is not None
        return self.stated(sizes, size)

    def out_at(self, size: int) -> int:
        return size

    def sent(self, rows: list[tuple[int, ...]], size: int) -> list[list[int]]:
        return [list(row[:size]) if row else [] for row in rows]

    def blocks_of(self, agreed: Signature, size: int) -> list[int]:
        return [row[self.rank] for row in agreed.rows(size)]

    def result_shape(self, agreed: Signature, size: int, rank: int) -> tuple[int, ...] | None:
        assert agreed.shape is not None
        return (sum(row[rank] for row in agreed.rows(size)), *agreed.shape)

    def moves(self, agreed: Signature, size: int) -> Movement:
        """(A node's locally agreed call knows its own ranks' rows only: enough for its contribution.)"""
        complete = len(agreed.table) == size
        sent = self.checked(agreed, size) if complete else self.sent(agreed.rows(size), size)
        width = math.prod(agreed.shape or ())
        return Exchange(size, agreed.dtype, [[r * width for r in row] for row in sent])
