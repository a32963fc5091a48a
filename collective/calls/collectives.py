"""The collectives of even blocks: one class each, with its checks, agreement rules and movement.

What every call does and when is told in collective.calls.base (the base class); the uneven ones
are in collective.calls.uneven.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from collective.algorithms.ops import Array, ReduceOp
from collective.arrays import Device, check_array, check_out
from collective.calls.base import Call
from collective.calls.movement import Copy, Exchange, Movement, Nothing, ReducedBlocks, Reduction, Rows, Stack
from collective.calls.signature import Rules, Signature

__all__ = [
    "AllGather",
    "AllReduce",
    "AllToAll",
    "Barrier",
    "Broadcast",
    "Coalesced",
    "Gather",
    "Reduce",
    "ReduceScatter",
    "Scatter",
]


def _elements(shape: tuple[int, ...] | None) -> int:
    return math.prod(shape) if shape is not None else 0


class AllReduce(Call):
    __slots__ = ()
    kind = strategy_kind = "all_reduce"

    def moves(self, agreed: Signature, size: int) -> Movement:
        assert agreed.op is not None
        return Reduction(size, agreed.dtype, agreed.op, _elements(agreed.shape))


class Reduce(AllReduce):
    __slots__ = ()
    kind = strategy_kind = "reduce"
    rules = Rules(("op", "root", "shape", "dtype"))
    rooted = True

    def check(self, device: Device, size: int, rank: int) -> str | None:
        if rank != self.root:
            return check_array(self.x, device, self.op)  # ``out`` is the root's only
        return super().check(device, size, rank)

    def result_shape(self, agreed: Signature, size: int, rank: int) -> tuple[int, ...] | None:
        return agreed.shape if rank == agreed.root else None

    def moves(self, agreed: Signature, size: int) -> Movement:
        assert agreed.op is not None and agreed.root is not None
        return Reduction(size, agreed.dtype, agreed.op, _elements(agreed.shape), agreed.root)


class Broadcast(Call):
    """The one peer that passes an array is the root; the others pass None (and maybe ``out``)."""

    __slots__ = ()
    kind = strategy_kind = "broadcast"
    rules = Rules((), sourced=True, stated=("shape", "dtype"))
    reduces = False

    def check(self, device: Device, size: int, rank: int) -> str | None:
        if self.x is not None:
            return super().check(device, size, rank)
        if self.out is None:
            return None
        return check_out(self.out, device, tuple(self.out.shape), self.out.dtype, None)

    def describe(self, op: ReduceOp | None, problem: str | None) -> Signature:
        stated = self.x if self.x is not None else self.out
        if problem is not None or stated is None:
            return Signature(self.kind, None, None, has_data=self.x is not None, error=problem)
        return Signature(self.kind, None, None, tuple(stated.shape), stated.dtype, self.x is not None)

    def moves(self, agreed: Signature, size: int) -> Movement:
        return Copy(size, agreed.dtype, _elements(agreed.shape), agreed.root)


class AllGather(Call):
    """Result (group size, *x.shape): block i is rank i's x."""

    __slots__ = ()
    kind = strategy_kind = "all_gather"
    rules = Rules(("shape", "dtype"))
    reduces = False

    def own_shape(self, size: int) -> tuple[int, ...]:
        return (size, *self.x.shape)

    def result_shape(self, agreed: Signature, size: int, rank: int) -> tuple[int, ...] | None:
        assert agreed.shape is not None
        return (size, *agreed.shape)

    def moves(self, agreed: Signature, size: int) -> Movement:
        return Stack(size, agreed.dtype, [_elements(agreed.shape)] * size)


class Gather(AllGather):
    """All-gather onto the root only."""

    __slots__ = ()
    kind = strategy_kind = "gather"
    rules = Rules(("root", "shape", "dtype"))
    rooted = True

    def check(self, device: Device, size: int, rank: int) -> str | None:
        if rank != self.root:
            return check_array(self.x, device, None)
        return super().check(device, size, rank)

    def result_shape(self, agreed: Signature, size: int, rank: int) -> tuple[int, ...] | None:
        return super().result_shape(agreed, size, rank) if rank == agreed.root else None

    def moves(self, agreed: Signature, size: int) -> Movement:
        return Stack(size, agreed.dtype, [_elements(agreed.shape)] * size, agreed.root)


class _Blocked(Call):
    """A call whose x.shape[0] is the group size times k (reduce_scatter, all_to_all)."""

    __slots__ = ()

    def check(self, device: Device, size: int, rank: int) -> str | None:
        problem = check_array(self.x, device, None)
        if problem is None and (self.x.ndim == 0 or self.x.shape[0] % size):
            first = "a 0-d array" if self.x.ndim == 0 else f"shape {self.x.shape}"
            return (
                f"{self.kind} needs x.shape[0] divisible by the group size {size}, got {first}: "
                f"pass size*k rows, rank i's share being rows i*k..(i+1)*k-1"
            )
        return problem or super().check(device, size, rank)


class ReduceScatter(_Blocked):
    """Rank i gets op over every rank of rows i*k..(i+1)*k of x (x.shape[0] = size*k)."""

    __slots__ = ()
    kind = strategy_kind = "reduce_scatter"

    def own_shape(self, size: int) -> tuple[int, ...]:
        return (self.x.shape[0] // size, *self.x.shape[1:])

    def result_shape(self, agreed: Signature, size: int, rank: int) -> tuple[int, ...] | None:
        assert agreed.shape is not None
        return (agreed.shape[0] // size, *agreed.shape[1:])

    def moves(self, agreed: Signature, size: int) -> Movement:
        assert agreed.op is not None
        return ReducedBlocks(size, agreed.dtype, agreed.op, [_elements(agreed.shape) // size] * size)


class AllToAll(_Blocked):
    """Block j of x goes to rank j; block i of the result came from rank i."""

    __slots__ = ()
    kind = strategy_kind = "all_to_all"
    rules = Rules(("shape", "dtype"))
    reduces = False

    def moves(self, agreed: Signature, size: int) -> Movement:
        block = _elements(agreed.shape) // size
        return Exchange(size, agreed.dtype, [[block] * size] * size)


class Scatter(Call):
    """The root passes (group size, *shape); rank i gets row i. The others pass None."""

    __slots__ = ()
    kind = strategy_kind = "scatter"
    rules = Rules(("root",), sourced=True, stated=("shape", "dtype"))
    reduces = False
    rooted = True

    def check(self, device: Device, size: int, rank: int) -> str | None:
        if rank != self.root:
            if self.x is not None:
                return f"only the root (peer {self.root_peer}) passes an array to scatter; pass None"
            if self.out is None:
                return None
            return check_out(self.out, device, tuple(self.out.shape), self.out.dtype, None)
        if self.x is None:
            return (
                f"the root (peer {self.root_peer}) must pass an array of shape (group size, ...) to scatter"
            )
        problem = check_array(self.x, device, None)
        if problem is None and (self.x.ndim == 0 or self.x.shape[0] != size):
            return f"scatter needs x.shape[0] == the group size {size}, got shape {self.x.shape}"
        if problem is None and self.out is not None:
            source = None if self.out_apart else self.x
            problem = check_out(self.out, device, tuple(self.x.shape[1:]), self.x.dtype, source)
        return problem

    def describe(self, op: ReduceOp | None, problem: str | None) -> Signature:
        if problem is not None:
            return Signature(self.kind, None, self.root, has_data=self.x is not None, error=problem)
        if self.x is not None:
            return Signature(self.kind, None, self.root, tuple(self.x.shape[1:]), self.x.dtype)
        if self.out is not None:
            return Signature(self.kind, None, self.root, tuple(self.out.shape), self.out.dtype, False)
        return Signature(self.kind, None, self.root, has_data=False)

    def moves(self, agreed: Signature, size: int) -> Movement:
        return Rows(size, agreed.dtype, [_elements(agreed.shape)] * size, agreed.root)


class Barrier(Call):
    """No data: every peer returns once every peer has entered."""

    __slots__ = ()
    kind = "barrier"
    strategy_kind = "all_reduce"  # (a barrier follows all_reduce's strategy)
    rules = Rules(())
    reduces = False

    def check(self, device: Device, size: int, rank: int) -> str | None:
        return None

    def describe(self, op: ReduceOp | None, problem: str | None) -> Signature:
        return Signature(self.kind, error=problem)

    def result_shape(self, agreed: Signature, size: int, rank: int) -> tuple[int, ...] | None:
        return None

    def moves(self, agreed: Signature, size: int) -> Movement:
        return Nothing(size, agreed.dtype)


class Coalesced(AllReduce):
    """One dtype's bucket of an all_reduce_coalesced (collective.calls.coalesced); ``parts`` lists the
    shape and dtype of every array of the whole list, so peers whose lists differ disagree."""

    __slots__ = ("outs", "parts", "pieces")
    kind = "all_reduce_coalesced"
    strategy_kind = "all_reduce"
    rules = Rules(("op", "parts", "shape", "dtype"))

    def __init__(
        self,
        bucket: Any,
        op: Any,
        parts: tuple[tuple[tuple[int, ...], str], ...],
        out: Any = None,
        pieces: list[np.ndarray] | None = None,
        outs: list[tuple[Any, Any]] | None = None,
    ) -> None:
        super().__init__(bucket, op, out=out)
        self.parts = parts
        self.pieces = pieces  # numpy arrays still to be packed into ``bucket`` (None: it holds them)
        self.outs = outs  # the caller's (out, its input) pairs to check with this call (or None)

    @classmethod
    def refused(cls, problem: str, root: Any = None, op: Any = "sum") -> Coalesced:
        call = cls(np.zeros(0, np.float32), op, ())
        call.refuse(problem)
        return call

    def check(self, device: Device, size: int, rank: int) -> str | None:
        """The bucket is the runtime's own and ``out`` is the bucket: the dtype needs a look, and so
        does every ``out`` of the caller's list (before any data moves, on every peer). An ``out``
        may overlap any input: it is written once every input was read."""
        problem = check_array(self.x, device, self.op)
        for i, (out, x) in enumerate(self.outs or ()):
            if problem is None and (problem := check_out(out, device, tuple(x.shape), x.dtype, None)):
                problem = f"out[{i}]: {problem}"
        return problem

    def source(self) -> Array | None:
        """The bucket, packed on the first read (a step is agreed before any executor reads it;
        in one process the deciding peer reads every call's, in its own process a peer its own)."""
        if self.pieces is not None and self.src is not None:
            np.concatenate(self.pieces, axis=None, out=self.src)  # each array flattened, in one call
            self.pieces = None
        return self.src

    def unpacked(self) -> list[Array] | None:
        return self.pieces if self.src is not None else None

    def describe(self, op: ReduceOp | None, problem: str | None) -> Signature:
        if problem is not None:
            return Signature(self.kind, op, self.root, error=problem, parts=self.parts)
        return Signature(self.kind, op, self.root, tuple(self.x.shape), self.x.dtype, parts=self.parts)
