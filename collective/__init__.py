"""collective: all-reduce, reduce and broadcast of numpy and CuPy arrays across peers.

Peers are threads of one process (coordinated by an in-process server); each collective runs
one of the algorithms Centralized, Tree(k) or Ring. See docs/api.md for the full contract.
"""

from algorithms.ops import ReduceOp
from algorithms.strategies import Centralized, Ring, Tree
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

__version__ = "0.1.0"

__all__ = [
    "Centralized",
    "CollectiveConfig",
    "CollectiveError",
    "CollectiveTimeout",
    "ConfigError",
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
