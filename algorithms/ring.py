"""Ring: bandwidth-optimal all_reduce and block collectives, pipelined chains for rooted ones.

all_reduce = reduce-scatter then all-gather over n chunks of the flat array (chunk sizes
differ by at most one element, so n must not exceed the element count: the dispatcher falls
back to Tree(2) below that). Peer r sends to r+1 and receives from r-1; 4 peers, chunks A-D::

    reduce-scatter, step s: peer r sends chunk (r-s) mod n, receives chunk (r-s-1) mod n
                            and adds its own copy of that chunk into it
    after n-1 steps peer r holds the finished chunk (r+1) mod n:
        peer 0: B   peer 1: C   peer 2: D   peer 3: A
    all-gather, step s:     peer r sends chunk (r+1-s) mod n, receives chunk (r-s) mod n

Messages per peer: 2(n-1) sends and 2(n-1) receives of N/n elements each, so each peer sends
2(n-1)/n of the array whatever n is. Every chunk is reduced in one place and then copied, so
all peers hold the same bits.

reduce and broadcast run as a pipelined chain (root+1 -> root+2 -> ... -> root for reduce,
root -> root+1 -> ... -> root-1 for broadcast), the array cut into segments so that every
link of the chain works at once: each peer sends and/or receives the whole array once, in
ceil(N / segment) messages; latency n-1 + segments - 1 segment-steps.

Block collectives (one block per peer, ordered by peer index; blocks may differ in size, and
each message carries exactly one block, whatever its size, empty ones included)::

    all_gather, step s:      peer r sends block (r-s) mod n right, receives block (r-s-1) mod n
                             (its own block first; after n-1 steps it holds all n), in segments
                             of 4 MiB, each relayed on as soon as it arrived
    reduce_scatter, step s:  peer r sends its partial block (r-s-1) mod n right, receives the
                             partial block (r-s-2) mod n and combines its own block into it;
                             the last step brings block r: shifted by one against all_reduce,
                             so that peer r ends with block r (4 peers: 0 gets A, 1 B, ...)
    all_to_all, step s:      pairwise shifted exchange: peer r sends block (r+s) mod n of its
                             src to peer r+s, receives block (r-s) mod n from peer r-s (s = 1..n-1)
    gather to root:          a chain root+1 -> root+2 -> ... -> root, one block per message:
                             each peer sends its own block, then relays every block it receives
    scatter from root:       a chain root -> root+1 -> ... -> root-1: the root sends the blocks of
                             the farthest peer first; each peer relays all but the last it receives
    barrier:                 dissemination: in round i peer r signals r+2^i and waits for r-2^i
                             (ceil(log2 n) rounds of one empty message)

    reduce_scatter, 4 peers, blocks A B C D of every peer; "D0" is peer 0's block D
      s=0:  0 ─D0─> 1   1 ─A1─> 2   2 ─B2─> 3   3 ─C3─> 0
      s=1:  0 ─C──> 1   1 ─D──> 2   2 ─A──> 3   3 ─B──> 0     (partial results travel on)
      s=2:  0 ─B──> 1   1 ─C──> 2   2 ─D──> 3   3 ─A──> 0     peer 1 finishes B, 2 C, 3 D, 0 A

Per peer: all_gather, reduce_scatter and all_to_all send n-1 messages of one block each in n-1
steps (B elements each for equal blocks; reduce_scatter keeps n-2 partial blocks, each slot sized
for its block, in a scratch buffer, as a sent block must not be written again). Gather: the peer
at chain position p (the head 0, the root n-1) sends p+1 blocks (its own and the p before it);
scatter: the peer p hops from the root sends n-1-p (those of the peers after it). Every link of
the chain carries one block per step, so both take n-1 block-steps, as the root's own link needs
anyway.
"""

from __future__ import annotations

from collective.algorithms.link import Link, send_signal, wait_signal
from collective.algorithms.ops import (
    Array,
    Blocks,
    Counts,
    ReduceOp,
    array_module,
    chunk_bounds,
    copy_into,
    count_matrix,
    empty,
    received_blocks,
    sent_blocks,
)

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
    "segments",
]

DEFAULT_SEGMENT_BYTES = 1 << 20
RELAY_SEGMENT_BYTES = 4 << 20  # all_gather's relayed pieces: few messages, yet no idle link between steps


def segments(array: Array, segment_bytes: int) -> list[slice]:
    """Slices cutting a flat array into pieces of about ``segment_bytes`` (none for an empty array)."""
    length = array.size
    per = max(1, segment_bytes // max(1, array.itemsize))
    return [slice(lo, min(lo + per, length)) for lo in range(0, length, per)]


def all_reduce(link: Link, src: Array, dst: Array, op: ReduceOp) -> None:
    """``dst = op(src of every peer)`` on every peer; needs ``src.size >= link.size``."""
    n, r = link.size, link.rank
    if src.size < n:
        raise ValueError(f"ring all_reduce needs at least {n} elements, got {src.size}: use Tree")
    if n == 1:
        copy_into(dst, src)
        return
    chunk = [slice(lo, hi) for lo, hi in chunk_bounds(src.size, n)]
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        outgoing = (r - step) % n
        incoming = (r - step - 1) % n
        link.send(right, (src if step == 0 else dst)[chunk[outgoing]])
        link.recv_reduce(left, src[chunk[incoming]], dst[chunk[incoming]], op)
    for step in range(n - 1):
        outgoing = (r + 1 - step) % n
        incoming = (r - step) % n
        link.send(right, dst[chunk[outgoing]])
        link.recv_into(left, dst[chunk[incoming]])


def reduce(
    link: Link,
    root: int,
    src: Array,
    dst: Array | None,
    op: ReduceOp,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
) -> None:
    """``dst = op(src of every peer)`` on ``root``, pipelined along root+1 -> ... -> root."""
    n = link.size
    position = (link.rank - root - 1) % n  # 0 = head of the chain, n-1 = the root
    if n == 1:
        assert dst is not None, "the root needs a result buffer"
        copy_into(dst, src)
        return
    previous, following = (link.rank - 1) % n, (link.rank + 1) % n
    if position == 0:
        for piece in segments(src, segment_bytes):
            link.send(following, src[piece])
        return
    if position == n - 1:
        assert dst is not None, "the root needs a result buffer"
        acc = dst
    else:
        acc = array_module(src).empty_like(src)
    for piece in segments(src, segment_bytes):
        link.recv_reduce(previous, src[piece], acc[piece], op)
        if position != n - 1:
            link.send(following, acc[piece])


def broadcast(link: Link, root: int, buf: Array, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
    """Copy ``buf`` of ``root`` into every other peer's ``buf``, pipelined along root -> root+1 -> ..."""
    n = link.size
    position = (link.rank - root) % n  # 0 = the root, n-1 = the tail
    previous, following = (link.rank - 1) % n, (link.rank + 1) % n
    for piece in segments(buf, segment_bytes):
        if position != 0:
            link.recv_into(previous, buf[piece])
        if position != n - 1:
            link.send(following, buf[piece])


def all_gather(
    link: Link, src: Array, dst: Array, blocks: Blocks | None = None, segment_bytes: int = RELAY_SEGMENT_BYTES
) -> None:
    """Block i of ``dst`` = ``src`` of peer i on every peer: each block travels n-1 hops to the right.

    ``blocks``: where each peer's block lies in ``dst`` (None: every block the size of ``src``).
    Blocks travel in segments of about ``segment_bytes``, each relayed as soon as it arrived, so a
    peer's link never waits for a whole block between steps.
    """
    n, r = link.size, link.rank
    blocks = Blocks.equal(n, src.size) if blocks is None else blocks
    right, left = (r + 1) % n, (r - 1) % n
    if n > 1:  # its own block leaves first, from src: copying it into dst overlaps the sending
        for piece in _pieces(src, segment_bytes):
            link.send(right, src[piece])
    copy_into(dst[blocks.of(r)], src)
    for step in range(n - 1):
        block = dst[blocks.of((r - step - 1) % n)]
        for piece in _pieces(block, segment_bytes):
            link.recv_into(left, block[piece])
            if step < n - 2:
                link.send(right, block[piece])


def _pieces(block: Array, segment_bytes: int) -> list[slice]:
    """The segments a block travels in: at least one message, an empty block's included."""
    return segments(block, segment_bytes) or [slice(0, 0)]


def reduce_scatter(link: Link, src: Array, dst: Array, op: ReduceOp, blocks: Blocks | None = None) -> None:
    """``dst`` of peer r = op over every peer's block r of ``src``, each block reduced along the ring.

    ``blocks``: where each peer's block lies in ``src`` (None: every block the size of ``dst``).
    """
    n, r = link.size, link.rank
    if n == 1:
        copy_into(dst, src)
        return
    blocks = Blocks.equal(n, dst.size) if blocks is None else blocks
    right, left = (r + 1) % n, (r - 1) % n
    incoming = [(r - step - 2) % n for step in range(n - 1)]  # == r at the last step
    slots = blocks.select(incoming[:-1])  # one slot per step, sized for its block: a sent partial
    partials = empty(dst, slots.total)  # is never rewritten
    outgoing = src[blocks.of((r - 1) % n)]
    for step in range(n - 1):
        out = dst if step == n - 2 else partials[slots.of(step)]
        link.send(right, outgoing)
        link.recv_reduce(left, src[blocks.of(incoming[step])], out, op)
        outgoing = out


def all_to_all(link: Link, src: Array, dst: Array, counts: Counts | None = None) -> None:
    """Block j of ``src`` to peer j, block i of ``dst`` from peer i: at step s, peer r+s and r-s.

    ``counts[r][j]``: the elements peer r sends to peer j (None: ``src.size // n`` each).
    """
    n, r = link.size, link.rank
    matrix = count_matrix(counts, n, src.size)
    sending, receiving = sent_blocks(matrix, r), received_blocks(matrix, r)
    copy_into(dst[receiving.of(r)], src[sending.of(r)])
    for step in range(1, n):
        to, source = (r + step) % n, (r - step) % n
        link.send(to, src[sending.of(to)])
        link.recv_into(source, dst[receiving.of(source)])


def gather(link: Link, root: int, src: Array, dst: Array | None, blocks: Blocks | None = None) -> None:
    """Block i of ``dst`` on ``root`` = ``src`` of peer i, relayed block by block along the chain.

    ``blocks``: where each peer's block lies in ``dst`` (None: every block the size of ``src``).
    """
    n, r = link.size, link.rank
    blocks = Blocks.equal(n, src.size) if blocks is None else blocks
    position = (r - root - 1) % n  # 0 = head of the chain (root+1), n-1 = the root
    previous, following = (r - 1) % n, (r + 1) % n
    if position != n - 1:
        link.send(following, src)
        # the blocks of the peers before this one, nearest first: r-1, r-2, ..., the head
        relaying = blocks.select((r - 1 - index) % n for index in range(position))
        relay = empty(src, relaying.total)
        for index in range(position):
            link.recv_into(previous, relay[relaying.of(index)])
            link.send(following, relay[relaying.of(index)])
        return
    assert dst is not None, "the root needs a result buffer"
    copy_into(dst[blocks.of(root)], src)
    for hops in range(1, n):  # blocks arrive nearest first: from root-1, root-2, ..., root+1
        link.recv_into(previous, dst[blocks.of((root - hops) % n)])


def scatter(link: Link, root: int, src: Array | None, dst: Array, blocks: Blocks | None = None) -> None:
    """``dst`` of peer i = block i of ``src`` on ``root``, relayed block by block along the chain.

    ``blocks``: where each peer's block lies in ``src`` (None: every block the size of ``dst``).
    """
    n, r = link.size, link.rank
    blocks = Blocks.equal(n, dst.size) if blocks is None else blocks
    position = (r - root) % n  # 0 = the root, n-1 = the tail
    previous, following = (r - 1) % n, (r + 1) % n
    if position != 0:
        # the blocks of the peers after this one, farthest first: root-1, root-2, ..., r+1
        relaying = blocks.select((root - 1 - index) % n for index in range(n - 1 - position))
        relay = empty(dst, relaying.total)
        for index in range(n - 1 - position):
            link.recv_into(previous, relay[relaying.of(index)])
            link.send(following, relay[relaying.of(index)])
        link.recv_into(previous, dst)
        return
    assert src is not None, "the root needs a source buffer"
    for hops in range(n - 1, 0, -1):  # the farthest peer's block first
        link.send(following, src[blocks.of((root + hops) % n)])
    copy_into(dst, src[blocks.of(root)])


def barrier(link: Link) -> None:
    """Dissemination barrier: after round i a peer has heard (indirectly) from the 2^(i+1) peers before it."""
    n, r = link.size, link.rank
    distance = 1
    while distance < n:
        send_signal(link, (r + distance) % n)
        wait_signal(link, (r - distance) % n)
        distance *= 2
