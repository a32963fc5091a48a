"""The large path of the Shm executor (collective.shm.group): chunks through shared memory.

Every member has two chunk buffers in its channel; chunk c goes through buffer c % 2. Members
raise their progress word as they go (within step s: ``at(s, IN(c))``, ``at(s, RED(c))``) and read
the others' buffers once those say the data is there. A member posts IN(c) only after it has
finished reading the others' buffers for chunk c - 1, so before it refills a buffer with chunk c
it waits for every reader's IN(c - 1): the buffers of chunks c - 2 and c are the same. Members
work on different chunks at once (pipelined); a step starts only once every member arrived, so
nobody still reads the previous step's chunks. The primitives the movement families
(collective.calls.movement) drive, per chunk::

    reduce   load the others' slices of the chunk | IN | reduce my slice of every member's chunk,
             in rank order, into my own buffer | RED | copy every member's reduced slice out
             (where a result is wanted)
    copy     the root loads the chunk | IN | the others copy it out
    stack    load my chunk | IN | copy every member's chunk into its block (where a result is wanted)
    split    every loader loads sub-chunk j of its block j for member j | IN | reduce, or stack by
             source, the sub-chunks meant for me out of every loader's buffer

Blocks may be uneven: a member with fewer chunks than others still posts every chunk's progress.
Each element is reduced once, by one member, in rank order, so every member gets the same bits,
and the same bits as the small path.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from collective.algorithms.ops import ReduceOp
from collective.calls.movement import reduce_all, slice_of
from collective.transport.shm_ring import CHUNK_BYTES


class Members(Protocol):
    """What a large step needs of its group (collective.shm.group.ShmGroup)."""

    n: int
    rank: int

    def buffer(self, rank: int, parity: int) -> np.ndarray: ...

    def post(self, value: int) -> None: ...

    def wait(self, rank: int, target: int, deadline: float) -> None: ...


__all__ = ["ABORT", "ARRIVE", "END", "Chunks", "Pieces", "at"]

ARRIVE, ABORT, END = 0, 0xFFFFFFFE, 0xFFFFFFFF  # progress codes of a step (below ABORT: its chunks)


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
        self.size = sum(array.size for array in arrays)

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
    """One member's large step (the movement families' ``Pipe``): sources and results are flat
    host arrays (a result None where the member gets none); a reduction's source may be Pieces."""

    def __init__(self, group: Members, dtype: Any, step: int, deadline: float) -> None:
        self.group = group
        self.step = step
        self.deadline = deadline
        self.n, self.me = group.n, group.rank
        self.others = [rank for rank in range(self.n) if rank != self.me]
        self.dtype = np.dtype(dtype)
        self.cap = CHUNK_BYTES // self.dtype.itemsize  # elements per buffer

    # -- helpers --------------------------------------------------------------------------------

    def buffer(self, rank: int, chunk: int) -> np.ndarray:
        return self.group.buffer(rank, chunk & 1).view(self.dtype)

    def post(self, code: int) -> None:
        self.group.post(at(self.step, code))

    def wait(self, ranks: list[int], code: int) -> None:
        target = at(self.step, code)
        for rank in ranks:
            self.group.wait(rank, target, self.deadline)

    # -- the primitives -------------------------------------------------------------------------

    def reduce(self, src: np.ndarray | Pieces, dst: np.ndarray | None, op: ReduceOp) -> None:
        """``dst`` (where not None) = op over every member's whole ``src``, in rank order."""
        n, me = self.n, self.me
        source = src if isinstance(src, Pieces) else Pieces([src])
        total = source.size
        for c, lo in enumerate(range(0, total, self.cap)):
            hi = min(total, lo + self.cap)
            length = hi - lo
            mine, buffer = slice_of(hi - lo, n, me), self.buffer(me, c)
            # readers of chunk c - 2 are done: their IN(c - 1) was awaited in the last round
            whole = me < 2 and len(source.arrays) > 1 and length == total  # many pieces, one chunk
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

    def copy(self, root: int, src: np.ndarray | None, dst: np.ndarray | None) -> None:
        """Every member's ``dst`` = the root's ``src`` (the root's own ``dst`` may be None or ``src``)."""
        total = src.size if src is not None else (dst.size if dst is not None else 0)
        for c, lo in enumerate(range(0, total, self.cap)):
            hi = min(total, lo + self.cap)
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

    def stack(self, counts: Sequence[int], src: np.ndarray, dst: np.ndarray | None) -> None:
        """``dst`` (where not None) = every member's ``src`` (``counts[k]`` elements), in rank order."""
        me = self.me
        starts = list(itertools.accumulate(counts, initial=0))
        chunks = max((-(-count // self.cap) for count in counts), default=0)
        for c in range(chunks):
            lo = c * self.cap
            if c >= 2 and dst is None:  # a taker awaited every IN(c - 1) in the last round
                self.wait(self.others, _in(c - 1))
            mine = max(0, min(counts[me], lo + self.cap) - lo)
            np.copyto(self.buffer(me, c)[:mine], src[lo : lo + mine])
            self.post(_in(c))
            if dst is not None:
                self.wait(self.others, _in(c))
                for k in self.others:
                    theirs = max(0, min(counts[k], lo + self.cap) - lo)
                    at_k = starts[k] + lo
                    np.copyto(dst[at_k : at_k + theirs], self.buffer(k, c)[:theirs])
        if dst is not None:
            np.copyto(dst[starts[me] : starts[me + 1]], src)

    def split(
        self,
        sizes: Sequence[Sequence[int] | None],
        src: np.ndarray | None,
        dst: np.ndarray,
        op: ReduceOp | None,
    ) -> None:
        """Loader k (``sizes[k]`` not None) sends its block j (``sizes[k][j]`` elements, blocks in
        rank order) to member j, which reduces what it gets with ``op`` (every loader sends the
        same sizes then) or stacks it by source rank."""
        n, me = self.n, self.me
        rows = {k: row for k, row in enumerate(sizes) if row is not None}
        loaders = sorted(rows)
        row = sizes[me]
        sends = list(itertools.accumulate(row, initial=0)) if row is not None else []
        receives = list(itertools.accumulate((rows[k][me] if k in rows else 0 for k in range(n)), initial=0))
        sources = [k for k in loaders if k != me]
        everyone = len(loaders) == n  # every member waits for every other each round
        per = max(1, self.cap // n)  # elements for each member in one chunk
        biggest = max((size for k in loaders for size in rows[k]), default=0)
        for c in range(-(-biggest // per)):
            lo = c * per
            own: Any = None
            if row is not None:
                assert src is not None
                if c >= 2 and not everyone:  # the others awaited every IN(c - 1) in the last round
                    self.wait(self.others, _in(c - 1))
                buffer = self.buffer(me, c)
                for j in self.others:
                    length = max(0, min(row[j], lo + per) - lo)
                    np.copyto(buffer[j * per : j * per + length], src[sends[j] + lo : sends[j] + lo + length])
                length = max(0, min(row[me], lo + per) - lo)
                own = src[sends[me] + lo : sends[me] + lo + length]
            self.post(_in(c))  # (a member that loads nothing: done with chunk c - 1)
            self.wait(sources, _in(c))
            pieces = [
                own
                if k == me
                else self.buffer(k, c)[me * per : me * per + max(0, min(sizes[k][me], lo + per) - lo)]  # type: ignore[index]
                for k in loaders
            ]
            if op is not None:
                length = pieces[0].size
                reduce_all(op, pieces, dst[lo : lo + length])
            else:
                for k, piece in zip(loaders, pieces, strict=True):
                    np.copyto(dst[receives[k] + lo : receives[k] + lo + piece.size], piece)
