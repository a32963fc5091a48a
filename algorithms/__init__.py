"""Collective algorithms, each written once as functions over the ``Link`` protocol.

``centralized``, ``tree`` and ``ring`` hold the schedules; ``strategies`` holds the strategy
values and the one table that dispatches to them.
"""

from collective.algorithms.link import Link
from collective.algorithms.ops import ReduceOp
from collective.algorithms.strategies import Centralized, Direct, Ring, Strategy, Tree, parse_strategy

__all__ = ["Centralized", "Direct", "Link", "ReduceOp", "Ring", "Strategy", "Tree", "parse_strategy"]
