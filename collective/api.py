"""The module-level API: one default Runtime of this process, its methods bound.

``col.all_reduce`` is ``default_runtime().all_reduce``: a call goes straight to the Runtime, with
its signature and documentation (a function of this module in between made a frame each call,
which the flight recorder walked past to find the caller: most of a microsecond a call)."""

from __future__ import annotations

from collections.abc import Iterable

from collective.groups import Group
from collective.groups import new_group as _new_group
from collective.runtime import Runtime, default

__all__ = [
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
    "explain",
    "finish",
    "gather",
    "init",
    "new_group",
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
    "world_size",
]

_default = default()


def default_runtime() -> Runtime:
    """The Runtime behind the module-level functions."""
    return _default


def init(device: str = "cpu") -> int:
    """Register this process's one peer from the launcher's variables (torchrun, Slurm, mpirun,
    collective launch); returns its peer id. See collective.launch.bootstrap."""
    from collective.launch.bootstrap import init as init_from_environment

    return init_from_environment(_default, device)


def new_group(ranks: Iterable[int]) -> Group:
    """A group of the job's peers ``ranks`` (see collective.groups); no call on the other peers."""
    try:
        world: int | None = _default.world_size()
    except Exception:  # no job yet: the ranks are checked when the group is used
        world = None
    return _new_group(ranks, world)


# the default runtime's methods, bound (see the module's docstring)
register = _default.register
finish = _default.finish
reset = _default.reset
world_size = _default.world_size
explain = _default.explain
all_reduce = _default.all_reduce
reduce = _default.reduce
broadcast = _default.broadcast
all_gather = _default.all_gather
reduce_scatter = _default.reduce_scatter
all_to_all = _default.all_to_all
gather = _default.gather
scatter = _default.scatter
all_gather_v = _default.all_gather_v
reduce_scatter_v = _default.reduce_scatter_v
all_to_all_v = _default.all_to_all_v
barrier = _default.barrier
send = _default.send
recv = _default.recv
recv_any = _default.recv_any
all_reduce_coalesced = _default.all_reduce_coalesced
all_reduce_init = _default.all_reduce_init
broadcast_init = _default.broadcast_init
all_gather_init = _default.all_gather_init
reduce_scatter_init = _default.reduce_scatter_init
barrier_init = _default.barrier_init
send_init = _default.send_init
recv_init = _default.recv_init
