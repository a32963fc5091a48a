"""COLLECTIVE_ALGO: strategies pinned per collective kind from the environment.

Entries separated by ``;``, each ``[SCOPE.]KIND:STRATEGY``: KIND one of collective.config.KINDS or
``*`` (every kind), SCOPE ``local`` (among a process's peers) or ``global`` (among node leaders),
both when left out, STRATEGY what parse_strategy reads (``auto``, ``centralized``, ``tree:K``,
``ring``, ``direct``). Later entries win. Example::

    COLLECTIVE_ALGO="all_reduce:ring;broadcast:tree:4;global.all_gather:direct"

The pinned strategies replace the config's (per-call ``strategy=`` still wins over both).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from collective.algorithms.strategies import Strategy, parse_strategy
from collective.config import KINDS, CollectiveConfig
from collective.errors import ConfigError

__all__ = ["VARIABLE", "parse_algo", "pinned"]

VARIABLE = "COLLECTIVE_ALGO"


def parse_algo(text: str) -> dict[str, Strategy]:
    """Config field name -> strategy for every entry of ``text``; raises ConfigError naming the
    entry that cannot be read."""
    fields: dict[str, Strategy] = {}
    for entry in (part.strip() for part in text.split(";")):
        if not entry:
            continue
        target, colon, strategy_text = entry.partition(":")
        if not colon or not strategy_text.strip():
            raise ConfigError(
                f"{VARIABLE}: entry {entry!r} must be KIND:STRATEGY (e.g. 'all_reduce:ring'), entries "
                f"separated by ';'"
            )
        scope, dot, kind = target.strip().lower().rpartition(".")
        scopes = (scope,) if dot else ("local", "global")
        if dot and scope not in ("local", "global"):
            raise ConfigError(
                f"{VARIABLE}: entry {entry!r}: the scope must be 'local' or 'global', got {scope!r}"
            )
        if kind != "*" and kind not in KINDS:
            raise ConfigError(
                f"{VARIABLE}: entry {entry!r}: unknown collective {kind!r}; "
                f"use one of {', '.join(KINDS)} or *"
            )
        try:
            strategy = parse_strategy(strategy_text)
        except ConfigError as exc:
            raise ConfigError(f"{VARIABLE}: entry {entry!r}: {exc}") from None
        for name in scopes:
            for each in KINDS if kind == "*" else (kind,):
                fields[f"{name}_{each}_strategy"] = strategy
    return fields


def pinned(config: CollectiveConfig, environ: Mapping[str, str] | None = None) -> CollectiveConfig:
    """``config`` with COLLECTIVE_ALGO's strategies in place of its own (the same when unset)."""
    text = (os.environ if environ is None else environ).get(VARIABLE, "")
    if not text.strip():
        return config
    fields = parse_algo(text)
    if all(getattr(config, name) == value for name, value in fields.items()):
        return config
    return dataclasses.replace(config, **fields)  # type: ignore[arg-type]
