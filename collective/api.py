"""The module-level API: thin functions over one default Runtime of this process."""

from __future__ import annotations

from collective.algorithms.ops import Array, ReduceOp
from collective.arrays import Device
from collective.config import CollectiveConfig
from collective.runtime import Runtime

__all__ = ["all_reduce", "broadcast", "default_runtime", "finish", "reduce", "register", "reset"]

_default = Runtime()


def default_runtime() -> Runtime:
    """The Runtime behind the module-level functions."""
    return _default


def register(peer_id: int, device: Device | str | int, config: CollectiveConfig) -> None:
    """Join ``peer_id`` (on ``device``: "cpu" or "cuda:N") to the job; blocks until all peers joined."""
    _default.register(peer_id, device, config)


def all_reduce(peer_id: int, x: Array, op: ReduceOp | str = "sum", *, out: Array | None = None) -> Array:
    """``op`` over ``x`` of every peer, on every peer (see Runtime.all_reduce)."""
    return _default.all_reduce(peer_id, x, op, out=out)


def reduce(
    peer_id: int, x: Array, op: ReduceOp | str = "sum", root: int = 0, *, out: Array | None = None
) -> Array | None:
    """``op`` over ``x`` of every peer, on ``root`` only (see Runtime.reduce)."""
    return _default.reduce(peer_id, x, op, root, out=out)


def broadcast(peer_id: int, x: Array | None, *, out: Array | None = None) -> Array:
    """The array of the one peer that passes one, on every peer (see Runtime.broadcast)."""
    return _default.broadcast(peer_id, x, out=out)


def finish(peer_id: int) -> None:
    """Leave the job; the last local peer to leave ends it."""
    _default.finish(peer_id)


def reset() -> None:
    """Drop every job of the default runtime; blocked peers wake with JobClosedError (for tests)."""
    _default.reset()
