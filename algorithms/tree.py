"""Tree(k): peers form a k-ary heap rooted at the root; reduce flows up, broadcast flows down.

Heap positions are taken relative to the root (position = (index - root) mod n), so any peer
can be the root. Position p has children p*k+1 .. p*k+k and parent (p-1)//k. Tree(2), 7 peers::

               0                 reduce: each peer combines its children's partial results
             /   \\                       with its own array and sends one array up
            1     2              broadcast: each peer receives from its parent and forwards
           / \\   / \\                       to its children
          3   4 5   6

Messages per peer: at most k received and 1 sent (reduce), 1 received and at most k sent
(broadcast); each of the whole array. Height ceil(log_k(n(k-1)+1)) - 1 hops each way (n-1 for
k=1), so small arrays are latency-bound on the height, large ones on the k sends of a node.
Tree(1) is a chain. Children are combined in position order, so results are deterministic.
"""

from __future__ import annotations

from collective.algorithms.link import Link
from collective.algorithms.ops import Array, ReduceOp, array_module, copy_into

__all__ = ["all_reduce", "broadcast", "children", "parent", "reduce"]


def children(position: int, size: int, arity: int) -> range:
    """Heap positions of the children of ``position`` in a k-ary heap of ``size`` peers."""
    first = position * arity + 1
    return range(min(first, size), min(first + arity, size))


def parent(position: int, arity: int) -> int:
    """Heap position of the parent of ``position`` (> 0)."""
    return (position - 1) // arity


def _reduce_up(link: Link, root: int, arity: int, src: Array, acc: Array | None, op: ReduceOp) -> Array:
    """Combine this peer's subtree into ``acc`` (allocated if None) and send it to the parent.

    Returns the buffer holding the subtree's result (``src`` itself for a leaf).
    """
    n = link.size
    position = (link.rank - root) % n
    result = src
    for child in children(position, n, arity):
        if acc is None:
            acc = array_module(src).empty_like(src)
        link.recv_reduce((child + root) % n, result, acc, op)
        result = acc
    if position != 0:
        link.send((parent(position, arity) + root) % n, result)
    return result


def reduce(link: Link, root: int, src: Array, dst: Array | None, op: ReduceOp, arity: int = 2) -> None:
    """``dst = op(src of every peer)`` on ``root``; other peers need no ``dst``."""
    result = _reduce_up(link, root, arity, src, dst if link.rank == root else None, op)
    if link.rank == root:
        assert dst is not None, "the root needs a result buffer"
        copy_into(dst, result)


def broadcast(link: Link, root: int, buf: Array, arity: int = 2) -> None:
    """Copy ``buf`` of ``root`` into ``buf`` of every other peer, down the heap."""
    n = link.size
    position = (link.rank - root) % n
    if position != 0:
        link.recv_into((parent(position, arity) + root) % n, buf)
    for child in children(position, n, arity):
        link.send((child + root) % n, buf)


def all_reduce(link: Link, src: Array, dst: Array, op: ReduceOp, arity: int = 2) -> None:
    """Reduce to position 0 (index 0), then broadcast from it; ``dst`` doubles as the partial sum.

    A peer sends its partial ``dst`` up and later receives the result into ``dst``: the parent has
    consumed the partial before it sends the result down (Link ownership rule 2).
    """
    result = _reduce_up(link, 0, arity, src, dst, op)
    if link.rank == 0:
        copy_into(dst, result)
    broadcast(link, 0, dst, arity)
