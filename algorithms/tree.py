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

Block collectives (one block per peer, ordered by peer index; blocks may differ in size). A
subtree's blocks travel together in one message, packed in the subtree's *preorder* (a position,
then its first child's subtree, then its second child's, ...), so each child's part is one
contiguous slice that a parent receives into, or sends from, directly; only the root permutes
blocks to and from peer order (position p is peer (p + root) mod n), and only for subtrees whose
peers are not consecutive::

    gather to position 0, Tree(2), 7 peers          preorder packing, sizes in blocks
        3 ─[3]─> 1 <─[4]─ 4                          1 sends [1 3 4]   (3 blocks)
        5 ─[5]─> 2 <─[6]─ 6                          2 sends [2 5 6]   (3 blocks)
        1 ─[1 3 4]─> 0 <─[2 5 6]─ 2                  0 holds [0 1 3 4 2 5 6] -> peer order

    gather          a peer sends 1 message: its subtree's blocks (the sum of their sizes: sB
                    for s peers of B elements each)
    scatter         the same messages, downwards: a peer receives its subtree's blocks and sends
                    on all but its own
    all_gather      gather to peer 0, then broadcast all N elements (every block) down the heap
    reduce_scatter  reduce the N elements up the heap to peer 0, then scatter from it
    all_to_all      gather every peer's whole src (its row) to peer 0, a subtree's rows in one
                    message; transpose the n x n blocks there (block (i, j): what i sends j);
                    scatter every peer's whole dst (its column) back down the same way
    barrier         an empty message up the heap to peer 0 and back down: 2 x height steps

A subtree whose blocks are all empty still sends its (empty) message, so every schedule sends the
same messages whatever the sizes.
"""

from __future__ import annotations

from collective.algorithms.link import Link, send_signal, wait_signal
from collective.algorithms.ops import (
    Array,
    Blocks,
    Counts,
    ReduceOp,
    array_module,
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
    "children",
    "gather",
    "parent",
    "reduce",
    "reduce_scatter",
    "scatter",
    "subtree",
    "subtree_size",
]


def children(position: int, size: int, arity: int) -> range:
    """Heap positions of the children of ``position`` in a k-ary heap of ``size`` peers."""
    first = position * arity + 1
    return range(min(first, size), min(first + arity, size))


def parent(position: int, arity: int) -> int:
    """Heap position of the parent of ``position`` (> 0)."""
    return (position - 1) // arity


def subtree_size(position: int, size: int, arity: int) -> int:
    """Number of heap positions in the subtree under ``position`` (itself included)."""
    count, first, last = 0, position, position
    while first < size:  # level by level: the subtree's positions on each level are consecutive
        count += min(last, size - 1) - first + 1
        first, last = first * arity + 1, last * arity + arity
    return count


def subtree(position: int, size: int, arity: int) -> list[int]:
    """Heap positions of the subtree under ``position`` in preorder: the block packing order."""
    order: list[int] = []
    pending = [position]
    while pending:
        current = pending.pop()
        order.append(current)
        pending.extend(reversed(children(current, size, arity)))
    return order


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


def _peers(root: int, positions: list[int], size: int) -> list[int]:
    return [(position + root) % size for position in positions]


def _consecutive(peers: list[int]) -> bool:
    return peers == list(range(peers[0], peers[0] + len(peers)))


def gather(
    link: Link, root: int, src: Array, dst: Array | None, arity: int = 2, blocks: Blocks | None = None
) -> None:
    """Block i of ``dst`` on ``root`` = ``src`` of peer i, each subtree's blocks in one message up.

    ``blocks``: where each peer's block lies in ``dst`` (None: every block the size of ``src``).
    """
    n = link.size
    blocks = Blocks.equal(n, src.size) if blocks is None else blocks
    position = (link.rank - root) % n
    below = children(position, n, arity)
    if position != 0:
        up = (parent(position, arity) + root) % n
        if not below:
            link.send(up, src)
            return
        packing = blocks.select(_peers(root, subtree(position, n, arity), n))  # in preorder
        packed = empty(src, packing.total)
        copy_into(packed[packing.of(0)], src)
        offset = 1
        for child in below:
            count = subtree_size(child, n, arity)
            link.recv_into((child + root) % n, packed[packing.span(offset, offset + count)])
            offset += count
        link.send(up, packed)
        return
    assert dst is not None, "the root needs a result buffer"
    copy_into(dst[blocks.of(root)], src)
    for child in below:
        peers = _peers(root, subtree(child, n, arity), n)
        if _consecutive(peers):  # received straight into place
            link.recv_into(peers[0], dst[blocks.span(peers[0], peers[-1] + 1)])
            continue
        packing = blocks.select(peers)
        packed = empty(src, packing.total)
        link.recv_into(peers[0], packed)
        for index, peer in enumerate(peers):
            copy_into(dst[blocks.of(peer)], packed[packing.of(index)])


def scatter(
    link: Link, root: int, src: Array | None, dst: Array, arity: int = 2, blocks: Blocks | None = None
) -> None:
    """``dst`` of peer i = block i of ``src`` on ``root``, each subtree's blocks in one message down.

    ``blocks``: where each peer's block lies in ``src`` (None: every block the size of ``dst``).
    """
    n = link.size
    blocks = Blocks.equal(n, dst.size) if blocks is None else blocks
    position = (link.rank - root) % n
    below = children(position, n, arity)
    if position != 0:
        up = (parent(position, arity) + root) % n
        if not below:
            link.recv_into(up, dst)
            return
        packing = blocks.select(_peers(root, subtree(position, n, arity), n))  # in preorder
        packed = empty(dst, packing.total)
        link.recv_into(up, packed)
        copy_into(dst, packed[packing.of(0)])
        offset = 1
        for child in below:
            count = subtree_size(child, n, arity)
            link.send((child + root) % n, packed[packing.span(offset, offset + count)])
            offset += count
        return
    assert src is not None, "the root needs a source buffer"
    for child in below:
        peers = _peers(root, subtree(child, n, arity), n)
        if _consecutive(peers):  # sent straight from place
            link.send(peers[0], src[blocks.span(peers[0], peers[-1] + 1)])
            continue
        packing = blocks.select(peers)
        packed = empty(dst, packing.total)
        for index, peer in enumerate(peers):
            copy_into(packed[packing.of(index)], src[blocks.of(peer)])
        link.send(peers[0], packed)
    copy_into(dst, src[blocks.of(root)])


def all_gather(link: Link, src: Array, dst: Array, arity: int = 2, blocks: Blocks | None = None) -> None:
    """Gather up the heap to peer 0 into its ``dst``, then broadcast ``dst`` down the heap."""
    gather(link, 0, src, dst, arity, blocks)
    broadcast(link, 0, dst, arity)


def reduce_scatter(
    link: Link, src: Array, dst: Array, op: ReduceOp, arity: int = 2, blocks: Blocks | None = None
) -> None:
    """Reduce the whole ``src`` up the heap to peer 0, then scatter its blocks down the heap."""
    reduced = empty(src, src.size) if link.rank == 0 else None
    reduce(link, 0, src, reduced, op, arity)
    scatter(link, 0, reduced, dst, arity, blocks)


def all_to_all(link: Link, src: Array, dst: Array, arity: int = 2, counts: Counts | None = None) -> None:
    """Gather every peer's ``src`` up the heap to peer 0, transpose its blocks, scatter them down.

    ``counts[r][j]``: the elements peer r sends to peer j (None: ``src.size // n`` each).
    """
    n = link.size
    matrix = count_matrix(counts, n, src.size)
    rows_at, columns_at = row_blocks(matrix), column_blocks(matrix)
    rows = empty(src, rows_at.total) if link.rank == 0 else None  # row i: what peer i sends
    gather(link, 0, src, rows, arity, rows_at)
    columns = None
    if rows is not None:
        columns = empty(src, columns_at.total)  # row j: what peer j receives
        transpose_blocks(rows, columns, n, matrix)
    scatter(link, 0, columns, dst, arity, columns_at)


def barrier(link: Link, arity: int = 2) -> None:
    """An empty message up the heap to peer 0 once the whole subtree has arrived, then back down."""
    n, position = link.size, link.rank
    below = children(position, n, arity)
    for child in below:
        wait_signal(link, child)
    if position != 0:
        send_signal(link, parent(position, arity))
        wait_signal(link, parent(position, arity))
    for child in below:
        send_signal(link, child)
