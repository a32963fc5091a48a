"""Ring: bandwidth-optimal all_reduce, and pipelined chains for reduce and broadcast.

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
"""

from __future__ import annotations

from collective.algorithms.link import Link
from collective.algorithms.ops import Array, ReduceOp, array_module, chunk_bounds, copy_into

__all__ = ["DEFAULT_SEGMENT_BYTES", "all_reduce", "broadcast", "reduce", "segments"]

DEFAULT_SEGMENT_BYTES = 1 << 20


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
