"""What each peer asked for in one collective step, and the check that all peers agree.

Before any data moves every peer's ``Signature`` is compared (in process at the rendezvous, across
nodes in the call exchange among leaders). Disagreement is a MismatchError naming which peers
differ and how; a peer whose own arguments were unusable turns into an InvalidArgumentError for
everyone. So a mismatched or bad call fails on every peer at once instead of hanging some of them.
Which fields must agree is the call's business (``Rules``, given by each call class).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from collective.algorithms.ops import ReduceOp
from collective.errors import InvalidArgumentError, MismatchError, describe_peers

__all__ = ["Rules", "Signature", "agree", "describe_peers", "unanimous"]


class Signature(NamedTuple):
    """One peer's call, as compared with the others'. Cheap to build and compare.

    ``shape``/``dtype`` are None where the peer states none (a broadcast receiver without ``out``).
    ``parts`` lists (shape, dtype name) per array of a coalesced call. ``sizes`` are per-rank
    sizes every peer passes alike (reduce_scatter_v). ``table`` holds what each rank states for
    itself alone (all_gather_v's rows, all_to_all_v's send sizes) as (rank, values) pairs: one
    pair in a peer's own call, every rank's in the agreed call (``agree`` merges them; a node's
    locally agreed call holds its own ranks'). ``strategy`` is the strategy the call names (every
    peer must name the same); between nodes, the one each leader's call would run with.
    """

    kind: str
    op: ReduceOp | None = None
    root: int | None = None
    shape: tuple[int, ...] | None = None
    dtype: Any = None  # numpy dtype
    has_data: bool = True
    error: str | None = None
    parts: tuple[tuple[tuple[int, ...], str], ...] = ()
    sizes: tuple[int, ...] = ()
    table: tuple[tuple[int, tuple[int, ...]], ...] = ()
    strategy: str | None = None  # the strategy asked for ("auto", "ring", ...; None: the config's)

    def rows(self, n: int) -> list[tuple[int, ...]]:
        """Every rank's values of ``table`` by rank (a complete table: an agreed call's)."""
        found: list[tuple[int, ...]] = [()] * n
        for rank, values in self.table:
            found[rank] = values
        return found


class Rules(NamedTuple):
    """How one kind of call is agreed: the fields every peer's call must share, and for calls with
    one source (broadcast, scatter) the fields shared by the peers that state them (the source, and
    receivers that pass ``out``). ``gathered``: every rank states its own ``table`` row."""

    compared: tuple[str, ...]
    sourced: bool = False  # exactly one peer passes the data (broadcast, scatter)
    stated: tuple[str, ...] = ()
    gathered: bool = False


def _disagreement(
    specs: Mapping[int, Signature], name: str, show: Callable[[Any], str], who: Callable[[list[int]], str]
) -> str | None:
    """'shape: peers 0-2 passed (4, 8), peer 3 passed (4, 9)' or None when all agree."""
    groups: dict[Any, list[int]] = {}
    for peer in sorted(specs):
        groups.setdefault(getattr(specs[peer], name), []).append(peer)
    if len(groups) <= 1:
        return None
    parts = [f"{who(peers)} passed {show(value)}" for value, peers in groups.items()]
    return f"{name}: " + ", ".join(parts)


def _show(value: Any) -> str:
    if isinstance(value, ReduceOp):
        return value.value
    if isinstance(value, tuple) and value and isinstance(value[0], tuple) and len(value[0]) == 2:
        return (
            f"{len(value)} arrays "
            + ", ".join(f"{shape} {dtype}" for shape, dtype in value[:4])
            + (", ..." if len(value) > 4 else "")
        )
    return "-" if value is None else str(value)


def agree(
    specs: Mapping[int, Signature],
    label: str,
    rules: Callable[[str], Rules],
    who: Callable[[list[int]], str] = describe_peers,
    source_elsewhere: bool = False,
) -> Signature:
    """The call every participant agreed on (a sourced call's ``root`` filled in); raises otherwise.

    ``specs`` maps participants (peers, or nodes with ``who`` naming them) to their calls;
    ``label`` names the step in messages, e.g. "#12"; ``rules(kind)`` says what must agree. With
    ``source_elsewhere`` a sourced call with no local source is fine (the root is on another node).
    Raises InvalidArgumentError when a participant's own arguments were unusable, MismatchError
    when they disagree.
    """
    first = specs[min(specs)]
    kind_rules = rules(first.kind)
    if unanimous(list(specs.values()), kind_rules) is not None:
        return first  # the common case, checked cheaply
    if len({spec.kind for spec in specs.values()}) == 1:
        label = f"{first.kind} {label}"
    invalid = [f"{who([peer])}: {spec.error}" for peer, spec in sorted(specs.items()) if spec.error]
    if invalid:
        raise InvalidArgumentError(f"{label}: invalid arguments, so no peer ran it: " + "; ".join(invalid))
    kinds = _disagreement(specs, "kind", str, who)
    if kinds:
        raise MismatchError(f"{label}: peers called different collectives: {kinds.removeprefix('kind: ')}")
    compared = (*kind_rules.compared, "strategy")
    problems = [text for name in compared if (text := _disagreement(specs, name, _show, who))]
    if kind_rules.sourced and not problems:
        first = _source(specs, label, who, source_elsewhere)
        # Receivers without an ``out`` buffer state no shape or dtype: compare the others only.
        stating = {peer: spec for peer, spec in specs.items() if spec.shape is not None or spec.has_data}
        problems = [t for name in kind_rules.stated if (t := _disagreement(stating, name, _show, who))]
    if problems:
        raise MismatchError(f"{label}: peers disagree on " + "; ".join(problems))
    if kind_rules.gathered:
        merged = sorted(row for spec in specs.values() for row in spec.table)
        if len({rank for rank, _ in merged}) != len(merged):
            raise MismatchError(f"{label}: a rank's values were stated twice: {merged}")
        return first._replace(table=tuple(merged))
    return first


def unanimous(signatures: list[Signature], rules: Rules) -> Signature | None:
    """The call every participant made, when all made the same valid call and every one states
    its data (the common case, compared in C); None when ``agree`` must decide."""
    first = signatures[0]
    if first.error is None and not rules.sourced and signatures.count(first) == len(signatures):
        return first
    return None


def _source(
    specs: Mapping[int, Signature], label: str, who: Callable[[list[int]], str], source_elsewhere: bool
) -> Signature:
    """The signature of a sourced call's one source (its root filled in), or a receiver's."""
    sources = [peer for peer, spec in specs.items() if spec.has_data]
    if len(sources) > 1 or (not sources and not source_elsewhere):
        passed = "no peer passed one" if not sources else f"{who(sorted(sources))} passed one"
        raise MismatchError(f"{label}: exactly one peer (the root) must pass an array; {passed}")
    if sources:
        source = specs[sources[0]]
        return source if source.root is not None else source._replace(root=sources[0])
    stating = [spec for spec in specs.values() if spec.shape is not None]
    if stating:
        return stating[0]._replace(has_data=False)
    return specs[min(specs)]._replace(has_data=False, shape=None, dtype=None)
