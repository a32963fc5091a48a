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

Block collectives (one block per peer, ordered by peer index; blocks may differ in size): every
block goes straight to the peer that wants it, in one round::

    all_gather:      peer r sends its block to every other peer; block i arrives from peer i
    reduce_scatter:  peer r sends its block j to peer j; peer j combines the n blocks j in
                     peer order 0, 1, ..., n-1 (its own at its turn): bit-identical to a
                     sequential reduction over the peers
    all_to_all:      peer r sends its block j (counts[r][j] elements) to peer j; block i of dst
                     arrives from peer i
    barrier:         an empty message from every peer to every other peer
    gather/scatter:  the dispatcher runs Centralized's, which is this very schedule (every peer
                     talks straight to the root)

Per peer: n-1 messages out and n-1 in, one block each (B elements for equal blocks; 0 elements
for the barrier), 1 round.
"""

from __future__ import annotations

from collective.algorithms.link import Link, reduce_received, send_signal, wait_signal
from collective.algorithms.ops import (
    Array,
    Blocks,
    Counts,
    ReduceOp,
    array_module,
    chunk_bounds,
    combine,
    copy_into,
    count_matrix,
    received_blocks,
    sent_blocks,
)

__all__ = ["all_gather", "all_reduce", "all_to_all", "barrier", "broadcast", "reduce", "reduce_scatter"]


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
    reduce_received(link, src[chunk[r]], mine, op)  # in peer order


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


def all_gather(link: Link, src: Array, dst: Array, blocks: Blocks | None = None) -> None:
    """Block i of ``dst`` = ``src`` of peer i on every peer, each sent straight by its owner.

    ``blocks``: where each peer's block lies in ``dst`` (None: every block the size of ``src``).
    """
    n, r = link.size, link.rank
    blocks = Blocks.equal(n, src.size) if blocks is None else blocks
    for peer in range(n):
        if peer != r:
            link.send(peer, src)
    copy_into(dst[blocks.of(r)], src)
    for peer in range(n):
        if peer != r:
            link.recv_into(peer, dst[blocks.of(peer)])


def reduce_scatter(link: Link, src: Array, dst: Array, op: ReduceOp, blocks: Blocks | None = None) -> None:
    """``dst`` of peer r = op over block r of every peer's ``src``, combined in peer order 0 .. n-1.

    ``blocks``: where each peer's block lies in ``src`` (None: every block the size of ``dst``).
    ``dst`` must not overlap ``src``: it holds the running result before this peer's turn.
    """
    n, r = link.size, link.rank
    blocks = Blocks.equal(n, dst.size) if blocks is None else blocks
    for peer in range(n):
        if peer != r:
            link.send(peer, src[blocks.of(peer)])
    mine = src[blocks.of(r)]
    if r == 0:
        copy_into(dst, mine)
    for peer in range(n):
        if peer == r:
            if peer != 0:
                combine(op, dst, mine, dst)
        elif peer == 0:
            link.recv_into(peer, dst)
        else:
            link.recv_reduce(peer, dst, dst, op)


def all_to_all(link: Link, src: Array, dst: Array, counts: Counts | None = None) -> None:
    """Block j of ``src`` straight to peer j; block i of ``dst`` straight from peer i (one round).

    ``counts[r][j]``: the elements peer r sends to peer j (None: ``src.size // n`` each).
    """
    n, r = link.size, link.rank
    matrix = count_matrix(counts, n, src.size)
    sending, receiving = sent_blocks(matrix, r), received_blocks(matrix, r)
    for peer in range(n):
        if peer != r:
            link.send(peer, src[sending.of(peer)])
    copy_into(dst[receiving.of(r)], src[sending.of(r)])
    for peer in range(n):
        if peer != r:
            link.recv_into(peer, dst[receiving.of(peer)])


def barrier(link: Link) -> None:
    """Every peer signals every other peer and waits until it has heard from all of them."""
    others = [peer for peer in range(link.size) if peer != link.rank]
    for peer in others:
        send_signal(link, peer)
    for peer in others:
        wait_signal(link, peer)
