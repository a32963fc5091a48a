"""How a collective's data moves: a few movement families, each written once for every path.

Every call class (collective.calls) says which family its data follows for an agreed call
(``Call.movement``); the executors ask the family and never look at the collective's name::

    Nothing        no data                                              barrier
    Reduction      op over every rank's whole array, to all or the root all_reduce, reduce, coalesced
    Copy           the root's whole array to every rank                 broadcast
    Stack          every rank's block in rank order, to all or the root all_gather, gather, all_gather_v
    Rows           block i of the root's array to rank i                scatter
    ReducedBlocks  op over every rank's block i, to rank i              reduce_scatter(_v)
    Exchange       rank r's block j to rank j, stacked by source rank   all_to_all(_v)

Arrays are flat (1-D, C-contiguous) and blocks are counted in elements; they may be uneven (the
``_v`` collectives, and node-level blocks when nodes hold different numbers of ranks). What each
path asks of a family:

* ``fuse`` / ``own`` / ``shared``, ``part``, ``after``: in one place that can read every rank's
  input (the Fused and Shared executors; the small steps of shared memory; the small global
  phase of three phases, whose contributions came with the calls);
* ``run_link``: the configured strategy's schedule over a Link (collective.algorithms);
* ``stream``: the shared-memory chunk pipeline (its primitives: a ``Pipe``);
* ``between`` / ``contribution`` / ``take``: the three phases across nodes (collective.calls.layout):
  the node-level movement, a node's part of it built from its ranks' inputs, and a rank's result
  taken from its node's product;
* ``inward`` / ``at_leader``: the host tier, which first brings a host's inputs to its leader.

Every family combines in rank order ((x0 op x1) op x2 ...) where it reduces in one place, so
every path that reduces in one place gives the same bits.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, ClassVar, Protocol

import numpy as np

from collective.algorithms import strategies
from collective.algorithms.link import Link
from collective.algorithms.ops import Array, ReduceOp, array_module, copy_into, elementwise
from collective.algorithms.strategies import Strategy
from collective.calls.layout import Layout

__all__ = [
    "Copy",
    "Exchange",
    "Movement",
    "Nothing",
    "Pipe",
    "ReducedBlocks",
    "Reduction",
    "Rows",
    "Stack",
    "reduce_all",
    "slice_of",
]


class Pipe(Protocol):
    """The chunk pipeline of shared memory (collective.shm.chunks), as the families drive it."""

    def reduce(self, src: Any, dst: np.ndarray | None, op: ReduceOp) -> None:
        """``dst`` (on receivers) = op over every member's ``src`` (an array or its pieces)."""

    def copy(self, root: int, src: np.ndarray | None, dst: np.ndarray | None) -> None:
        """Every member's ``dst`` = the root's ``src``."""

    def stack(self, counts: Sequence[int], src: np.ndarray, dst: np.ndarray | None) -> None:
        """``dst`` (on receivers) = every member's ``src`` (``counts[k]`` elements), in rank order."""

    def split(
        self,
        sizes: Sequence[Sequence[int] | None],
        src: np.ndarray | None,
        dst: np.ndarray,
        op: ReduceOp | None,
    ) -> None:
        """Loader k (``sizes[k]`` not None) sends its block j (``sizes[k][j]`` elements) to member j,
        which reduces what it gets with ``op`` or stacks it by source rank."""


def reduce_all(op: ReduceOp, inputs: Sequence[Any], out: Array | None = None) -> Array:
    """The reduction of ``inputs`` in their order (rank order) into ``out`` (a new array if None).

    ``out`` may be the first or the second input, never a later one (it is written first).
    """
    if len(inputs) == 1:
        if out is None:
            return inputs[0].copy()
        copy_into(out, inputs[0])
        return out
    first = inputs[0]
    if type(first) is np.ndarray:  # the ufunc itself: this runs on every small step
        ufunc = elementwise(op, first)  # (numpy's ufunc; a large half-precision one: torch's kernel)
        result = out if out is not None else np.empty(first.shape, first.dtype)  # (the inputs' dtype:
        ufunc(first, inputs[1], result)  # a ufunc's own result of '>f4' inputs is '<f4'; out given
        for other in inputs[2:]:  # by position: a keyword costs a small call a tenth more)
            ufunc(result, other, result)
        return result
    result = out if out is not None else array_module(first).empty(first.shape, first.dtype)
    ufunc = getattr(array_module(result), op.ufunc_name)
    ufunc(first, inputs[1], out=result)
    for other in inputs[2:]:
        ufunc(result, other, out=result)
    return result


def slice_of(length: int, parts: int, index: int) -> slice:
    """Part ``index`` of ``parts`` near-equal parts of ``range(length)``."""
    return slice(index * length // parts, (index + 1) * length // parts)


def _starts(counts: Sequence[int]) -> list[int]:
    return list(itertools.accumulate(counts, initial=0))


def _same(a: Array, b: Array) -> bool:
    """Whether two flat arrays are the same memory (a copy between them is none)."""
    if a is b:
        return True
    if type(a) is not np.ndarray or type(b) is not np.ndarray or a.size != b.size:
        return False
    if a.base is not b.base and a.base is not b and b.base is not a:  # (cheap: views of one array)
        return False
    return bool(a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def _stacked(inputs: Sequence[Array]) -> Array:
    """A new array: ``inputs`` one after another."""
    return array_module(inputs[0]).concatenate(inputs) if len(inputs) > 1 else inputs[0].copy()


def _received(value: Array, n: int, root: int | None) -> list[Any]:
    """Every rank's result of a movement whose receivers get ``value``: all ranks, or the root."""
    if root is None:
        return [value] * n
    results: list[Any] = [None] * n
    results[root] = value
    return results


def _equal(counts: Sequence[int]) -> bool:
    return len(set(counts)) <= 1


def _blocks(counts: Sequence[int]) -> Sequence[int] | None:
    """The blocks as the schedules take them (None: equal blocks, their default)."""
    return None if _equal(counts) else counts


class Movement:
    """How one agreed collective's data moves among the ``n`` ranks of a group.

    Inputs and results are flat arrays of ``dtype``; ``root`` is a rank (None: no root).
    """

    __slots__ = ("dtype", "n", "root")
    whole: ClassVar[bool] = False  # every rank's result is the whole node-level product (three phases)
    alias_safe: ClassVar[bool] = True  # its schedules may write a result that is also the input

    def __init__(self, n: int, dtype: Any, root: int | None = None) -> None:
        self.n = n
        self.dtype = dtype
        self.root = root

    def source_size(self, rank: int) -> int | None:
        """Elements of ``rank``'s input (None: it passes none)."""
        raise NotImplementedError

    def result_size(self, rank: int) -> int | None:
        """Elements of ``rank``'s result (None: it gets none)."""
        raise NotImplementedError

    # -- where every input can be read --------------------------------------------------------

    def fuse(self, inputs: list[Any]) -> list[Any]:
        """Every rank's result (None for a rank that gets none) from every rank's input: new
        arrays, never views of an input (one array may serve several ranks)."""
        results: list[Any] = []
        for rank in range(self.n):
            size = self.result_size(rank)
            result = None
            if size is not None:
                result = np.empty(size, self.dtype)
                self.own(inputs, rank, result)
            results.append(result)
        return results

    def own(self, inputs: list[Any], rank: int, dst: Array) -> None:
        """``rank``'s result into ``dst``, from every rank's input (read directly)."""
        raise NotImplementedError

    def own_bound(self, inputs: list[Any], rank: int, dst: Array) -> Callable[[], Any]:
        """``own`` with its arguments bound, for a step repeated on the same inputs and ``dst`` (a
        persistent call's uses through shared memory: collective.shm.group's lane)."""
        return partial(self.own, inputs, rank, dst)

    def shared(self, inputs: list[Any]) -> Any:
        """State the ranks of one Shared step share (e.g. a result buffer)."""
        return None

    def part(self, inputs: list[Any], state: Any, rank: int, dst: Array | None) -> None:
        """``rank``'s work before the Shared step's barrier (it reads the others' inputs)."""
        if dst is not None:
            self.own(inputs, rank, dst)

    def after(self, state: Any, rank: int, dst: Array | None) -> None:
        """``rank``'s work after the barrier (the inputs may no longer be read)."""

    # -- over a link, and through shared memory -----------------------------------------------

    def run_link(self, strategy: Strategy, link: Link, src: Array | None, dst: Array | None) -> None:
        """This rank's part of the strategy's schedule (``src``, ``dst``: its input and result)."""
        raise NotImplementedError

    def stream(self, pipe: Pipe, src: Any, dst: np.ndarray | None) -> None:
        """This member's part of a large shared-memory step."""
        raise NotImplementedError

    # -- the three phases -----------------------------------------------------------------------

    def between(self, layout: Layout) -> Movement:
        """The same movement among the nodes of ``layout``, each node one rank holding its ranks' data."""
        raise NotImplementedError

    def contribution(self, layout: Layout, srcs: list[Any], ranks: list[int]) -> Array | None:
        """This node's input to ``between``: from its ranks' inputs ``srcs`` (ranks ``ranks``, in
        rank order; a reduction may be given them reduced already, one array)."""
        raise NotImplementedError

    def take(self, layout: Layout, product: Array, rank: int, dst: Array) -> None:
        """``rank``'s result into ``dst`` from its node's result of ``between``."""
        copy_into(dst, product)

    # -- the host tier --------------------------------------------------------------------------

    def inward(self, host: tuple[int, ...]) -> Movement:
        """The movement among a host's ranks (``host``: their ranks here, the leader first) that
        brings their inputs to the leader as this movement's ``contribution`` wants them."""
        raise NotImplementedError

    def at_leader(self, result: Array | None, own: Array | None) -> list[Any]:
        """(As an ``inward`` movement) the leader's inputs for the contribution: from its result
        and its own input."""
        return [] if result is None else [result]


class Nothing(Movement):
    """No data: the meeting is all (barrier)."""

    __slots__ = ()

    def source_size(self, rank: int) -> int | None:
        return None

    def result_size(self, rank: int) -> int | None:
        return None

    def fuse(self, inputs: list[Any]) -> list[Any]:
        return [None] * self.n

    def own(self, inputs: list[Any], rank: int, dst: Array) -> None:
        """Nothing to write."""

    def run_link(self, strategy: Strategy, link: Link, src: Array | None, dst: Array | None) -> None:
        strategies.barrier(strategy, link)

    def stream(self, pipe: Pipe, src: Any, dst: np.ndarray | None) -> None:
        """A barrier's meeting is the step's own."""

    def between(self, layout: Layout) -> Movement:
        return Nothing(layout.size, self.dtype)

    def contribution(self, layout: Layout, srcs: list[Any], ranks: list[int]) -> Array | None:
        return None

    def inward(self, host: tuple[int, ...]) -> Movement:
        return Nothing(len(host), self.dtype)

    def at_leader(self, result: Array | None, own: Array | None) -> list[Any]:
        return [] if own is None else [own]


class Reduction(Movement):
    """``op`` over every rank's whole array (``total`` elements), to every rank or to ``root``."""

    __slots__ = ("op", "total")
    whole = True

    def __init__(self, n: int, dtype: Any, op: ReduceOp, total: int, root: int | None = None) -> None:
        super().__init__(n, dtype, root)
        self.op = op
        self.total = total

    def source_size(self, rank: int) -> int | None:
        return self.total

    def result_size(self, rank: int) -> int | None:
        return self.total if self.root is None or rank == self.root else None

    def fuse(self, inputs: list[Any]) -> list[Any]:
        return _received(reduce_all(self.op, inputs), self.n, self.root)

    def own(self, inputs: list[Any], rank: int, dst: Array) -> None:
        reduce_all(self.op, inputs, dst)

    def own_bound(self, inputs: list[Any], rank: int, dst: Array) -> Callable[[], Any]:
        first = inputs[0]
        if len(inputs) == 2 and type(first) is np.ndarray and type(dst) is np.ndarray:  # (reduce_all's
            return partial(elementwise(self.op, first), first, inputs[1], dst)  # ufunc, bound)
        return super().own_bound(inputs, rank, dst)

    def shared(self, inputs: list[Any]) -> Any:
        return np.empty_like(inputs[0])

    def part(self, inputs: list[Any], state: Any, rank: int, dst: Array | None) -> None:
        piece = slice_of(state.size, len(inputs), rank)  # every rank reduces its slice of the whole
        reduce_all(self.op, [x[piece] for x in inputs], state[piece])

    def after(self, state: Any, rank: int, dst: Array | None) -> None:
        if dst is not None:
            copy_into(dst, state)

    def run_link(self, strategy: Strategy, link: Link, src: Array | None, dst: Array | None) -> None:
        if self.root is None:
            strategies.all_reduce(strategy, link, src, dst, self.op)
        else:
            strategies.reduce(strategy, link, self.root, src, dst, self.op)

    def stream(self, pipe: Pipe, src: Any, dst: np.ndarray | None) -> None:
        pipe.reduce(src, dst, self.op)

    def between(self, layout: Layout) -> Movement:
        root = None if self.root is None else layout.position[self.root]
        return Reduction(layout.size, self.dtype, self.op, self.total, root)

    def contribution(self, layout: Layout, srcs: list[Any], ranks: list[int]) -> Array | None:
        return reduce_all(self.op, srcs) if len(srcs) > 1 else srcs[0]

    def inward(self, host: tuple[int, ...]) -> Movement:
        return Reduction(len(host), self.dtype, self.op, self.total, 0)


class Copy(Movement):
    """The root's whole array (``total`` elements) to every rank. Before a sourced call is agreed
    across nodes a node may not know its root (None): it contributes nothing."""

    __slots__ = ("total",)
    whole = True

    def __init__(self, n: int, dtype: Any, total: int, root: int | None) -> None:
        super().__init__(n, dtype, root)
        self.total = total

    def source_size(self, rank: int) -> int | None:
        return self.total if rank == self.root else None

    def result_size(self, rank: int) -> int | None:
        return self.total

    def fuse(self, inputs: list[Any]) -> list[Any]:
        assert self.root is not None
        return [inputs[self.root].copy()] * self.n  # a copy: the root may reuse its input at once

    def own(self, inputs: list[Any], rank: int, dst: Array) -> None:
        assert self.root is not None
        if not _same(dst, inputs[self.root]):  # (the root in place)
            copy_into(dst, inputs[self.root])

    def run_link(self, strategy: Strategy, link: Link, src: Array | None, dst: Array | None) -> None:
        assert self.root is not None
        strategies.broadcast(strategy, link, self.root, src if src is not None else dst)
        if src is not None and dst is not None:
            copy_into(dst, src)

    def stream(self, pipe: Pipe, src: Any, dst: np.ndarray | None) -> None:
        assert self.root is not None
        pipe.copy(self.root, src, dst)

    def between(self, layout: Layout) -> Movement:
        root = None if self.root is None else layout.position[self.root]
        return Copy(layout.size, self.dtype, self.total, root)

    def contribution(self, layout: Layout, srcs: list[Any], ranks: list[int]) -> Array | None:
        return next((src for src in srcs if src is not None), None)

    def inward(self, host: tuple[int, ...]) -> Movement:
        return _from_root(self, host, self.total)


def _from_root(movement: Movement, host: tuple[int, ...], total: int) -> Movement:
    """A sourced movement's inward step: the root's array to the host's leader when the root runs
    on this host and does not lead it (the leader has its own, or another host has it)."""
    if movement.root in host[1:]:
        return Copy(len(host), movement.dtype, total, host.index(movement.root))
    return Nothing(len(host), movement.dtype)


class _Blocked(Movement):
    """A movement of one block per rank (``counts[i]`` elements for rank i)."""

    __slots__ = ("counts", "starts")

    def __init__(self, n: int, dtype: Any, counts: Sequence[int], root: int | None = None) -> None:
        super().__init__(n, dtype, root)
        self.counts = tuple(counts)
        self.starts = _starts(self.counts)

    def block(self, rank: int) -> slice:
        return slice(self.starts[rank], self.starts[rank + 1])

    def _node_major(self, layout: Layout, whole: Array) -> Array:
        """``whole`` (blocks in rank order) with its blocks in node-major order (a new array)."""
        if layout.in_order:
            return whole
        return _stacked([whole[self.block(rank)] for rank in layout.order])

    def _within_node(self, layout: Layout, rank: int) -> slice:
        """Where ``rank``'s block lies in its node's product (its node's blocks in rank order)."""
        ranks = layout.ranks_at[layout.position[rank]]
        start = sum(self.counts[r] for r in ranks[: layout.local[rank]])
        return slice(start, start + self.counts[rank])


class Stack(_Blocked):
    """Every rank's block in rank order, to every rank or to ``root``."""

    __slots__ = ()

    def source_size(self, rank: int) -> int | None:
        return self.counts[rank]

    def result_size(self, rank: int) -> int | None:
        return self.starts[-1] if self.root is None or rank == self.root else None

    def fuse(self, inputs: list[Any]) -> list[Any]:
        return _received(_stacked(inputs), self.n, self.root)

    def own(self, inputs: list[Any], rank: int, dst: Array) -> None:
        for k, x in enumerate(inputs):
            copy_into(dst[self.block(k)], x)

    def run_link(self, strategy: Strategy, link: Link, src: Array | None, dst: Array | None) -> None:
        if self.root is None:
            strategies.all_gather(strategy, link, src, dst, _blocks(self.counts))
        else:
            strategies.gather(strategy, link, self.root, src, dst, _blocks(self.counts))

    def stream(self, pipe: Pipe, src: Any, dst: np.ndarray | None) -> None:
        pipe.stack(self.counts, src, dst)

    def between(self, layout: Layout) -> Movement:
        root = None if self.root is None else layout.position[self.root]
        return Stack(layout.size, self.dtype, layout.per_node(self.counts), root)

    def contribution(self, layout: Layout, srcs: list[Any], ranks: list[int]) -> Array | None:
        return array_module(srcs[0]).concatenate(srcs) if len(srcs) > 1 else srcs[0]

    def take(self, layout: Layout, product: Array, rank: int, dst: Array) -> None:
        if layout.in_order:
            copy_into(dst, product)
            return
        at = 0
        for r in layout.order:
            copy_into(dst[self.block(r)], product[at : at + self.counts[r]])
            at += self.counts[r]

    def inward(self, host: tuple[int, ...]) -> Movement:
        return Stack(len(host), self.dtype, [self.counts[rank] for rank in host], 0)

    def at_leader(self, result: Array | None, own: Array | None) -> list[Any]:
        return [] if result is None else [result[self.block(k)] for k in range(self.n)]


class Rows(_Blocked):
    """Block i of the root's array to rank i."""

    __slots__ = ()

    def source_size(self, rank: int) -> int | None:
        return self.starts[-1] if rank == self.root else None

    def result_size(self, rank: int) -> int | None:
        return self.counts[rank]

    def fuse(self, inputs: list[Any]) -> list[Any]:
        assert self.root is not None
        return [inputs[self.root][self.block(rank)].copy() for rank in range(self.n)]

    def own(self, inputs: list[Any], rank: int, dst: Array) -> None:
        assert self.root is not None
        copy_into(dst, inputs[self.root][self.block(rank)])

    def run_link(self, strategy: Strategy, link: Link, src: Array | None, dst: Array | None) -> None:
        assert self.root is not None
        strategies.scatter(strategy, link, self.root, src, dst, _blocks(self.counts))

    def stream(self, pipe: Pipe, src: Any, dst: np.ndarray | None) -> None:
        assert dst is not None
        pipe.split([self.counts if k == self.root else None for k in range(self.n)], src, dst, None)

    def between(self, layout: Layout) -> Movement:
        assert self.root is not None
        return Rows(layout.size, self.dtype, layout.per_node(self.counts), layout.position[self.root])

    def contribution(self, layout: Layout, srcs: list[Any], ranks: list[int]) -> Array | None:
        source = next((src for src in srcs if src is not None), None)
        return None if source is None else self._node_major(layout, source)

    def take(self, layout: Layout, product: Array, rank: int, dst: Array) -> None:
        copy_into(dst, product[self._within_node(layout, rank)])

    def inward(self, host: tuple[int, ...]) -> Movement:
        return _from_root(self, host, self.starts[-1])


class ReducedBlocks(_Blocked):
    """``op`` over every rank's block i (every input holds every rank's block), to rank i."""

    __slots__ = ("op",)

    def __init__(self, n: int, dtype: Any, op: ReduceOp, counts: Sequence[int]) -> None:
        super().__init__(n, dtype, counts)
        self.op = op

    def source_size(self, rank: int) -> int | None:
        return self.starts[-1]

    def result_size(self, rank: int) -> int | None:
        return self.counts[rank]

    def fuse(self, inputs: list[Any]) -> list[Any]:
        total = reduce_all(self.op, inputs)
        return [total[self.block(rank)] for rank in range(self.n)]

    def own(self, inputs: list[Any], rank: int, dst: Array) -> None:
        mine = self.block(rank)
        reduce_all(self.op, [x[mine] for x in inputs], dst)

    def run_link(self, strategy: Strategy, link: Link, src: Array | None, dst: Array | None) -> None:
        strategies.reduce_scatter(strategy, link, src, dst, self.op, _blocks(self.counts))

    def stream(self, pipe: Pipe, src: Any, dst: np.ndarray | None) -> None:
        assert dst is not None
        pipe.split([self.counts] * self.n, src, dst, self.op)

    def between(self, layout: Layout) -> Movement:
        return ReducedBlocks(layout.size, self.dtype, self.op, layout.per_node(self.counts))

    def contribution(self, layout: Layout, srcs: list[Any], ranks: list[int]) -> Array | None:
        total = reduce_all(self.op, srcs) if len(srcs) > 1 else srcs[0]
        return self._node_major(layout, total)

    def take(self, layout: Layout, product: Array, rank: int, dst: Array) -> None:
        copy_into(dst, product[self._within_node(layout, rank)])

    def inward(self, host: tuple[int, ...]) -> Movement:
        return Reduction(len(host), self.dtype, self.op, self.starts[-1], 0)


class Exchange(Movement):
    """Rank r's block j (``matrix[r][j]`` elements) to rank j; a rank's result holds the blocks
    it got in source rank order. Rows of ranks a node does not know yet may be empty: only a
    node's own ranks' rows are read before the call is agreed across nodes."""

    __slots__ = ("matrix",)
    alias_safe = False  # ranks read their input's blocks while results are written

    def __init__(self, n: int, dtype: Any, matrix: Sequence[Sequence[int]]) -> None:
        super().__init__(n, dtype)
        self.matrix = tuple(tuple(row) for row in matrix)

    def _sends(self, rank: int) -> list[int]:
        return _starts(self.matrix[rank])

    def _receives(self, rank: int) -> list[int]:
        return _starts([row[rank] for row in self.matrix])

    def source_size(self, rank: int) -> int | None:
        return sum(self.matrix[rank])

    def result_size(self, rank: int) -> int | None:
        return sum(row[rank] for row in self.matrix)

    def own(self, inputs: list[Any], rank: int, dst: Array) -> None:
        at = self._receives(rank)
        for k, x in enumerate(inputs):
            sends = self._sends(k)
            copy_into(dst[at[k] : at[k + 1]], x[sends[rank] : sends[rank + 1]])

    def run_link(self, strategy: Strategy, link: Link, src: Array | None, dst: Array | None) -> None:
        equal = _equal([size for row in self.matrix for size in row])
        strategies.all_to_all(strategy, link, src, dst, None if equal else self.matrix)

    def stream(self, pipe: Pipe, src: Any, dst: np.ndarray | None) -> None:
        assert dst is not None
        pipe.split(self.matrix, src, dst, None)

    def between(self, layout: Layout) -> Movement:
        m = layout.size
        matrix = [
            [sum(self.matrix[r][j] for r in layout.ranks_at[a] for j in layout.ranks_at[b]) for b in range(m)]
            for a in range(m)
        ]
        return Exchange(m, self.dtype, matrix)

    def contribution(self, layout: Layout, srcs: list[Any], ranks: list[int]) -> Array | None:
        """For every node, for every rank j there (rank order), every local rank's block j."""
        sends = {rank: self._sends(rank) for rank in ranks}
        pieces = [
            src[sends[rank][j] : sends[rank][j + 1]]
            for j in layout.order
            for rank, src in zip(ranks, srcs, strict=True)
        ]
        if not pieces:
            return np.empty(0, self.dtype)
        return array_module(pieces[0]).concatenate(pieces)

    def take(self, layout: Layout, product: Array, rank: int, dst: Array) -> None:
        """The product holds, per source node a (in order), for every rank j of this node, every
        rank of a's block j: this rank's blocks are picked out in source rank order."""
        here = layout.ranks_at[layout.position[rank]]
        at, offsets = 0, {}
        for a in range(layout.size):
            for j in here:
                for r in layout.ranks_at[a]:
                    offsets[(r, j)] = at
                    at += self.matrix[r][j]
        out = self._receives(rank)
        for r in range(self.n):
            start = offsets[(r, rank)]
            copy_into(dst[out[r] : out[r + 1]], product[start : start + self.matrix[r][rank]])

    def inward(self, host: tuple[int, ...]) -> Movement:
        return Stack(len(host), self.dtype, [sum(self.matrix[rank]) for rank in host], 0)
