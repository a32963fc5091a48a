"""Direct: reduce-scatter and all-gather with every chunk sent straight to its owner.

The flat array is cut into n chunks (sizes within one element, as for Ring); peer j owns chunk j.
Where Ring passes partial chunks around the ring in 2(n-1) dependent steps, Direct sends each
chunk to its owner at once, so every phase is a single round::

    reduce-scatter: every peer r sends chunk j of its array to peer j (for every j != r);
                    peer j combines the n-1 chunks it receives with its own chunk j,
                    in peer order (deterministic)
    all-gather:     every peer j sends its finished chunk j to every other peer

Messages per peer: n-1 sends and n-1 receives per phase, of N/n elements each, so each peer sends
2(n-1)/n of the array, exactly as Ring, but in 2 rounds instead of 2(n-1). Between threads of
one process the "sends" are references, so a peer reads every other peer's chunk straight from
its memory, as a hand-written shared-memory all_reduce does. Over a network all n-1 messages of
a phase are in flight at once (an all-to-all), which suits a few nodes.

reduce: the reduce-scatter, then every owner sends its finished chunk to the root (a gather).
broadcast: the root sends chunk j to peer j (a scatter), then the all-gather (the root sends its
own chunk to everyone): the root sends 2(n-1)/n of the array, every other peer (n-2)/n.
Every chunk is reduced in one place and then copied, so all peers hold the same bits. Fewer
elements than peers: the dispatcher falls back to Tree(2), as for Ring.
"""

from __future__ import annotations

from collective.algorithms.link import Link
from collective.algorithms.ops import Array, ReduceOp, array_module, chunk_bounds, copy_into

__all__ = ["all_reduce", "broadcast", "reduce"]


def _chunks(length: int, peers: int) -> list[slice]:
    if length < peers:
        raise ValueError(f"direct needs at least {peers} elements, got {length}: use Tree")
    return [slice(lo, hi) for lo, hi in chunk_bounds(length, peers)]


def _reduce_scatter(link: Link, src: Array, mine: Array, op: ReduceOp, chunk: list[slice]) -> None:
    """mine = op over every peer's chunk r (r = this peer); ``mine`` has the size of chunk r."""
    n, r = link.size, link.rank
    for peer in range(n):
        if peer != r:
            link.send(peer, src[chunk[peer]])
    operand = src[chunk[r]]
    for peer in range(n):
        if peer != r:
            link.recv_reduce(peer, operand, mine, op)
            operand = mine
    if n == 1:
        copy_into(mine, src)


def _all_gather(link: Link, dst: Array, chunk: list[slice]) -> None:
    """Every peer's chunk of ``dst`` everywhere (each peer holds its own chunk already)."""
    n, r = link.size, link.rank
    for peer in range(n):
        if peer != r:
            link.send(peer, dst[chunk[r]])
    for peer in range(n):
        if peer != r:
            link.recv_into(peer, dst[chunk[peer]])


def all_reduce(link: Link, src: Array, dst: Array, op: ReduceOp) -> None:
    """``dst = op(src of every peer)`` on every peer; needs ``src.size >= link.size``."""
    chunk = _chunks(src.size, link.size)
    _reduce_scatter(link, src, dst[chunk[link.rank]], op, chunk)
    _all_gather(link, dst, chunk)


def reduce(link: Link, root: int, src: Array, dst: Array | None, op: ReduceOp) -> None:
    """``dst = op(src of every peer)`` on ``root``; other peers reduce their chunk in a scratch buffer."""
    n, r = link.size, link.rank
    chunk = _chunks(src.size, n)
    if r != root:  # reduce this peer's chunk in a chunk-sized buffer and send it to the root
        mine = array_module(src).empty_like(src[chunk[r]])
        _reduce_scatter(link, src, mine, op, chunk)
        link.send(root, mine)
        return
    assert dst is not None, "the root needs a result buffer"
    _reduce_scatter(link, src, dst[chunk[r]], op, chunk)
    for peer in range(n):
        if peer != r:
            link.recv_into(peer, dst[chunk[peer]])


def broadcast(link: Link, root: int, buf: Array) -> None:
    """Scatter the root's chunks to their owners, then all-gather them (the root's own chunk too)."""
    n, r = link.size, link.rank
    chunk = _chunks(buf.size, n)
    others = [peer for peer in range(n) if peer not in (r, root)]
    if r == root:
        for peer in range(n):
            if peer != root:
                link.send(peer, buf[chunk[peer]])  # scatter
        for peer in range(n):
            if peer != root:
                link.send(peer, buf[chunk[root]])  # the root's part of the all-gather
        return
    link.recv_into(root, buf[chunk[r]])
    for peer in others:
        link.send(peer, buf[chunk[r]])
    link.recv_into(root, buf[chunk[root]])
    for peer in others:
        link.recv_into(peer, buf[chunk[peer]])
