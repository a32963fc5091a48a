"""collective: the collective set (all_reduce, all_gather, reduce_scatter, ...) across peers.

Peers are threads of one process (coordinated in process) or of several processes and machines
(coordinated by an orchestrator, exchanging arrays over ZeroMQ); each collective runs one of the
algorithms Centralized, Tree(k), Ring or Direct, by default the one with the least predicted time
(Auto; ``explain`` says which and why). See docs/api.md for the full contract.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (what type checkers see; at run time each name loads on first use: __getattr__)
    from collective.algorithms.ops import ReduceOp
    from collective.algorithms.strategies import Auto, Centralized, Direct, Ring, Tree
    from collective.api import (
        all_gather,
        all_gather_init,
        all_gather_v,
        all_reduce,
        all_reduce_coalesced,
        all_reduce_init,
        all_to_all,
        all_to_all_v,
        barrier,
        barrier_init,
        broadcast,
        broadcast_init,
        default_runtime,
        explain,
        finish,
        gather,
        init,
        new_group,
        recv,
        recv_any,
        recv_init,
        reduce,
        reduce_scatter,
        reduce_scatter_init,
        reduce_scatter_v,
        register,
        reset,
        scatter,
        send,
        send_init,
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
    from collective.p2p import PersistentRecv, PersistentSend
    from collective.persistent import Persistent
    from collective.runtime import Runtime
    from collective.trace import dump_trace, stats
    from collective.tuning import Explanation
    from collective.work import Work


__version__ = "0.2.0"

__all__ = [
    "Auto",
    "Centralized",
    "CollectiveConfig",
    "CollectiveError",
    "CollectiveTimeout",
    "ConfigError",
    "Direct",
    "Explanation",
    "Group",
    "InvalidArgumentError",
    "JobClosedError",
    "MismatchError",
    "PeerLostError",
    "Persistent",
    "PersistentRecv",
    "PersistentSend",
    "ReduceOp",
    "RegistrationError",
    "Ring",
    "Runtime",
    "Tree",
    "Work",
    "all_gather",
    "all_gather_init",
    "all_gather_v",
    "all_reduce",
    "all_reduce_coalesced",
    "all_reduce_init",
    "all_to_all",
    "all_to_all_v",
    "barrier",
    "barrier_init",
    "broadcast",
    "broadcast_init",
    "default_runtime",
    "dump_trace",
    "explain",
    "finish",
    "gather",
    "init",
    "new_group",
    "peer_ids_from_env",
    "recv",
    "recv_any",
    "recv_init",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_init",
    "reduce_scatter_v",
    "register",
    "reset",
    "scatter",
    "send",
    "send_init",
    "stats",
    "world_size",
]

# Where each public name lives: ``import collective`` loads none of them (torch imports this package
# through its backend autoload: collective.autoload), the first use of a name loads its module.
_LAZY: dict[str, str] = {
    name: module
    for module, names in {
        "collective.algorithms.ops": "ReduceOp",
        "collective.algorithms.strategies": "Auto Centralized Direct Ring Tree",
        "collective.api": "all_gather all_gather_init all_gather_v all_reduce all_reduce_coalesced "
        "all_reduce_init all_to_all all_to_all_v barrier barrier_init broadcast broadcast_init "
        "default_runtime explain finish gather init new_group recv recv_any recv_init reduce reduce_scatter "
        "reduce_scatter_init reduce_scatter_v register reset scatter send send_init world_size",
        "collective.config": "CollectiveConfig",
        "collective.errors": "CollectiveError CollectiveTimeout ConfigError InvalidArgumentError "
        "JobClosedError MismatchError PeerLostError RegistrationError",
        "collective.groups": "Group",
        "collective.launch": "peer_ids_from_env",
        "collective.p2p": "PersistentRecv PersistentSend",
        "collective.persistent": "Persistent",
        "collective.runtime": "Runtime",
        "collective.trace": "dump_trace stats",
        "collective.tuning": "Explanation",
        "collective.work": "Work",
    }.items()
    for name in names.split()
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'collective' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # (found directly from now on)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
