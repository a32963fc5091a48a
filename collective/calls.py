"""What each peer asked for in one collective step, and the check that all peers agree.

Before any data moves, every peer's ``CallSpec`` is compared (in process at the rendezvous of
the in-process server). Disagreement is a MismatchError naming which peers differ and how; a
peer whose own arguments were unusable turns into an InvalidArgumentError for everyone. So a
mismatched or bad call fails on every peer at once instead of hanging some of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from collective.algorithms.ops import ReduceOp
from collective.errors import InvalidArgumentError, MismatchError

__all__ = ["CallSpec", "agree", "describe_peers"]


class CallSpec(NamedTuple):
    """One peer's call. ``shape``/``dtype`` are None for a broadcast receiver that gave no ``out``.

    A NamedTuple: made on every call by every peer, so it must be cheap to build and compare.
    """

    kind: str
    op: ReduceOp | None = None
    root: int | None = None
    shape: tuple[int, ...] | None = None
    dtype: Any = None  # numpy dtype
    has_data: bool = True
    error: str | None = None


def describe_peers(peers: list[int]) -> str:
    """[3] -> 'peer 3'; [0, 1, 2, 5] -> 'peers 0-2, 5'."""
    peers = sorted(peers)
    runs: list[str] = []
    start = previous = peers[0]
    for peer in [*peers[1:], None]:
        if peer is not None and peer == previous + 1:
            previous = peer
            continue
        runs.append(str(start) if start == previous else f"{start}-{previous}")
        if peer is not None:
            start = previous = peer
    return ("peer " if len(peers) == 1 else "peers ") + ", ".join(runs)


def _disagreement(
    specs: Mapping[int, CallSpec], name: str, show: Callable[[Any], str], who: Callable[[list[int]], str]
) -> str | None:
    """'shape: peers 0-2 passed (4, 8), peer 3 passed (4, 9)' or None when all agree."""
    groups: dict[Any, list[int]] = {}
    for peer in sorted(specs):
        groups.setdefault(getattr(specs[peer], name), []).append(peer)
    if len(groups) <= 1:
        return None
    parts = [f"{who(peers)} passed {show(value)}" for value, peers in groups.items()]
    return f"{name}: " + ", ".join(parts)


def _show_op(op: ReduceOp | None) -> str:
    return op.value if op is not None else "-"


def agree(
    specs: Mapping[int, CallSpec],
    label: str,
    who: Callable[[list[int]], str] = describe_peers,
    source_elsewhere: bool = False,
) -> CallSpec:
    """The call every participant agreed on (a broadcast's ``root`` filled in); raises otherwise.

    ``specs`` maps participants (peers, or nodes with ``who`` naming them) to their calls;
    ``label`` names the step in messages, e.g. "#12". With ``source_elsewhere`` a broadcast
    with no local source is fine (the root is on another node). Raises InvalidArgumentError
    when a participant's own arguments were unusable, MismatchError when they disagree.
    """
    first = specs[min(specs)]
    if first.kind != "broadcast" and first.error is None and all(spec == first for spec in specs.values()):
        return first  # the common case, checked cheaply
    if len({spec.kind for spec in specs.values()}) == 1:
        label = f"{first.kind} {label}"
    invalid = [f"{who([peer])}: {spec.error}" for peer, spec in sorted(specs.items()) if spec.error]
    if invalid:
        raise InvalidArgumentError(f"{label}: invalid arguments, so no peer ran it: " + "; ".join(invalid))
    kinds = _disagreement(specs, "kind", str, who)
    if kinds:
        raise MismatchError(f"{label}: peers called different collectives: {kinds.removeprefix('kind: ')}")
    checks: list[tuple[str, Callable[[Any], str]]] = [("shape", str), ("dtype", str)]
    if first.kind != "broadcast":
        checks = [("op", _show_op), *checks]
    if first.kind == "reduce":
        checks.insert(1, ("root", str))
    if first.kind == "broadcast":
        sources = [peer for peer, spec in specs.items() if spec.has_data]
        if len(sources) > 1 or (not sources and not source_elsewhere):
            passed = "no peer passed one" if not sources else f"{who(sorted(sources))} passed one"
            raise MismatchError(f"{label}: exactly one peer (the root) must pass an array; {passed}")
        # Receivers without an ``out`` buffer state no shape or dtype: compare the others only.
        specs = {peer: spec for peer, spec in specs.items() if spec.shape is not None}
        if sources:
            source = specs[sources[0]]
            first = source if source.root is not None else source._replace(root=sources[0])
        elif specs:
            first = next(iter(specs.values()))._replace(has_data=False, root=None)
        else:
            first = first._replace(has_data=False, root=None, shape=None, dtype=None)
    problems = [text for name, show in checks if (text := _disagreement(specs, name, show, who))]
    if problems:
        raise MismatchError(f"{label}: peers disagree on " + "; ".join(problems))
    return first
