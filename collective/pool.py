"""Recycled result buffers: a collective without ``out=`` does not pay fresh page faults.

A new numpy array of 64 MiB costs its pages on first touch (about 2.5 ms here, more than a
quarter of the collective); ``y = all_reduce(x)`` in a loop would pay that on every call. Smaller
buffers pay it too: glibc returns freed memory above its thresholds to the system (a 0.76 MiB
all_reduce_coalesced bucket allocated anew per call ran 3.4x slower than a reused one). So a
result of at least MIN_BYTES is handed out as a view of a *block* (a uint8 array the pool keeps),
and a block is handed out again once nothing but the pool refers to it. Every numpy view of a
block keeps the block itself as its ``base`` (numpy collapses chains of views), and so does
anything that exports its memory (memoryview, DLPack, torch.from_numpy hold the array that holds
the block): while any of them lives, the block's reference count is above the pool's own
references and the block is not reused. Never a buffer still referenced, then.

The blocks the pool keeps, idle or handed out, are bounded by ``limit`` bytes in all
(``COLLECTIVE_POOL_BYTES``; 0: no pooling): a new block that would pass it first drops idle
blocks, least recently handed out first, and when that is not enough the result is a plain
array, freed as numpy frees any. So no result pays a finalizer, and what stays idle once results
are dropped is within the limit. A pooled result does not own its memory (``flags.owndata`` is
False, so ``ndarray.resize`` refuses it).
"""

from __future__ import annotations

import math
import os
import sys
import threading
from typing import Any

import numpy as np

__all__ = ["MIN_BYTES", "Pool", "pool"]

MIN_BYTES = 128 << 10  # glibc's first mmap threshold: from here a freed buffer may go back to the system
DEFAULT_LIMIT = 1 << 30
_OWN = 3  # references to an idle block while it is looked at: the pool's list, the loop, getrefcount's


class Pool:
    """Blocks of recently returned large results, by size, reused once unreferenced."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._blocks: dict[int, list[np.ndarray]] = {}  # nbytes -> blocks, least recently handed out first
        self._held = 0  # bytes of every block the pool keeps, idle or handed out
        self.reused = 0  # blocks handed out again (for tests)

    @property
    def sizes(self) -> list[int]:
        """The sizes (bytes) of the blocks it keeps, idle or handed out, sorted (for tests of state
        growth)."""
        with self._lock:
            return sorted(self._blocks)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised numpy array (a recycled block when it is large)."""
        if not isinstance(dtype, np.dtype):
            dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_BYTES or self.limit <= 0 or dtype.hasobject:  # bytes cannot hold references
            return np.empty(shape, dtype)
        with self._lock:
            blocks = self._blocks.get(nbytes, [])
            i = 0
            for block in blocks:  # (not enumerate: its cached tuple would hold one more reference)
                if sys.getrefcount(block) <= _OWN:
                    break
                i += 1
            if i < len(blocks):
                del blocks[i]
                self.reused += 1
            else:
                if self._held + nbytes > self.limit and not self._trim(self.limit - nbytes):
                    return np.empty(shape, dtype)  # the blocks handed out fill the pool
                block = np.empty(nbytes, np.uint8)
                self._held += nbytes
            self._blocks.setdefault(nbytes, []).append(block)  # (the trim may have dropped the list)
        result: np.ndarray = block.view(dtype).reshape(shape)
        return result

    def _trim(self, target: int) -> bool:
        """Drop idle blocks, least recently handed out first, until at most ``target`` bytes are
        held; none when that cannot be reached (False)."""
        idle = [
            (size, block)
            for size, blocks in self._blocks.items()
            for block in blocks
            if sys.getrefcount(block) <= _OWN
        ]
        excess = self._held - target
        if excess > sum(size for size, _ in idle):
            return False
        for size, block in idle:
            if excess <= 0:
                break
            self._blocks[size] = [b for b in self._blocks[size] if b is not block]
            self._held -= size
            excess -= size
        for size in [size for size, blocks in self._blocks.items() if not blocks]:
            del self._blocks[size]
        return True

    def idle_bytes(self) -> int:
        with self._lock:
            return sum(
                size for size, blocks in self._blocks.items() for b in blocks if sys.getrefcount(b) <= _OWN
            )


def _limit() -> int:
    text = os.environ.get("COLLECTIVE_POOL_BYTES", "")
    return int(text) if text.strip().isdigit() else DEFAULT_LIMIT


pool = Pool(_limit())
