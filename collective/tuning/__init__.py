"""Which schedule a call runs: strategy "auto" resolved from measured (or built-in) figures.

* ``model``: keys, curves, the built-in cost of every schedule, and the ``Chooser`` a job holds;
* ``profile``: measured figures in a JSON file (``collective tune`` writes, COLLECTIVE_PROFILE names);
* ``probe``: the figures a multi-node job measures at its start, agreed by every peer;
* ``overrides``: COLLECTIVE_ALGO, strategies pinned per kind from the environment.

A call runs the strategy it names (``strategy=``), else COLLECTIVE_ALGO's for its kind, else its
config's (``auto`` by default); ``resolve`` turns ``auto`` into a schedule. Every input of the
choice is agreed (the call, the group's layout, the job's figures), so every peer chooses alike.
"""

from __future__ import annotations

import logging

from collective.algorithms.strategies import Auto, Schedule, Strategy
from collective.tuning.model import Chooser, Estimate, Explanation, Figures, Key

__all__ = ["Chooser", "Estimate", "Explanation", "Figures", "Key", "resolve"]

log = logging.getLogger("collective.tuning")  # DEBUG: every choice auto makes


def resolve(requested: Strategy, chooser: Chooser, key: Key, nbytes: int, elements: int) -> Schedule:
    """The schedule a call of ``nbytes`` per peer (``elements`` of them) runs at ``key``."""
    if not isinstance(requested, Auto):
        return requested
    chosen = chooser.choose(key, nbytes, elements < key.participants)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("auto: %s for %s of %d bytes among %s", chosen, key.kind, nbytes, key.describe())
    return chosen
