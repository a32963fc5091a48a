"""collective: the collective set (all_reduce, all_gather, reduce_scatter, ...) across peers.

Peers are threads of one process (coordinated in process) or of several processes and machines
(coordinated by an orchestrator, exchanging arrays over ZeroMQ); each collective runs one of the
algorithms Centralized, Tree(k), Ring or Direct. See docs/api.md for the full contract.
"""

from __future__ import annotations

from collective.algorithms.ops import ReduceOp
from collective.algorithms.strategies import Centralized, Direct, Ring, Tree
from collective.api import (
    all_gather,
    all_gather_v,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_v,
    barrier,
    broadcast,
    default_runtime,
    finish,
    gather,
    init,
    new_group,
    recv,
    recv_any,
    reduce,
    reduce_scatter,
    reduce_scatter_v,
    register,
    reset,
    scatter,
    send,
    world_size,
)
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
from collective.groups import Group
from collective.launch import peer_ids_from_env
from collective.runtime import Runtime
from collective.work import Work

__version__ = "0.2.0"

__all__ = [
    "Centralized",
    "CollectiveConfig",
    "CollectiveError",
    "CollectiveTimeout",
    "ConfigError",
    "Direct",
    "Group",
    "InvalidArgumentError",
    "JobClosedError",
    "MismatchError",
    "PeerLostError",
    "ReduceOp",
    "RegistrationError",
    "Ring",
    "Runtime",
    "Tree",
    "Work",
    "all_gather",
    "all_gather_v",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_v",
    "barrier",
    "broadcast",
    "default_runtime",
    "finish",
    "gather",
    "init",
    "new_group",
    "peer_ids_from_env",
    "recv",
    "recv_any",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_v",
    "register",
    "reset",
    "scatter",
    "send",
    "world_size",
]
