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
"""

from __future__ import annotations

from collective.algorithms.link import Link
from collective.algorithms.ops import Array, ReduceOp, copy_into

__all__ = ["all_reduce", "broadcast", "reduce"]

CENTER = 0


def reduce(link: Link, root: int, src: Array, dst: Array | None, op: ReduceOp) -> None:
    """``dst = op(src of every peer)`` on ``root`` (``dst`` is ignored elsewhere)."""
    if link.rank != root:
        link.send(root, src)
        return
    assert dst is not None, "the root needs a result buffer"
    operand = src
    for peer in range(link.size):
        if peer != root:
            link.recv_reduce(peer, operand, dst, op)
            operand = dst
    if operand is src:  # a group of one
        copy_into(dst, src)


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
