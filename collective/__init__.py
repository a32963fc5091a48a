"""collective: all-reduce, reduce and broadcast of numpy and CuPy arrays across peers.

Peers are threads of one process (coordinated by an in-process server) or of several processes
and machines (coordinated by an orchestrator, exchanging arrays over ZeroMQ); each collective runs
one of the algorithms Centralized, Tree(k) or Ring. See docs/api.md for the full contract.

Public names are loaded on first use (PEP 562), so importing ``collective.errors`` (as the
``algorithms`` and ``transport`` packages do) does not import the whole runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "Centralized",
    "CollectiveConfig",
    "CollectiveError",
    "CollectiveTimeout",
    "ConfigError",
    "Direct",
    "InvalidArgumentError",
    "JobClosedError",
    "MismatchError",
    "PeerLostError",
    "ReduceOp",
    "RegistrationError",
    "Ring",
    "Runtime",
    "Tree",
    "all_reduce",
    "broadcast",
    "default_runtime",
    "finish",
    "peer_ids_from_env",
    "reduce",
    "register",
    "reset",
]

_API = ("all_reduce", "broadcast", "default_runtime", "finish", "reduce", "register", "reset")
_ERRORS = ("CollectiveError", "CollectiveTimeout", "ConfigError", "InvalidArgumentError", "JobClosedError",
           "MismatchError", "PeerLostError", "RegistrationError")  # fmt: skip
_LOCATIONS = {
    "Centralized": "collective.algorithms.strategies",
    "Tree": "collective.algorithms.strategies",
    "Ring": "collective.algorithms.strategies",
    "Direct": "collective.algorithms.strategies",
    "ReduceOp": "collective.algorithms.ops",
    "CollectiveConfig": "collective.config",
    "Runtime": "collective.runtime",
    "peer_ids_from_env": "collective.launch",
    **dict.fromkeys(_API, "collective.api"),
    **dict.fromkeys(_ERRORS, "collective.errors"),
}


def __getattr__(name: str) -> Any:
    module = _LOCATIONS.get(name)
    if module is None:
        raise AttributeError(f"module 'collective' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:
    from collective.algorithms.ops import ReduceOp
    from collective.algorithms.strategies import Centralized, Direct, Ring, Tree
    from collective.api import all_reduce, broadcast, default_runtime, finish, reduce, register, reset
    from collective.config import CollectiveConfig
    from collective.errors import (
        CollectiveError,
        CollectiveTimeout,
        ConfigError,
        InvalidArgumentError,
        JobClosedError,
        MismatchError,
        PeerLostError,
        RegistrationError,
    )
    from collective.launch import peer_ids_from_env
    from collective.runtime import Runtime
