"""Centralized: every peer sends to one central peer, which reduces and (for all_reduce) sends back.

all_reduce on 4 peers, center 0::

    step 1 (reduce)          step 2 (fan out)
    1 ──x1──┐                ┌──y──> 1
    2 ──x2──┼──> 0: y = x0+x1+x2+x3 ──y──> 2
    3 ──x3──┘                └──y──> 3

Messages per peer: a non-center peer sends 1 and receives 1 (all_reduce) or sends 1 (reduce)
or receives 1 (broadcast); the center receives n-1 and/or sends n-1, each of the whole array.
Latency: 2 steps, but the center's link carries 2(n-1) arrays, so it is bandwidth-poor.
The center reduces in peer-index order, so the result does not depend on arrival order.

The block collectives (one block per peer, ordered by peer; blocks may differ in size, B_i
elements for peer i, N = the sum of them) use the same star, center = peer 0 or the root::

    gather / scatter      the root receives / sends block i from / to peer i      1 step
    all_gather            gather to 0, then 0 sends all n blocks to everyone       2 steps
    reduce_scatter        reduce the n blocks to 0, then scatter them              2 steps
    all_to_all            gather every peer's n blocks to 0, transpose, scatter    2 steps
    barrier               an empty message to 0 from everyone, then 0 to everyone  2 steps

Per non-center peer i: 1 message out and (all_* / reduce_scatter / barrier) 1 in: B_i elements out
for gather and all_gather, N for reduce_scatter, its whole src (row i) for all_to_all; N in for
all_gather, B_i for reduce_scatter and scatter, its whole dst (column i) for all_to_all. The center
sends n-1 and receives n-1 of those. Equal blocks (``blocks=None``): B_i = B, N = nB.
"""

from __future__ import annotations

from collective.algorithms.link import Link, reduce_received, send_signal, wait_signal
from collective.algorithms.ops import (
    Array,
    Blocks,
    Counts,
    ReduceOp,
    column_blocks,
    copy_into,
    count_matrix,
    empty,
    row_blocks,
    transpose_blocks,
)

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
]

CENTER = 0


def reduce(link: Link, root: int, src: Array, dst: Array | None, op: ReduceOp) -> None:
    """``dst = op(src of every peer)`` on ``root`` (``dst`` is ignored elsewhere)."""
    if link.rank != root:
        link.send(root, src)
        return
    assert dst is not None, "the root needs a result buffer"
    reduce_received(link, src, dst, op)  # in peer order, whichever peer is the root


def broadcast(link: Link, root: int, buf: Array) -> None:
    """Copy ``buf`` of ``root`` into ``buf`` of every other peer."""
    if link.rank == root:
        for peer in range(link.size):
            if peer != root:
                link.send(peer, buf)
    else:
        link.recv_into(root, buf)


def all_reduce(link: Link, src: Array, dst: Array, op: ReduceOp) -> None:
    """``dst = op(src of every peer)`` on every peer, bit-identical everywhere."""
    reduce(link, CENTER, src, dst, op)
    broadcast(link, CENTER, dst)


def gather(link: Link, root: int, src: Array, dst: Array | None, blocks: Blocks | None = None) -> None:
    """Block i of ``dst`` on ``root`` = ``src`` of peer i; every other peer sends its ``src`` to the root.

    ``blocks``: where each peer's block lies in ``dst`` (None: every block the size of ``src``).
    """
    if link.rank != root:
        link.send(root, src)
        return
    assert dst is not None, "the root needs a result buffer"
    blocks = Blocks.equal(link.size, src.size) if blocks is None else blocks
    copy_into(dst[blocks.of(root)], src)
    for peer in range(link.size):
        if peer != root:
            link.recv_into(peer, dst[blocks.of(peer)])


def scatter(link: Link, root: int, src: Array | None, dst: Array, blocks: Blocks | None = None) -> None:
    """``dst`` of peer i = block i of ``src`` on ``root``, sent straight from the root.

    ``blocks``: where each peer's block lies in ``src`` (None: every block the size of ``dst``).
    """
    if link.rank != root:
        link.recv_into(root, dst)
        return
    assert src is not None, "the root needs a source buffer"
    blocks = Blocks.equal(link.size, dst.size) if blocks is None else blocks
    for peer in range(link.size):
        if peer != root:
            link.send(peer, src[blocks.of(peer)])
    copy_into(dst, src[blocks.of(root)])


def all_gather(link: Link, src: Array, dst: Array, blocks: Blocks | None = None) -> None:
    """Gather every peer's block into ``dst`` of the center, which sends the whole of it to everyone."""
    gather(link, CENTER, src, dst, blocks)
    broadcast(link, CENTER, dst)


def reduce_scatter(link: Link, src: Array, dst: Array, op: ReduceOp, blocks: Blocks | None = None) -> None:
    """Reduce the whole ``src`` to the center (in peer order), which sends block i to peer i."""
    reduced = empty(src, src.size) if link.rank == CENTER else None
    reduce(link, CENTER, src, reduced, op)
    scatter(link, CENTER, reduced, dst, blocks)


def all_to_all(link: Link, src: Array, dst: Array, counts: Counts | None = None) -> None:
    """Gather every peer's ``src`` to the center, transpose its blocks there, scatter the result.

    ``counts[r][j]``: the elements peer r sends to peer j (None: ``src.size // n`` each).
    """
    n = link.size
    matrix = count_matrix(counts, n, src.size)
    rows_at, columns_at = row_blocks(matrix), column_blocks(matrix)
    rows = empty(src, rows_at.total) if link.rank == CENTER else None  # row i: what peer i sends
    gather(link, CENTER, src, rows, rows_at)
    columns = None
    if rows is not None:
        columns = empty(src, columns_at.total)  # row j: what peer j receives
        transpose_blocks(rows, columns, n, matrix)
    scatter(link, CENTER, columns, dst, columns_at)


def barrier(link: Link) -> None:
    """Every peer signals the center; the center, having heard from all, releases everyone."""
    others = [peer for peer in range(link.size) if peer != CENTER]
    if link.rank != CENTER:
        send_signal(link, CENTER)
        wait_signal(link, CENTER)
        return
    for peer in others:
        wait_signal(link, peer)
    for peer in others:
        send_signal(link, peer)
