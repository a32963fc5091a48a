"""Strategies are values; this module dispatches each collective to its algorithm from one place.

``Centralized()``, ``Tree(k)``, ``Ring()`` and ``Direct()`` are frozen dataclasses. They also parse
from the strings used by the CLI and environment variables: ``"centralized"``, ``"tree:k"``
(``"tree"`` is ``tree:2``), ``"ring"`` and ``"direct"``. Ring all_reduce and every Direct
collective need at least one element per peer: below that the dispatcher falls back to Tree(2)
(for all_reduce it logs it at DEBUG level and reports it: ``resolve_all_reduce``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from collective.algorithms import centralized, direct, ring, tree
from collective.algorithms.link import Link
from collective.algorithms.ops import Array, ReduceOp
from collective.errors import ConfigError

__all__ = [
    "Centralized",
    "Direct",
    "Ring",
    "Strategy",
    "Tree",
    "all_reduce",
    "broadcast",
    "parse_strategy",
    "reduce",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Centralized:
    """Every peer sends to one peer, which reduces and sends the result back."""

    def __str__(self) -> str:
        return "centralized"


@dataclass(frozen=True)
class Tree:
    """A k-ary heap: reduce up, broadcast down. ``arity`` >= 1 (1 is a chain)."""

    arity: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.arity, bool) or not isinstance(self.arity, int) or self.arity < 1:
            raise ConfigError(f"Tree arity must be an integer >= 1, got {self.arity!r}")

    def __str__(self) -> str:
        return f"tree:{self.arity}"


@dataclass(frozen=True)
class Ring:
    """Reduce-scatter + all-gather for all_reduce; a pipelined chain for reduce and broadcast."""

    def __str__(self) -> str:
        return "ring"


@dataclass(frozen=True)
class Direct:
    """Reduce-scatter + all-gather with every chunk sent straight to its owner (two rounds)."""

    def __str__(self) -> str:
        return "direct"


Strategy = Centralized | Tree | Ring | Direct


def parse_strategy(value: Strategy | str) -> Strategy:
    """A strategy value, or one of "centralized", "tree:K", "tree", "ring"; raises ConfigError."""
    if isinstance(value, Centralized | Tree | Ring | Direct):
        return value
    if not isinstance(value, str):
        raise ConfigError(
            f"a strategy must be Centralized(), Tree(k), Ring(), Direct() or a string, got {value!r}"
        )
    text = value.strip().lower()
    if text == "centralized":
        return Centralized()
    if text == "ring":
        return Ring()
    if text == "direct":
        return Direct()
    if text == "tree":
        return Tree(2)
    if text.startswith("tree:"):
        try:
            arity = int(text.removeprefix("tree:"))
        except ValueError:
            raise ConfigError(
                f"strategy {value!r}: the tree arity must be an integer, as in 'tree:2'"
            ) from None
        return Tree(arity)
    raise ConfigError(
        f"unknown strategy {value!r}: expected 'centralized', 'tree:K' (K >= 1), 'ring' or 'direct'"
    )


def resolve_all_reduce(strategy: Strategy, length: int, peers: int) -> Strategy:
    """The strategy all_reduce runs: Ring and Direct fall back to Tree(2) below one element per peer."""
    if isinstance(strategy, Ring | Direct) and length < peers:
        log.debug("%s all_reduce of %d elements on %d peers: falling back to tree:2", strategy, length, peers)
        return Tree(2)
    return strategy


def all_reduce(strategy: Strategy | str, link: Link, src: Array, dst: Array, op: ReduceOp) -> None:
    """Run all_reduce with ``strategy`` (after the Ring fallback) on this peer of ``link``."""
    match resolve_all_reduce(parse_strategy(strategy), src.size, link.size):
        case Centralized():
            centralized.all_reduce(link, src, dst, op)
        case Tree(arity):
            tree.all_reduce(link, src, dst, op, arity)
        case Ring():
            ring.all_reduce(link, src, dst, op)
        case Direct():
            direct.all_reduce(link, src, dst, op)


def reduce(
    strategy: Strategy | str, link: Link, root: int, src: Array, dst: Array | None, op: ReduceOp
) -> None:
    """Run reduce onto ``root`` with ``strategy``; ``dst`` is needed on the root only."""
    chosen = parse_strategy(strategy)
    if isinstance(chosen, Direct) and src.size < link.size:
        chosen = Tree(2)  # too few elements to give every peer a chunk
    match chosen:
        case Centralized():
            centralized.reduce(link, root, src, dst, op)
        case Tree(arity):
            tree.reduce(link, root, src, dst, op, arity)
        case Ring():
            ring.reduce(link, root, src, dst, op)
        case Direct():
            direct.reduce(link, root, src, dst, op)


def broadcast(strategy: Strategy | str, link: Link, root: int, buf: Array) -> None:
    """Run broadcast from ``root`` with ``strategy``."""
    chosen = parse_strategy(strategy)
    if isinstance(chosen, Direct) and buf.size < link.size:
        chosen = Tree(2)
    match chosen:
        case Centralized():
            centralized.broadcast(link, root, buf)
        case Tree(arity):
            tree.broadcast(link, root, buf, arity)
        case Ring():
            ring.broadcast(link, root, buf)
        case Direct():
            direct.broadcast(link, root, buf)
