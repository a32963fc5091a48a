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

The block collectives (blocks of B elements, ordered by peer) use the same star, center = peer 0
or the root::

    gather / scatter      the root receives / sends block i from / to peer i      1 step
    all_gather            gather to 0, then 0 sends all n blocks to everyone       2 steps
    reduce_scatter        reduce the n blocks to 0, then scatter them              2 steps
    all_to_all            gather every peer's n blocks to 0, transpose, scatter    2 steps
    barrier               an empty message to 0 from everyone, then 0 to everyone  2 steps

Per non-center peer: 1 message out and (all_* / reduce_scatter / barrier) 1 in: B elements out for
gather and all_gather, nB for reduce_scatter and all_to_all; nB in for all_gather and all_to_all,
B for reduce_scatter and scatter. The center sends n-1 and receives n-1 of those.
"""

from __future__ import annotations

from collective.algorithms.link import Link, reduce_received, send_signal, wait_signal
from collective.algorithms.ops import (
    Array,
    ReduceOp,
    block,
    copy_into,
    empty_blocks,
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


def gather(link: Link, root: int, src: Array, dst: Array | None) -> None:
    """Block i of ``dst`` on ``root`` = ``src`` of peer i; every other peer sends its ``src`` to the root."""
    if link.rank != root:
        link.send(root, src)
        return
    assert dst is not None, "the root needs a result buffer"
    length = src.size
    copy_into(dst[block(root, length)], src)
    for peer in range(link.size):
        if peer != root:
            link.recv_into(peer, dst[block(peer, length)])


def scatter(link: Link, root: int, src: Array | None, dst: Array) -> None:
    """``dst`` of peer i = block i of ``src`` on ``root``, sent straight from the root."""
    if link.rank != root:
        link.recv_into(root, dst)
        return
    assert src is not None, "the root needs a source buffer"
    length = dst.size
    for peer in range(link.size):
        if peer != root:
            link.send(peer, src[block(peer, length)])
    copy_into(dst, src[block(root, length)])


def all_gather(link: Link, src: Array, dst: Array) -> None:
    """Gather every peer's block into ``dst`` of the center, which sends the whole of it to everyone."""
    gather(link, CENTER, src, dst)
    broadcast(link, CENTER, dst)


def reduce_scatter(link: Link, src: Array, dst: Array, op: ReduceOp) -> None:
    """Reduce the whole ``src`` to the center (in peer order), which sends block i to peer i."""
    reduced = empty_blocks(src, 1, src.size) if link.rank == CENTER else None
    reduce(link, CENTER, src, reduced, op)
    scatter(link, CENTER, reduced, dst)


def all_to_all(link: Link, src: Array, dst: Array) -> None:
    """Gather every peer's ``src`` to the center, transpose its blocks there, scatter the result."""
    n = link.size
    rows = empty_blocks(src, n, src.size) if link.rank == CENTER else None  # row i: what peer i sends
    gather(link, CENTER, src, rows)
    columns = None
    if rows is not None:
        columns = empty_blocks(src, n, src.size)  # row j: what peer j receives
        transpose_blocks(rows, columns, n)
    scatter(link, CENTER, columns, dst)


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
