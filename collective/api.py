"""The module-level API: thin functions over one default Runtime of this process."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from collective.algorithms.ops import Array, ReduceOp
from collective.algorithms.strategies import Strategy
from collective.arrays import Device
from collective.config import CollectiveConfig
from collective.groups import Group
from collective.groups import new_group as _new_group
from collective.p2p import PersistentRecv, PersistentSend
from collective.persistent import Persistent
from collective.runtime import Runtime
from collective.tuning import Explanation

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

Op = ReduceOp | str
_default = Runtime()


def default_runtime() -> Runtime:
    """The Runtime behind the module-level functions."""
    return _default


def init(device: str = "cpu") -> int:
    """Register this process's one peer from the launcher's variables (torchrun, Slurm, mpirun,
    collective launch); returns its peer id. See collective.launch.bootstrap."""
    from collective.launch.bootstrap import init as init_from_environment

    return init_from_environment(_default, device)


def register(peer_id: int, device: Device | str | int, config: CollectiveConfig) -> None:
    """Join ``peer_id`` (on ``device``: "cpu" or "cuda:N") to the job; blocks until all peers joined."""
    _default.register(peer_id, device, config)


def finish(peer_id: int) -> None:
    """Leave the job; the last local peer to leave ends it."""
    _default.finish(peer_id)


def reset() -> None:
    """Drop every job of the default runtime; blocked peers wake with JobClosedError (for tests)."""
    _default.reset()


def world_size(group: Group | None = None) -> int:
    """The number of peers in the job, or in ``group``."""
    return _default.world_size(group)


def explain(kind: str, nbytes: int, group: Group | None = None, *, dtype: Any = "float32") -> Explanation:
    """What a call of ``kind`` with ``nbytes`` per peer by ``group`` would run, and why: the path,
    the schedule, its predicted time and every alternative's, the figures' source."""
    return _default.explain(kind, nbytes, group, dtype=dtype)


def new_group(ranks: Iterable[int]) -> Group:
    """A group of the job's peers ``ranks`` (see collective.groups); no call on the other peers."""
    try:
        world: int | None = _default.world_size()
    except Exception:  # no job yet: the ranks are checked when the group is used
        world = None
    return _new_group(ranks, world)


def all_reduce(
    peer_id: int,
    x: Array,
    op: Op = "sum",
    *,
    group: Group | None = None,
    timeout: float | None = None,
    async_op: bool = False,
    strategy: Strategy | str | None = None,
    out: Array | None = None,
) -> Any:
    """``op`` over ``x`` of every peer, on every peer (see Runtime.all_reduce)."""
    return _default.all_reduce(
        peer_id, x, op, group=group, timeout=timeout, async_op=async_op, strategy=strategy, out=out
    )


def reduce(
    peer_id: int,
    x: Array,
    op: Op = "sum",
    root: int = 0,
    *,
    group: Group | None = None,
    timeout: float | None = None,
    async_op: bool = False,
    strategy: Strategy | str | None = None,
    out: Array | None = None,
) -> Any:
    """``op`` over ``x`` of every peer, on ``root`` only; None elsewhere."""
    return _default.reduce(
        peer_id, x, op, root, group=group, timeout=timeout, async_op=async_op, strategy=strategy, out=out
    )


def broadcast(
    peer_id: int,
    x: Array | None,
    *,
    group: Group | None = None,
    timeout: float | None = None,
    async_op: bool = False,
    strategy: Strategy | str | None = None,
    out: Array | None = None,
) -> Any:
    """The array of the one peer that passes one, on every peer."""
    return _default.broadcast(
        peer_id, x, group=group, timeout=timeout, async_op=async_op, strategy=strategy, out=out
    )


def all_gather(
    peer_id: int,
    x: Array,
    *,
    group: Group | None = None,
    timeout: float | None = None,
    async_op: bool = False,
    strategy: Strategy | str | None = None,
    out: Array | None = None,
) -> Any:
    """Every peer's ``x``, stacked in group-rank order: shape (group size, *x.shape)."""
    return _default.all_gather(
        peer_id, x, group=group, timeout=timeout, async_op=async_op, strategy=strategy, out=out
    )


def reduce_scatter(
    peer_id: int,
    x: Array,
    op: Op = "sum",
    *,
    group: Group | None = None,
    timeout: float | None = None,
    async_op: bool = False,
    strategy: Strategy | str | None = None,
    out: Array | None = None,
) -> Any:
    """x.shape[0] = size*k: rank i gets ``op`` over every peer's rows i*k..(i+1)*k-1."""
    return _default.reduce_scatter(
        peer_id, x, op, group=group, timeout=timeout, async_op=async_op, strategy=strategy, out=out
    )


def all_to_all(
    peer_id: int,
    x: Array,
    *,
    group: Group | None = None,
    timeout: float | None = None,
    async_op: bool = False,
    strategy: Strategy | str | None = None,
    out: Array | None = None,
) -> Any:
    """x.shape[0] = size*k: block i goes to rank i; block j of the result came from rank j."""
    return _default.all_to_all(
        peer_id, x, group=group, timeout=timeout, async_op=async_op, strategy=strategy, out=out
    )


def gather(
    peer_id: int,
    x: Array,
    root: int = 0,
    *,
    group: Group | None = None,
    timeout: float | None = None,
    async_op: bool = False,
    strategy: Strategy | str | None = None,
    out: Array | None = None,
) -> Any:
    """Every peer's ``x`` stacked on ``root``; None elsewhere."""
    return _default.gather(
        peer_id, x, root, group=group, timeout=timeout, async_op=async_op, strategy=strategy, out=out
    )


def scatter(
    peer_id: int,
    x: Array | None,
    root: int = 0,
    *,
    group: Group | None = None,
    timeout: float | None = None,
    async_op: bool = False,
    strategy: Strategy | str | None = None,
    out: Array | None = None,
) -> Any:
    """The root passes (group size, ...); each peer gets its row."""
    return _default.scatter(
        peer_id, x, root, group=group, timeout=timeout, async_op=async_op, strategy=strategy, out=out
    )


def all_gather_v(
    peer_id: int,
    x: Array,
    *,
    recv_sizes: Sequence[int] | None = None,
    group: Group | None = None,
    timeout: float | None = None,
    async_op: bool = False,
    strategy: Strategy | str | None = None,
    out: Array | None = None,
) -> Any:
    """Every peer's ``x`` (rows may differ between peers), a list in group-rank order."""
    return _default.all_gather_v(
        peer_id,
        x,
        recv_sizes=recv_sizes,
        group=group,
        timeout=timeout,
        async_op=async_op,
        strategy=strategy,
        out=out,
    )


def reduce_scatter_v(
    peer_id: int,
    x: Array,
    sizes: Sequence[int],
    op: Op = "sum",
    *,
    group: Group | None = None,
    timeout: float | None = None,
    async_op: bool = False,
    strategy: Strategy | str | None = None,
    out: Array | None = None,
) -> Any:
    """``op`` over every peer's ``x``; rank i gets its ``sizes[i]`` rows of the result."""
    return _default.reduce_scatter_v(
        peer_id, x, sizes, op, group=group, timeout=timeout, async_op=async_op, strategy=strategy, out=out
    )


def all_to_all_v(
    peer_id: int,
    x: Array,
    send_sizes: Sequence[int],
    *,
    recv_sizes: Sequence[int] | None = None,
    group: Group | None = None,
    timeout: float | None = None,
    async_op: bool = False,
    strategy: Strategy | str | None = None,
    out: Array | None = None,
) -> Any:
    """``send_sizes[j]`` rows of ``x`` to rank j; a list back of the rows each peer sent this one."""
    return _default.all_to_all_v(
        peer_id,
        x,
        send_sizes,
        recv_sizes=recv_sizes,
        group=group,
        timeout=timeout,
        async_op=async_op,
        strategy=strategy,
        out=out,
    )


def barrier(
    peer_id: int,
    *,
    group: Group | None = None,
    timeout: float | None = None,
    async_op: bool = False,
    strategy: Strategy | str | None = None,
) -> Any:
    """Return once every peer of the group has entered the barrier."""
    return _default.barrier(peer_id, group=group, timeout=timeout, async_op=async_op, strategy=strategy)


def send(peer_id: int, x: Array, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
    """Hand ``x`` to peer ``dst`` (buffered: returns without waiting for the matching recv)."""
    _default.send(peer_id, x, dst, tag, timeout=timeout)


def recv(
    peer_id: int, src: int, tag: int = 0, *, timeout: float | None = None, out: Array | None = None
) -> Array:
    """The next array peer ``src`` sent to this peer with ``tag``."""
    return _default.recv(peer_id, src, tag, timeout=timeout, out=out)


def recv_any(
    peer_id: int, tag: int = 0, *, timeout: float | None = None, out: Array | None = None
) -> tuple[int, Array]:
    """(the sender, the array) of the next message to this peer with ``tag`` from any peer."""
    return _default.recv_any(peer_id, tag, timeout=timeout, out=out)


def all_reduce_coalesced(
    peer_id: int,
    xs: Sequence[Array],
    op: Op = "sum",
    *,
    group: Group | None = None,
    timeout: float | None = None,
    async_op: bool = False,
    strategy: Strategy | str | None = None,
    out: Sequence[Array] | None = None,
) -> Any:
    """One all_reduce over many arrays; a list of results in the same order."""
    return _default.all_reduce_coalesced(
        peer_id, xs, op, group=group, timeout=timeout, async_op=async_op, strategy=strategy, out=out
    )


# -- persistent collectives (collective.persistent) -----------------------------------------------


def all_reduce_init(
    peer_id: int,
    x: Array,
    op: Op = "sum",
    *,
    out: Array | None = None,
    group: Group | None = None,
    timeout: float | None = None,
) -> Persistent:
    """A persistent all_reduce, agreed now; ``h()`` or ``h.start()``/``h.wait()`` per use, ``h.free()``
    (see Runtime.all_reduce_init)."""
    return _default.all_reduce_init(peer_id, x, op, out=out, group=group, timeout=timeout)


def broadcast_init(
    peer_id: int,
    x: Array | None,
    *,
    out: Array | None = None,
    group: Group | None = None,
    timeout: float | None = None,
) -> Persistent:
    """A persistent broadcast (see Runtime.broadcast_init)."""
    return _default.broadcast_init(peer_id, x, out=out, group=group, timeout=timeout)


def all_gather_init(
    peer_id: int,
    x: Array,
    *,
    out: Array | None = None,
    group: Group | None = None,
    timeout: float | None = None,
) -> Persistent:
    """A persistent all_gather (see Runtime.all_gather_init)."""
    return _default.all_gather_init(peer_id, x, out=out, group=group, timeout=timeout)


def reduce_scatter_init(
    peer_id: int,
    x: Array,
    op: Op = "sum",
    *,
    out: Array | None = None,
    group: Group | None = None,
    timeout: float | None = None,
) -> Persistent:
    """A persistent reduce_scatter (see Runtime.reduce_scatter_init)."""
    return _default.reduce_scatter_init(peer_id, x, op, out=out, group=group, timeout=timeout)


def barrier_init(peer_id: int, *, group: Group | None = None, timeout: float | None = None) -> Persistent:
    """A persistent barrier (see Runtime.barrier_init)."""
    return _default.barrier_init(peer_id, group=group, timeout=timeout)


def send_init(
    peer_id: int, x: Array, dst: int, tag: int = 0, *, timeout: float | None = None
) -> PersistentSend:
    """A persistent send (see Runtime.send_init)."""
    return _default.send_init(peer_id, x, dst, tag, timeout=timeout)


def recv_init(
    peer_id: int, src: int, tag: int = 0, *, out: Array | None = None, timeout: float | None = None
) -> PersistentRecv:
    """A persistent receive (see Runtime.recv_init)."""
    return _default.recv_init(peer_id, src, tag, out=out, timeout=timeout)
