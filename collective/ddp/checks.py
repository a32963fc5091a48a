"""The checks of collective.ddp's arguments, made so that a bad or different one fails every peer.

A helper that checks its arguments and raises on the peer that passed them leaves the others
waiting in its first collective until their timeout. Here a peer's problem travels as a refused
call (the InvalidArgumentError, naming the peer, on every peer at once), and the settings every
peer must share are gathered and compared, so a difference names the peers and the values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from collective.algorithms.ops import ReduceOp
from collective.arrays import integer
from collective.calls import AllGather
from collective.calls.base import parse_op
from collective.errors import InvalidArgumentError, MismatchError, describe_peers
from collective.groups import Group
from collective.runtime import Runtime
from collective.tensors import native

__all__ = ["agree_on_settings", "settings_problem", "writable_params"]

_OPS = list(ReduceOp)
_COMPARED: list[tuple[str, Any]] = [  # the columns of the agreement's all_gather, and how each reads
    ("parameters (names, shapes, dtypes, order)", lambda value: f"hold model {value & 0xFFFFFF:06x}"),
    ("bucket_bytes", lambda value: f"passed {value}"),
    ("op", lambda value: f"passed {_OPS[value].value!r}"),
    ("stale", lambda value: f"passed {bool(value)}"),
]


def settings_problem(params: Mapping[str, Any], bucket_bytes: Any, op: Any) -> str | None:
    """Why GradientSync cannot be built from these arguments (None if it can)."""
    if not isinstance(params, Mapping) or not params:
        return "params must be a non-empty mapping of names to arrays"
    for name, value in params.items():
        _, problem = _array_of(value, f"params[{name!r}]")
        if problem is not None:
            return problem
    size = integer(bucket_bytes)
    if size is None or not 0 < size < 1 << 62:
        return f"bucket_bytes must be an integer > 0, got {bucket_bytes!r}"
    parsed, problem = parse_op(op)
    return None if parsed is not None else problem


def agree_on_settings(
    runtime: Runtime,
    peer: int,
    group: Group | None,
    params: Mapping[str, Any],
    settings: tuple[int, Any, bool],
    problem: str | None,
) -> None:
    """One small all_gather: every peer must hold the same parameters (names, shapes, dtypes, in
    one order) and ``settings`` (bucket_bytes, op, stale), else the buckets would average one
    peer's weights with another's. A peer's ``problem`` fails it on every peer, as an
    InvalidArgumentError; a difference is a MismatchError naming the peers and their values."""
    mine = [0] * len(_COMPARED)
    if problem is None:
        bucket_bytes, op, stale = settings
        arrays = [(name, native(value)[0]) for name, value in params.items()]
        layout = repr([(name, tuple(array.shape), str(array.dtype)) for name, array in arrays])
        digest = int.from_bytes(hashlib.blake2b(layout.encode(), digest_size=7).digest(), "little")
        parsed, _ = parse_op(op)
        assert parsed is not None  # (checked by settings_problem)
        mine = [digest, int(bucket_bytes), _OPS.index(parsed), int(bool(stale))]
    call = AllGather(np.array(mine, np.int64))
    if problem is not None:
        call.refuse(f"GradientSync: {problem}")
    seen = runtime.start(peer, call, group, None, False).tolist()
    peers = group.members if group is not None else tuple(range(len(seen)))
    differ = []
    for column, (what, show) in enumerate(_COMPARED):
        values: dict[int, list[int]] = {}
        for row, member in zip(seen, peers, strict=True):
            values.setdefault(row[column], []).append(member)
        if len(values) > 1:
            differ.append(
                f"{what}: " + ", ".join(f"{describe_peers(ps)} {show(v)}" for v, ps in values.items())
            )
    if differ:
        raise MismatchError(
            "GradientSync: the peers' settings differ (" + "; ".join(differ) + "): every peer must "
            "build it from the same model, with the same bucket_bytes, op and stale"
        )


def writable_params(params: Iterable[Any]) -> tuple[list[Any], str | None]:
    """The arrays viewing ``params``, and why they cannot be overwritten in place (None if they can)."""
    arrays: list[Any] = []
    if not isinstance(params, Iterable) or isinstance(params, str | bytes | Mapping):
        return arrays, f"params must be an iterable of arrays, got {type(params).__name__}"
    for index, value in enumerate(params):
        array, problem = _array_of(value, f"params[{index}]")
        if problem is not None:
            return [], problem
        if isinstance(value, np.generic):  # (read as a new 0-d array: the scalar itself stays as it was)
            return (
                [],
                f"params[{index}] is a numpy scalar, which cannot be written in place: pass a 0-d array",
            )
        if not getattr(getattr(array, "flags", None), "writeable", True):
            return [], (
                f"params[{index}] cannot be written in place (a JAX array?): pass arrays it can "
                f"overwrite, or call broadcast() per array and keep its results"
            )
        arrays.append(array)
    return arrays, None


def _array_of(value: Any, label: str) -> tuple[Any, str | None]:
    """The array viewing ``value`` (numpy or CuPy), or why it is none (``label`` names it)."""
    try:
        array, _ = native(value)
    except InvalidArgumentError as exc:
        return None, f"{label}: {exc}"
    if not all(hasattr(array, name) for name in ("shape", "dtype", "nbytes", "reshape")):
        return None, f"{label} must be an array (numpy, CuPy, torch, JAX), got {type(value).__name__}"
    return array, None
