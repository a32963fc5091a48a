"""The large path of the Shm executor (collective.shm_executor): chunks through shared memory.

Every member has two chunk buffers in its channel; chunk c goes through buffer c % 2. Members
raise their progress word as they go (within step s: ``at(s, IN(c))``, ``at(s, RED(c))``) and read
the others' buffers once those say the data is there. A member posts IN(c) only after it has
finished reading the others' buffers for chunk c - 1, so before it refills a buffer with chunk c
it waits for every reader's IN(c - 1): the buffers of chunks c - 2 and c are the same. Members
work on different chunks at once (pipelined); a step starts only once every member arrived, so
nobody still reads the previous step's chunks. Per chunk, every collective::

    reductions   load the others' slices of the chunk | IN | reduce my slice of every member's
                 chunk, in rank order, into my own buffer | RED | copy every member's reduced
                 slice out (the root only, for reduce)
    broadcast    the root loads the chunk | IN | the others copy it out
    all_gather   load my chunk | IN | copy every member's chunk into its block (gather: the root)
    blocked      (reduce_scatter, all_to_all, scatter) load sub-chunk j of every block j for
                 member j | IN | reduce / copy the sub-chunks meant for me out of every buffer

Each element is reduced once, by one member, in rank order, so every member gets the same bits,
and the same bits as the small path.
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Any, Protocol

import numpy as np

from collective.call import reduce_all, slice_of
from collective.signature import Signature
from collective.transport.shm_ring import CHUNK_BYTES


class Members(Protocol):
    """What a large step needs of its group (collective.shm_executor.ShmGroup)."""

    n: int
    rank: int

    def buffer(self, rank: int, parity: int) -> np.ndarray: ...

    def post(self, value: int) -> None: ...

    def wait(self, rank: int, target: int, deadline: float) -> None: ...


__all__ = ["ABORT", "ARRIVE", "END", "REDUCING", "Chunks", "Pieces", "at"]

ARRIVE, ABORT, END = 0, 0xFFFFFFFE, 0xFFFFFFFF  # progress codes of a step (below ABORT: its chunks)
REDUCING = frozenset(["all_reduce", "reduce", "all_reduce_coalesced"])


def at(step: int, code: int) -> int:
    """The progress value of ``code`` within ``step``."""
    return (step << 32) | code


def _in(chunk: int) -> int:
    return ((chunk + 1) << 2) | 1


def _red(chunk: int) -> int:
    return ((chunk + 1) << 2) | 2


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two flat arrays are views of the same memory."""
    return bool(a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.size == b.size)


class Pieces:
    """A flat input kept as consecutive arrays (all_reduce_coalesced's, never packed): each array
    of any shape stands for its elements in C order."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays
        self._one = arrays[0] if len(arrays) == 1 and arrays[0].ndim == 1 else None  # a flat input
        self._flat: list[np.ndarray] = []  # (made by the first segments(): a bucket of one chunk
        self._starts: list[int] = []  # is packed whole, and needs neither)

    def pack(self, out: np.ndarray) -> None:
        """``out`` = the whole concatenation, in one call (no view per array)."""
        np.concatenate(self.arrays, axis=None, out=out)

    def segments(self, lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
        """Elements ``lo`` to ``hi`` of the concatenation: (offset from ``lo``, a view) per array."""
        if self._one is not None:
            return [(0, self._one[lo:hi])] if hi > lo else []
        if not self._flat:
            self._flat = list(map(np.ndarray.ravel, self.arrays))  # views (copies if not contiguous)
            self._starts = list(itertools.accumulate([array.size for array in self._flat], initial=0))
        found = []
        starts, arrays = self._starts, self._flat
        i = bisect.bisect_right(starts, lo) - 1
        at = lo
        while at < hi:
            end = min(hi, starts[i + 1])
            if end > at:
                found.append((at - lo, arrays[i][at - starts[i] : end - starts[i]]))
                at = end
            i += 1
        return found

    def copy(self, lo: int, hi: int, out: np.ndarray) -> None:
        """``out[: hi - lo]`` = elements ``lo`` to ``hi`` of the concatenation."""
        if self._one is not None:
            np.copyto(out[: hi - lo], self._one[lo:hi])
            return
        views = [view for _, view in self.segments(lo, hi)]
        if len(views) == 1:
            np.copyto(out[: hi - lo], views[0])
        elif views:
            np.concatenate(views, out=out[: hi - lo])


class Chunks:
    """One member's large step: ``src`` and ``dst`` are flat host arrays (either may be None); a
    reduction's ``src`` may be Pieces."""

    def __init__(
        self,
        group: Members,
        agreed: Signature,
        src: np.ndarray | Pieces | None,
        dst: np.ndarray | None,
        step: int,
        deadline: float,
    ) -> None:
        self.group = group
        self.agreed = agreed
        self.pieces = src if isinstance(src, Pieces) else None
        self.src = None if isinstance(src, Pieces) else src
        self.dst = dst
        self.step = step
        self.deadline = deadline
        self.n, self.me = group.n, group.rank
        self.others = [rank for rank in range(self.n) if rank != self.me]
        self.dtype = np.dtype(agreed.dtype)
        self.cap = CHUNK_BYTES // self.dtype.itemsize  # elements per buffer
        self.total = math.prod(agreed.shape) if agreed.shape is not None else 0

    def run(self) -> None:
        kind = self.agreed.kind
        if kind in REDUCING:
            self._reduction()
        elif kind == "broadcast":
            self._broadcast()
        elif kind in ("all_gather", "gather"):
            self._gathering()
        else:
            self._blocked(kind)

    # -- helpers --------------------------------------------------------------------------------

    def buffer(self, rank: int, chunk: int) -> np.ndarray:
        return self.group.buffer(rank, chunk & 1).view(self.dtype)

    def post(self, code: int) -> None:
        self.group.post(at(self.step, code))

    def wait(self, ranks: list[int], code: int) -> None:
        target = at(self.step, code)
        for rank in ranks:
            self.group.wait(rank, target, self.deadline)

    # -- the collectives ------------------------------------------------------------------------

    def _reduction(self) -> None:
        dst, n, me = self.dst, self.n, self.me
        assert self.agreed.op is not None
        op = self.agreed.op
        source = self.pieces
        if source is None:
            assert self.src is not None
            source = Pieces([self.src])
        for c, lo in enumerate(range(0, self.total, self.cap)):
            hi = min(self.total, lo + self.cap)
            length = hi - lo
            mine, buffer = slice_of(hi - lo, n, me), self.buffer(me, c)
            # readers of chunk c - 2 are done: their IN(c - 1) was awaited in the last round
            whole = me < 2 and len(source.arrays) > 1 and length == self.total  # many pieces, one chunk
            if whole:  # every piece packed by one call; my slice is then reduced in place
                source.pack(buffer[:length])  # (reduce_all's out may be its input 0 or 1)
            else:
                source.copy(lo, lo + mine.start, buffer[: mine.start])
                source.copy(lo + mine.stop, hi, buffer[mine.stop : length])
            self.post(_in(c))
            self.wait(self.others, _in(c))
            segments = [(0, buffer[mine])] if whole else source.segments(lo + mine.start, lo + mine.stop)
            if len(segments) > 1 and me < 2:  # gathered first: one reduction of my slice, in place
                source.copy(lo + mine.start, lo + mine.stop, buffer[mine])  # (out may be input 0 or 1)
                segments = [(0, buffer[mine])]
            theirs = [self.buffer(k, c) for k in range(n)]
            for offset, own in segments:  # my slice of every member's chunk, reduced in rank order
                part = slice(mine.start + offset, mine.start + offset + own.size)
                reduce_all(op, [own if k == me else theirs[k][part] for k in range(n)], buffer[part])
            self.post(_red(c))
            if dst is not None:
                self.wait(self.others, _red(c))
                for k in range(n):
                    part = slice_of(length, n, k)
                    np.copyto(dst[lo + part.start : lo + part.stop], self.buffer(k, c)[part])

    def _broadcast(self) -> None:
        src, dst, root = self.src, self.dst, self.agreed.root
        assert root is not None
        for c, lo in enumerate(range(0, self.total, self.cap)):
            hi = min(self.total, lo + self.cap)
            if self.me == root:
                assert src is not None
                if c >= 2:
                    self.wait(self.others, _in(c - 1))
                np.copyto(self.buffer(self.me, c)[: hi - lo], src[lo:hi])
                self.post(_in(c))
            else:
                assert dst is not None
                self.post(_in(c))  # done with chunk c - 1
                self.wait([root], _in(c))
                np.copyto(dst[lo:hi], self.buffer(root, c)[: hi - lo])
        if self.me == root and dst is not None and src is not None and not _same(dst, src):
            np.copyto(dst, src)  # the root's own result (unless it broadcast from out=x in place)

    def _gathering(self) -> None:
        src, dst, me, total = self.src, self.dst, self.me, self.total
        assert src is not None
        for c, lo in enumerate(range(0, total, self.cap)):
            hi = min(total, lo + self.cap)
            if c >= 2 and dst is None:  # a taker awaited every IN(c - 1) in the last round
                self.wait(self.others, _in(c - 1))
            np.copyto(self.buffer(me, c)[: hi - lo], src[lo:hi])
            self.post(_in(c))
            if dst is not None:
                self.wait(self.others, _in(c))
                for k in self.others:
                    np.copyto(dst[k * total + lo : k * total + hi], self.buffer(k, c)[: hi - lo])
        if dst is not None:
            np.copyto(dst[me * total : (me + 1) * total], src)

    def _blocked(self, kind: str) -> None:
        """reduce_scatter, all_to_all, scatter: block j of a loader's input is meant for member j."""
        src, dst, n, me = self.src, self.dst, self.n, self.me
        assert dst is not None
        root = self.agreed.root
        block = self.total if kind == "scatter" else self.total // n
        loader = kind != "scatter" or me == root
        sources = self.others if kind != "scatter" else ([root] if me != root and root is not None else [])
        per = max(1, self.cap // n)
        for c, lo in enumerate(range(0, block, per)):
            hi = min(block, lo + per)
            length = hi - lo
            own: Any = None
            if loader:
                assert src is not None
                if c >= 2 and kind == "scatter":  # the others awaited every IN(c - 1) in the last round
                    self.wait(self.others, _in(c - 1))
                buffer = self.buffer(me, c)
                for j in self.others:
                    np.copyto(buffer[j * length : (j + 1) * length], src[j * block + lo : j * block + hi])
                own = src[me * block + lo : me * block + hi]
            self.post(_in(c))  # (a receiver of scatter: done with chunk c - 1)
            self.wait(sources, _in(c))
            mine = slice(me * length, (me + 1) * length)
            if kind == "reduce_scatter":
                assert self.agreed.op is not None
                inputs = [own if k == me else self.buffer(k, c)[mine] for k in range(n)]
                reduce_all(self.agreed.op, inputs, dst[lo:hi])
            elif kind == "all_to_all":
                for k in range(n):
                    np.copyto(
                        dst[k * block + lo : k * block + hi], own if k == me else self.buffer(k, c)[mine]
                    )
            else:
                assert root is not None
                np.copyto(dst[lo:hi], own if me == root else self.buffer(root, c)[mine])
