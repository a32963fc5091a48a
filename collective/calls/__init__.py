"""The call objects: one class per collective (its checks, what must agree, its result, and the
movement family its data follows), and the registry of collective kinds derived from them.

* ``base``: ``Call``, what every call does and when (checked, agreed, moved, finished);
* ``collectives``: the collectives of even blocks; ``uneven``: all_gather_v, reduce_scatter_v,
  all_to_all_v; ``coalesced``: all_reduce_coalesced's buckets;
* ``persistent``: the steps that make and end a persistent call (``all_reduce_init``...);
* ``signature``: what one peer asked for, and ``agree`` over every peer's;
* ``movement``: the movement families every executor runs (collective.executors);
* ``layout``: where a group's ranks live across nodes (node-major blocks).

Adding a collective is one class in ``collectives`` or ``uneven`` (and its name in ``CALLS``); where
no movement family fits its data, one family more in ``movement``, with its schedule in algorithms/.
"""

from __future__ import annotations

from collective.calls.base import Call
from collective.calls.collectives import (
    AllGather,
    AllReduce,
    AllToAll,
    Barrier,
    Broadcast,
    Coalesced,
    Gather,
    Reduce,
    ReduceScatter,
    Scatter,
)
from collective.calls.persistent import AGREEMENTS, RELEASES
from collective.calls.signature import Rules
from collective.calls.uneven import AllGatherV, AllToAllV, ReduceScatterV

__all__ = [
    "CALLS",
    "RULES",
    "AllGather",
    "AllGatherV",
    "AllReduce",
    "AllToAll",
    "AllToAllV",
    "Barrier",
    "Broadcast",
    "Call",
    "Coalesced",
    "Gather",
    "Reduce",
    "ReduceScatter",
    "ReduceScatterV",
    "Scatter",
    "rules_of",
]

_KINDS: tuple[type[Call], ...] = (
    AllReduce,
    Reduce,
    Broadcast,
    AllGather,
    Gather,
    ReduceScatter,
    AllToAll,
    Scatter,
    Barrier,
    Coalesced,
    AllGatherV,
    ReduceScatterV,
    AllToAllV,
    *AGREEMENTS.values(),  # (a persistent call's making and ending: collective.calls.persistent)
    *RELEASES.values(),
)
CALLS: dict[str, type[Call]] = {cls.kind: cls for cls in _KINDS}
RULES: dict[str, Rules] = {kind: cls.rules for kind, cls in CALLS.items()}


def rules_of(kind: str) -> Rules:
    """The agreement rules of ``kind`` (an unknown kind compares nothing: the kinds differ anyway)."""
    return RULES.get(kind, Rules(()))
