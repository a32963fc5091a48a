"""The textbook cost of every block-collective schedule: messages and bytes each peer sends.

Computed from the schedules' definitions (docs/algorithms), independently of the algorithms'
code: the heap helpers here walk parents instead of reusing tree.py's.
"""

from __future__ import annotations

from collections.abc import Callable

from collective.algorithms.strategies import Centralized, Direct, Ring, Strategy, Tree

__all__ = ["Traffic", "expected_traffic", "in_subtree", "subtree_size"]

Traffic = list[tuple[int, int]]  # (messages sent, bytes sent) per peer


def in_subtree(position: int, candidate: int, arity: int) -> bool:
    while candidate > position:
        candidate = (candidate - 1) // arity
    return candidate == position


def subtree_size(position: int, n: int, arity: int) -> int:
    return sum(in_subtree(position, q, arity) for q in range(n))


def _children(position: int, n: int, arity: int) -> list[int]:
    return [q for q in range(1, n) if (q - 1) // arity == position]


def _tree_traffic(
    n: int,
    root: int,
    arity: int,
    up: Callable[[int], int] | None = None,
    down: Callable[[int], int] | None = None,
) -> Traffic:
    """Per peer at heap position p: one message of ``up(p)`` bytes to its parent (but the root) and
    one of ``down(c)`` bytes to each child c; a direction given as None carries nothing."""
    out = []
    for rank in range(n):
        position = (rank - root) % n
        sizes = [up(position)] if up is not None and position else []
        if down is not None:
            sizes += [down(child) for child in _children(position, n, arity)]
        out.append((len(sizes), sum(sizes)))
    return out


def expected_traffic(collective: str, strategy: Strategy, n: int, block_bytes: int, root: int = 0) -> Traffic:
    b = block_bytes
    star_out = [(n - 1, (n - 1) * b)]  # the center/root of a star, sending one block to every peer
    pairs = [(n - 1, (n - 1) * b)] * n
    match collective, strategy:
        case (("all_gather" | "reduce_scatter" | "all_to_all"), (Ring() | Direct())):
            return pairs
        case "all_gather", Centralized():
            return [(n - 1, (n - 1) * n * b)] + [(1, b)] * (n - 1)
        case "all_gather", Tree(arity):  # tree gather (s blocks up), then broadcast of n blocks down
            return _tree_traffic(n, 0, arity, lambda p: subtree_size(p, n, arity) * b, lambda c: n * b)
        case "reduce_scatter", Centralized():
            return star_out + [(1, n * b)] * (n - 1)
        case "reduce_scatter", Tree(arity):  # reduce n blocks up, scatter s blocks down
            return _tree_traffic(n, 0, arity, lambda p: n * b, lambda c: subtree_size(c, n, arity) * b)
        case "all_to_all", Centralized():
            return [(n - 1, (n - 1) * n * b)] + [(1, n * b)] * (n - 1)
        case "all_to_all", Tree(arity):  # s rows of n blocks up, then s rows of n blocks down
            rows = [subtree_size(p, n, arity) * n * b for p in range(n)]
            return _tree_traffic(n, 0, arity, rows.__getitem__, rows.__getitem__)
        case "gather", (Centralized() | Direct()):
            return [(0, 0) if rank == root else (1, b) for rank in range(n)]
        case "gather", Tree(arity):
            return _tree_traffic(n, root, arity, up=lambda p: subtree_size(p, n, arity) * b)
        case "gather", Ring():  # chain root+1 -> ... -> root: position p relays p blocks
            positions = [(rank - root - 1) % n for rank in range(n)]
            return [(0, 0) if p == n - 1 else (p + 1, (p + 1) * b) for p in positions]
        case "scatter", (Centralized() | Direct()):
            return [star_out[0] if rank == root else (0, 0) for rank in range(n)]
        case "scatter", Tree(arity):
            return _tree_traffic(n, root, arity, down=lambda c: subtree_size(c, n, arity) * b)
        case "scatter", Ring():  # chain root -> ... -> root-1: p hops from the root sends n-1-p
            positions = [(rank - root) % n for rank in range(n)]
            return [(n - 1 - p, (n - 1 - p) * b) for p in positions]
        case "barrier", Centralized():
            return [(n - 1, 0)] + [(1, 0)] * (n - 1)
        case "barrier", Tree(arity):
            return [(len(_children(r, n, arity)) + (1 if r else 0), 0) for r in range(n)]
        case "barrier", Ring():  # dissemination: ceil(log2 n) rounds
            return [((n - 1).bit_length(), 0)] * n
        case "barrier", Direct():
            return [(n - 1, 0)] * n
    raise AssertionError((collective, strategy))
