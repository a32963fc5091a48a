"""all_reduce_coalesced: one collective over many arrays (a model's gradients, say).

The arrays are packed into one flat bucket per dtype (one copy in), each bucket is all-reduced as
one array, and the results come back as views of the reduced bucket in the caller's shapes (or
copied into ``out``). Every bucket's call carries the list of every array's shape and dtype, so a
peer whose list differs is a MismatchError on every peer before any data moves. One dtype (the
usual case) is one rendezvous and one schedule, whatever the number of arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from collective.algorithms.ops import Array, array_module
from collective.calls import AllReduce
from collective.errors import InvalidArgumentError
from collective.signature import Rules, Signature
from collective.tensors import native

__all__ = ["Coalesced", "coalesced_all_reduce"]


class Coalesced(AllReduce):
    """One dtype's bucket of an all_reduce_coalesced; ``parts`` describes the whole list."""

    kind = "all_reduce_coalesced"
    rules = Rules(("op", "parts", "shape", "dtype"))

    def __init__(
        self, bucket: Any, op: Any, parts: tuple[tuple[tuple[int, ...], str], ...], problem: str | None
    ):
        super().__init__(bucket, op)
        self.parts = parts
        self.problem = problem

    def check(self, device: Any, size: int, rank: int) -> str | None:
        return self.problem or super().check(device, size, rank)

    def describe(self, op: Any, problem: str | None) -> Signature:
        return super().describe(op, problem)._replace(parts=self.parts)


def coalesced_all_reduce(
    xs: Sequence[Array], op: Any, out: Sequence[Array] | None, execute: Callable[[Coalesced], Array]
) -> list[Array]:
    """Reduce every array of ``xs``; ``execute`` runs one bucket's call and returns its flat result."""
    if not isinstance(xs, list | tuple) or not xs:
        raise InvalidArgumentError("all_reduce_coalesced takes a non-empty list of arrays")
    converted = [native(x) for x in xs]
    arrays = [array for array, _ in converted]
    problem = None
    if not all(hasattr(x, "dtype") and hasattr(x, "shape") for x in arrays):
        problem = "every item of the list must be an array"
        arrays = [np.zeros(0, np.float32)]
    if out is not None and (len(out) != len(arrays) or any(o is None for o in out)):
        raise InvalidArgumentError(f"out must be a list of {len(arrays)} arrays, one per input")
    parts = tuple((tuple(x.shape), str(x.dtype)) for x in arrays)
    by_dtype: dict[str, list[int]] = {}
    for index, x in enumerate(arrays):
        by_dtype.setdefault(str(x.dtype), []).append(index)
    results: list[Array] = [None] * len(arrays)
    for indices in by_dtype.values():
        xp = array_module(arrays[indices[0]]) if problem is None else np
        pieces = [arrays[i].reshape(-1) for i in indices]
        bucket = xp.concatenate(pieces) if len(pieces) > 1 else xp.ascontiguousarray(pieces[0])
        reduced = execute(Coalesced(bucket, op, parts, problem))
        offset = 0
        for i in indices:
            size = int(np.prod(arrays[i].shape, dtype=np.int64))
            view = reduced[offset : offset + size].reshape(arrays[i].shape)
            offset += size
            if out is not None:
                native(out[i])[0][...] = view
                results[i] = out[i]
            else:
                results[i] = converted[i][1](view) if problem is None else view
    return results
