"""The in-process fast paths for numpy arrays: the work is split between the peers' threads directly.

Peers of one process share memory, so once the rendezvous has every peer's input in hand, small
and mid-size collectives do not need an algorithm's message steps (each costs a thread hand-off):

* fused (up to ``fuse_below``, 64 KiB): the last peer to arrive computes the result at the
  rendezvous; every peer copies it. One wake-up per peer.
* shared (up to ``share_below``, 4 MiB): every peer combines its own slice of every input into one
  shared result, all peers pass a barrier, then each copies the result out (the root only, for
  reduce; for broadcast every peer copies the root's array, then the barrier). Two wake-ups per
  peer, and the arithmetic is spread over the peers' threads.

Inputs are combined in peer order in both, and every peer copies the same result, so results are
deterministic and bit-identical across peers. Above ``share_below`` (and for CuPy arrays, and in
multi-node jobs) the configured strategy runs over the in-process link.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from collective.algorithms.ops import Array, ReduceOp, chunk_bounds, combine
from collective.calls import CallSpec

__all__ = ["DEFAULT_FUSE_BELOW", "DEFAULT_SHARE_BELOW", "SharedWork", "reduce_all", "usable"]

DEFAULT_FUSE_BELOW = 64 * 1024
DEFAULT_SHARE_BELOW = 4 << 20


def usable(data: dict[int, Array | None], limit: int) -> bool:
    """Every array is a numpy array of at most ``limit`` bytes (peers without one are fine)."""
    return all(a is None or (type(a) is np.ndarray and a.nbytes <= limit) for a in data.values())


def reduce_all(op: ReduceOp, inputs: list[Any]) -> Array:
    """The reduction of ``inputs`` in their order (peer order), in a new array."""
    result = inputs[0].copy()
    for other in inputs[1:]:
        combine(op, result, other, result)
    return result


@dataclass(frozen=True)
class SharedWork:
    """What the peers of one shared-path collective read and write.

    ``inputs`` are the peers' flat inputs in peer order (None for broadcast receivers), ``result``
    the shared result buffer (None for broadcast), ``slices`` each peer's part of it.
    """

    call: CallSpec
    inputs: list[Any]
    result: Any
    slices: list[slice]

    @classmethod
    def plan(cls, call: CallSpec, inputs: list[Any]) -> SharedWork:
        source = inputs[0] if call.kind != "broadcast" else None
        result = np.empty_like(source) if source is not None else None
        length = source.size if source is not None else 0
        return cls(call, inputs, result, [slice(lo, hi) for lo, hi in chunk_bounds(length, len(inputs))])

    def combine_slice(self, index: int) -> None:
        """Peer ``index``'s share of the arithmetic: its slice of every input, in peer order."""
        if self.result is None:
            return
        assert self.call.op is not None
        part = self.slices[index]
        out = self.result[part]
        np.copyto(out, self.inputs[0][part])
        for other in self.inputs[1:]:
            combine(self.call.op, out, other[part], out)
