"""A Ray collective backend: ``import collective.ray`` registers backend ``"collective"`` with
``ray.util.collective`` (Ray 2.5x and later: ``register_collective_backend``).

In Ray actors, then::

    import collective.ray  # (in each actor's process: at module level of the actor's code)
    import ray.util.collective as rc

    rc.init_collective_group(world_size, rank, backend="collective", group_name="g")
    rc.allreduce(tensor, group_name="g")  # numpy arrays or torch CPU tensors, in place

Each group is a job of this runtime, one peer per actor (its rank): rank 0 starts an
orchestrator on its node and publishes its address, the job's name and a token in Ray's
key-value store, so nothing is set up by hand and only the group's actors can join. Every op of
``BaseGroup`` is there, results written in place as Ray's backends do, Ray's options honoured
(reduce op, root rank, ``timeout_ms``); this runtime's errors (``CollectiveTimeout``,
``PeerLostError``, ``MismatchError``, ...) reach the caller as they are.
"""

from __future__ import annotations

import os
import secrets
import time
from datetime import timedelta
from typing import Any

import ray
import ray.experimental.internal_kv as internal_kv
from ray.util.collective.backend_registry import register_collective_backend
from ray.util.collective.collective_group.base_collective_group import BaseGroup
from ray.util.collective.types import ReduceOp

from collective.errors import CollectiveTimeout
from collective.launch.bootstrap import init_with_store
from collective.runtime import Runtime

__all__ = ["BACKEND", "CollectiveGroup", "KVStore"]

BACKEND = "collective"
MEET_TIMEOUT = 120.0  # seconds a rank waits for rank 0's address in Ray's key-value store
_OPS = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "prod", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}


class KVStore:
    """The store ``init_with_store`` meets through, on Ray's key-value store: keys under the
    group's prefix; ``get`` waits (polling, at most MEET_TIMEOUT) until rank 0 set the key."""

    def __init__(self, prefix: str, timeout: float = MEET_TIMEOUT) -> None:
        self.prefix = prefix
        self.timeout = timeout
        self.keys: list[str] = []

    def set(self, key: str, value: str) -> None:
        internal_kv._internal_kv_put(self.prefix + key, value.encode(), overwrite=True)
        self.keys.append(self.prefix + key)

    def get(self, key: str) -> bytes:
        deadline, pause = time.monotonic() + self.timeout, 0.005
        while True:
            value = internal_kv._internal_kv_get(self.prefix + key)
            if value is not None:
                return bytes(value)
            if time.monotonic() > deadline:
                raise CollectiveTimeout(
                    f"ray collective group: rank 0 did not publish {key!r} within {self.timeout:g}s "
                    f"(is rank 0's actor running init_collective_group?)"
                )
            time.sleep(pause)  # (a bounded wait for another actor: Ray's store has no watch)
            pause = min(2 * pause, 0.2)

    def clear(self) -> None:
        for key in self.keys:
            internal_kv._internal_kv_del(key)
        self.keys.clear()


class CollectiveGroup(BaseGroup):
    """A ``ray.util.collective`` group over this runtime: one Runtime (one job) per group."""

    def __init__(self, world_size: int, rank: int, group_name: str) -> None:
        super().__init__(world_size, rank, group_name)
        self.runtime = Runtime()
        store = KVStore(f"collective-ray/{group_name}/")
        if rank == 0:  # a token only the group's actors read (Ray's store is the cluster's)
            store.set("token", secrets.token_hex(16))
        environ = {
            **os.environ,
            "MASTER_ADDR": ray.util.get_node_ip_address(),  # (this actor's node: where it listens)
            "COLLECTIVE_TOKEN": store.get("token").decode(),
            "COLLECTIVE_JOB": "",  # (rank 0 names the job, one of its own: init_with_store)
            "COLLECTIVE_GLOBAL_ADDRESS": "",  # (and rank 0 serves it, with the group's own token)
        }
        init_with_store(self.runtime, store, rank, world_size, environ=environ)
        if rank == 0:  # every rank has joined (register blocks until then): the keys are spent
            store.clear()

    @classmethod
    def backend(cls) -> str:
        return BACKEND

    @classmethod
    def check_backend_availability(cls) -> bool:
        return True

    def destroy_group(self) -> None:
        self.runtime.finish(self.rank)

    # -- the ops: Ray passes lists (one tensor per GPU of the actor; one here) and an options object

    def allreduce(self, tensors: list[Any], allreduce_options: Any = None) -> None:
        (tensor,) = tensors
        timeout = _timeout(allreduce_options)
        self.runtime.all_reduce(self.rank, tensor, _op(allreduce_options), timeout=timeout, out=tensor)

    def barrier(self, barrier_options: Any = None) -> None:
        self.runtime.barrier(self.rank, timeout=_timeout(barrier_options))

    def reduce(self, tensors: list[Any], reduce_options: Any = None) -> None:
        (tensor,) = tensors
        root = getattr(reduce_options, "root_rank", 0)
        out = tensor if self.rank == root else None
        self.runtime.reduce(
            self.rank, tensor, _op(reduce_options), root, timeout=_timeout(reduce_options), out=out
        )

    def broadcast(self, tensors: list[Any], broadcast_options: Any = None) -> None:
        (tensor,) = tensors
        root = getattr(broadcast_options, "root_rank", 0)
        source = tensor if self.rank == root else None  # (the root is the peer that passes its array)
        self.runtime.broadcast(self.rank, source, timeout=_timeout(broadcast_options), out=tensor)

    def allgather(
        self, tensor_lists: list[list[Any]], tensors: list[Any], allgather_options: Any = None
    ) -> None:
        (outputs,), (tensor,) = tensor_lists, tensors
        gathered = self.runtime.all_gather(self.rank, tensor, timeout=_timeout(allgather_options))
        for rank, output in enumerate(outputs):
            _fill(output, gathered[rank])

    def reducescatter(
        self, tensors: list[Any], tensor_lists: list[list[Any]], reducescatter_options: Any = None
    ) -> None:
        (tensor,), (inputs,) = tensors, tensor_lists
        stacked = _stack(inputs)
        result = self.runtime.reduce_scatter(
            self.rank, stacked, _op(reducescatter_options), timeout=_timeout(reducescatter_options)
        )
        _fill(tensor, result)

    def send(self, tensors: list[Any], send_options: Any = None) -> None:
        (tensor,) = tensors
        self.runtime.send(self.rank, tensor, getattr(send_options, "dst_rank", 0))

    def recv(self, tensors: list[Any], recv_options: Any = None) -> None:
        (tensor,) = tensors
        src = getattr(recv_options, "src_rank", 0)
        self.runtime.recv(self.rank, src, timeout=_timeout(recv_options), out=tensor)


def _op(options: Any) -> str:
    return _OPS[getattr(options, "reduceOp", ReduceOp.SUM)]


def _timeout(options: Any) -> float | None:
    """Ray's ``timeout_ms`` (a timedelta; negative: unset) in seconds, or None (the config's)."""
    value = getattr(options, "timeout_ms", None)
    if isinstance(value, timedelta):
        seconds: float | None = value.total_seconds()
    else:
        seconds = None if value is None else value / 1e3
    return seconds if seconds is not None and seconds > 0 else None


def _stack(inputs: list[Any]) -> Any:
    """Ray's per-rank input tensors as one array of world rows (numpy or torch, as given)."""
    first = inputs[0]
    if type(first).__module__.startswith("torch"):
        import torch

        return torch.stack(list(inputs))
    import numpy as np

    return np.stack(inputs)


def _fill(target: Any, value: Any) -> None:
    """Write ``value`` into ``target`` in place (numpy or torch)."""
    if type(target).__module__.startswith("torch"):
        import torch

        target.copy_(torch.as_tensor(value).reshape(target.shape))
    else:
        target[...] = value.reshape(target.shape) if hasattr(value, "reshape") else value


register_collective_backend(BACKEND, CollectiveGroup)
