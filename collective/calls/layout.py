"""Where the ranks of a group live across nodes, and the node-major order of their blocks.

Nodes may hold different numbers of a group's peers, in any rank order. The global phase of a
collective works node by node: each node's part of the data is its ranks' blocks in rank order
(node-major order: node 0's ranks, then node 1's, ...), and the blocks may be of any sizes, so no
node is padded to another's size. ``order`` is that node-major order of the ranks; ``in_order``
says it is rank order itself (ranks numbered node by node, the usual case), where taking a
rank's data out of a node-level product needs no reordering.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """Where the ranks of a group live: node positions and local indices, and this node's position."""

    nodes: tuple[int, ...]  # node indices holding members, ascending: position p is nodes[p]
    position: tuple[int, ...]  # per rank: its node's position
    local: tuple[int, ...]  # per rank: its index among its node's ranks
    me: int  # this node's position
    ranks_at: tuple[tuple[int, ...], ...] = field(init=False)  # per position: its ranks, in rank order
    order: tuple[int, ...] = field(init=False)  # the ranks in node-major order
    in_order: bool = field(init=False)  # node-major order is rank order

    def __post_init__(self) -> None:
        at: list[list[int]] = [[] for _ in self.nodes]
        for rank, p in enumerate(self.position):
            at[p].append(rank)
        order = tuple(rank for ranks in at for rank in ranks)
        object.__setattr__(self, "ranks_at", tuple(map(tuple, at)))
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "in_order", order == tuple(range(len(order))))

    @classmethod
    def of(cls, members: tuple[int, ...], node_of: dict[int, int], me: int) -> Layout:
        nodes = tuple(sorted({node_of[peer] for peer in members}))
        position = tuple(nodes.index(node_of[peer]) for peer in members)
        counts = [0] * len(nodes)
        local = []
        for p in position:
            local.append(counts[p])
            counts[p] += 1
        return cls(nodes, position, tuple(local), nodes.index(me))

    @property
    def size(self) -> int:
        """The number of nodes."""
        return len(self.nodes)

    def per_node(self, counts: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """Per node position: the sum of ``counts`` (one per rank) over its ranks."""
        return tuple(sum(counts[rank] for rank in ranks) for ranks in self.ranks_at)
