"""Where the ranks of a group live across nodes, and the padded node-major order of their blocks.

Nodes may hold different numbers of a group's peers, in any rank order. The global phase of a
collective works node by node on equal blocks: each node's part is laid out as ``width`` blocks
(the most ranks any node holds), its ranks' blocks first in rank order, then padding. ``slots``
gives every rank its block's place in that node-major order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """Where the ranks of a group live: node positions, local indices, the padded width."""

    nodes: tuple[int, ...]  # node indices holding members, ascending: position p is nodes[p]
    position: tuple[int, ...]  # per rank: its node's position
    local: tuple[int, ...]  # per rank: its index among its node's ranks
    width: int  # the most ranks any node holds (L)
    me: int  # this node's position

    @classmethod
    def of(cls, members: tuple[int, ...], node_of: dict[int, int], me: int) -> Layout:
        nodes = tuple(sorted({node_of[peer] for peer in members}))
        position = tuple(nodes.index(node_of[peer]) for peer in members)
        counts = [0] * len(nodes)
        local = []
        for p in position:
            local.append(counts[p])
            counts[p] += 1
        return cls(nodes, position, tuple(local), max(counts), nodes.index(me))

    @property
    def slots(self) -> np.ndarray:
        """Per rank: its block's index in node-major padded order."""
        return np.asarray(self.position, np.int64) * self.width + np.asarray(self.local, np.int64)
