"""Collective algorithms, each written once as functions over the ``Link`` protocol.

``centralized``, ``tree``, ``ring`` and ``direct`` hold the schedules (all_reduce, reduce,
broadcast, and the block collectives all_gather, reduce_scatter, all_to_all, gather, scatter and
barrier; their blocks may be uneven: ``ops.Blocks``); ``strategies`` holds the strategy values and
the one table per collective that dispatches to them (``arguments`` checks what they are given).
``conformance`` ships the Link conformance checks every transport runs (``check_link``).
"""

from collective.algorithms.link import Link
from collective.algorithms.ops import Blocks, ReduceOp
from collective.algorithms.strategies import Centralized, Direct, Ring, Strategy, Tree, parse_strategy

__all__ = [
    "Blocks",
    "Centralized",
    "Direct",
    "Link",
    "ReduceOp",
    "Ring",
    "Strategy",
    "Tree",
    "parse_strategy",
]
