"""Strategies are values; this module dispatches each collective to its algorithm from one place.

``Centralized()``, ``Tree(k)``, ``Ring()`` and ``Direct()`` are frozen dataclasses. They also parse
from the strings used by the CLI and environment variables: ``"centralized"``, ``"tree:k"``
(``"tree"`` is ``tree:2``), ``"ring"`` and ``"direct"``. ``Auto()`` (``"auto"``) asks for the one
with the least predicted time: collective.tuning resolves it into one of the others before any
schedule runs (the dispatchers here refuse it). Ring all_reduce and every Direct
collective need at least one element per peer: below that the dispatcher falls back to Tree(2)
(for all_reduce it logs it at DEBUG level and reports it: ``resolve_all_reduce``).

The block collectives (all_gather, reduce_scatter, all_to_all, gather, scatter) work on blocks
of B >= 0 elements, one per peer and ordered by peer index, and need no fallback; barrier carries
no data. Blocks may also differ in size: ``blocks`` (an ``ops.Blocks`` or a sequence of one size
per peer) says where each peer's block lies in the array of all of them, and all_to_all's
``counts[r][j]`` how many elements peer r sends to peer j; every peer passes the same sizes (the
caller agrees them first). Which schedule each strategy runs (every module draws its own)::

                   Centralized        Tree(k)                Ring                  Direct
    all_gather     gather+broadcast   gather+broadcast       n-1 steps right       1 round, all pairs
    reduce_scatter reduce+scatter     reduce+scatter         n-1 steps right       1 round, all pairs
    all_to_all     gather, transpose  gather, transpose      pairwise shifted      1 round, all pairs
                   at 0, scatter      at 0, scatter          exchange, n-1 steps
    gather         root <- every peer subtrees in 1 msg each chain, block by block  = Centralized
    scatter        root -> every peer subtrees in 1 msg each chain, block by block  = Centralized
    barrier        via peer 0         up and down the heap   dissemination         all pairs

Uneven blocks take the same schedules and the same messages; only their sizes change (zero-size
blocks send empty messages). ``blocks=None`` (``counts=None``) means equal blocks, and sends
exactly what the equal ``Blocks.equal(n, B)`` does.

The dispatchers check the block sizes, the counts and the root before any message (arguments.py:
InvalidArgumentError).
all_gather may run in place (``src`` a view of this peer's block of ``dst``); for the others
``src`` and ``dst`` must not overlap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from collective.algorithms import centralized, direct, ring, tree
from collective.algorithms.arguments import BlockSizes, check_blocks, check_counts, check_root
from collective.algorithms.link import Link
from collective.algorithms.ops import Array, Counts, ReduceOp
from collective.errors import ConfigError

__all__ = [
    "Auto",
    "BlockSizes",
    "Centralized",
    "Direct",
    "Ring",
    "Schedule",
    "Strategy",
    "Tree",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "parse_strategy",
    "reduce",
    "reduce_scatter",
    "resolve_all_reduce",
    "scatter",
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


@dataclass(frozen=True)
class Auto:
    """The schedule with the least predicted time for each call (collective.tuning chooses it)."""

    def __str__(self) -> str:
        return "auto"


Strategy = Centralized | Tree | Ring | Direct | Auto
Schedule = Centralized | Tree | Ring | Direct  # a strategy that names one schedule


def parse_strategy(value: Strategy | str) -> Strategy:
    """A strategy value, or one of "auto", "centralized", "tree:K", "tree", "ring", "direct";
    raises ConfigError."""
    if isinstance(value, Centralized | Tree | Ring | Direct | Auto):
        return value
    if not isinstance(value, str):
        raise ConfigError(
            f"a strategy must be Auto(), Centralized(), Tree(k), Ring(), Direct() or a string, got {value!r}"
        )
    text = value.strip().lower()
    if text == "auto":
        return Auto()
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
        f"unknown strategy {value!r}: expected 'auto', 'centralized', 'tree:K' (K >= 1), 'ring' or 'direct'"
    )


def _schedule(strategy: Strategy | str) -> Schedule:
    """The schedule ``strategy`` names; ``auto`` must have been resolved (collective.tuning)."""
    chosen = parse_strategy(strategy)
    if isinstance(chosen, Auto):
        raise ConfigError("'auto' names no schedule: collective.tuning resolves it before a schedule runs")
    return chosen


def resolve_all_reduce(strategy: Schedule, length: int, peers: int) -> Schedule:
    """The strategy all_reduce runs: Ring and Direct fall back to Tree(2) below one element per peer."""
    if isinstance(strategy, Ring | Direct) and length < peers:
        log.debug("%s all_reduce of %d elements on %d peers: falling back to tree:2", strategy, length, peers)
        return Tree(2)
    return strategy


def all_reduce(strategy: Strategy | str, link: Link, src: Array, dst: Array, op: ReduceOp) -> None:
    """Run all_reduce with ``strategy`` (after the Ring fallback) on this peer of ``link``."""
    match resolve_all_reduce(_schedule(strategy), src.size, link.size):
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
    chosen = _schedule(strategy)
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
    chosen = _schedule(strategy)
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


def all_gather(
    strategy: Strategy | str, link: Link, src: Array, dst: Array, blocks: BlockSizes | None = None
) -> None:
    """Block i of ``dst`` = ``src`` of peer i, on every peer; raises InvalidArgumentError on bad sizes.

    ``blocks``: where each peer's block lies in ``dst`` (None: each the size of ``src``).
    """
    layout = check_blocks("all_gather", link, blocks, ("src", src), ("dst", dst))
    match _schedule(strategy):
        case Centralized():
            centralized.all_gather(link, src, dst, layout)
        case Tree(arity):
            tree.all_gather(link, src, dst, arity, layout)
        case Ring():
            ring.all_gather(link, src, dst, layout)
        case Direct():
            direct.all_gather(link, src, dst, layout)


def reduce_scatter(
    strategy: Strategy | str,
    link: Link,
    src: Array,
    dst: Array,
    op: ReduceOp,
    blocks: BlockSizes | None = None,
) -> None:
    """``dst`` of peer r = op over block r of every peer's ``src``; raises InvalidArgumentError.

    ``blocks``: where each peer's block lies in ``src`` (None: each the size of ``dst``).
    """
    layout = check_blocks("reduce_scatter", link, blocks, ("dst", dst), ("src", src))
    match _schedule(strategy):
        case Centralized():
            centralized.reduce_scatter(link, src, dst, op, layout)
        case Tree(arity):
            tree.reduce_scatter(link, src, dst, op, arity, layout)
        case Ring():
            ring.reduce_scatter(link, src, dst, op, layout)
        case Direct():
            direct.reduce_scatter(link, src, dst, op, layout)


def all_to_all(
    strategy: Strategy | str, link: Link, src: Array, dst: Array, counts: Counts | None = None
) -> None:
    """Block j of ``src`` goes to peer j; block i of ``dst`` came from peer i. Raises InvalidArgumentError.

    ``counts[i][j]``: the elements peer i sends to peer j (None: ``src.size // n`` each).
    """
    matrix = check_counts(link, counts, src, dst)
    match _schedule(strategy):
        case Centralized():
            centralized.all_to_all(link, src, dst, matrix)
        case Tree(arity):
            tree.all_to_all(link, src, dst, arity, matrix)
        case Ring():
            ring.all_to_all(link, src, dst, matrix)
        case Direct():
            direct.all_to_all(link, src, dst, matrix)


def gather(
    strategy: Strategy | str,
    link: Link,
    root: int,
    src: Array,
    dst: Array | None,
    blocks: BlockSizes | None = None,
) -> None:
    """Block i of ``dst`` on ``root`` = ``src`` of peer i (``dst`` only on the root, None elsewhere).

    ``blocks``: where each peer's block lies in ``dst`` (None: each the size of ``src``).
    """
    check_root("gather", link, root)
    layout = check_blocks("gather", link, blocks, ("src", src), ("dst", dst) if link.rank == root else None)
    match _schedule(strategy):
        case Centralized() | Direct():  # Direct's schedule is Centralized's: every peer to the root
            centralized.gather(link, root, src, dst, layout)
        case Tree(arity):
            tree.gather(link, root, src, dst, arity, layout)
        case Ring():
            ring.gather(link, root, src, dst, layout)


def scatter(
    strategy: Strategy | str,
    link: Link,
    root: int,
    src: Array | None,
    dst: Array,
    blocks: BlockSizes | None = None,
) -> None:
    """``dst`` of peer i = block i of ``src`` on ``root`` (``src`` only on the root, None elsewhere).

    ``blocks``: where each peer's block lies in ``src`` (None: each the size of ``dst``).
    """
    check_root("scatter", link, root)
    layout = check_blocks("scatter", link, blocks, ("dst", dst), ("src", src) if link.rank == root else None)
    match _schedule(strategy):
        case Centralized() | Direct():  # Direct's schedule is Centralized's: the root to every peer
            centralized.scatter(link, root, src, dst, layout)
        case Tree(arity):
            tree.scatter(link, root, src, dst, arity, layout)
        case Ring():
            ring.scatter(link, root, src, dst, layout)


def barrier(strategy: Strategy | str, link: Link) -> None:
    """Return on every peer only after every peer of ``link`` has entered the barrier."""
    match _schedule(strategy):
        case Centralized():
            centralized.barrier(link)
        case Tree(arity):
            tree.barrier(link, arity)
        case Ring():
            ring.barrier(link)
        case Direct():
            direct.barrier(link)
