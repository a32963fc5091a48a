"""The host tier of a multi-node job: a host's processes meet in shared memory, its leader goes out.

When a group spans several hosts and some host runs several of its processes (one peer each, the
way torchrun, Slurm and ``collective launch`` start jobs), the ThreePhase executor
(collective.three_phase) takes each *host* as one node of its three phases:

1. **in**: the host's processes meet in shared memory (a step of their own ShmGroup, two steps
   per collective). They agree on the call by the collective's own rules, and their inputs reach
   the host's leader (its lowest rank) the way the collective needs them: reduced (all_reduce,
   reduce, reduce_scatter, coalesced), gathered (all_gather, gather, all_to_all), the root's array
   (broadcast, scatter: when the root runs on this host and is not the leader), or not at all;
2. the leaders run the global phase among hosts over ZeroMQ, as ThreePhase does among nodes, each
   with its host's inputs as a node's local peers' inputs;
3. **out**: the leader broadcasts the host's product through shared memory (a barrier when no other
   process of the host gets a result: a reduce or gather rooted elsewhere or at the leader), and
   every process takes its result.

An error of phase 2 (a mismatch between hosts, a lost host) reaches the host's other processes in
phase 3 as the same class; an error of phase 1 is every host process's verdict, and the leader
tells the other hosts. A host with only one of the group's processes skips both shared-memory
phases.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np

from collective.algorithms.ops import Array, copy_into
from collective.arrays import CPU, Device
from collective.call import Call
from collective.calls import WHOLE, Barrier, Broadcast
from collective.errors import CollectiveError
from collective.layout import Layout
from collective.pool import pool
from collective.protocol import VERDICT_GRACE
from collective.shm_chunks import REDUCING
from collective.shm_executor import ShmGroup
from collective.signature import Signature

__all__ = ["HostTier"]


_GATHERED = frozenset(["all_gather", "gather", "all_to_all"])


class _Phase:
    """The plan of one shared-memory step of the tier (what ShmGroup.run reads of a plan)."""

    __slots__ = ("error", "label", "number")

    def __init__(self, number: int, label: str, error: CollectiveError | None) -> None:
        self.number = number
        self.label = label
        self.error = error


class _Sub:
    """One shared-memory step of the tier (what ShmGroup.run reads of a step)."""

    __slots__ = ("call", "deadline", "plan", "timeout")

    def __init__(self, plan: _Phase, call: Any, deadline: float, timeout: float) -> None:
        self.plan = plan
        self.call = call
        self.deadline = deadline
        self.timeout = timeout


class _Inward:
    """Phase 1's call: agreed as the collective itself, its inputs moved to the leader (``moved``)."""

    source_elsewhere = True  # a broadcast or scatter rooted on another host has no source here

    def __init__(self, call: Call, tier: HostTier) -> None:
        self.call = call
        self.tier = tier
        self.signature = call.signature
        self.x = call.x
        self.device: Device = CPU  # what moves goes through host memory
        self.outer: Signature | None = None  # the host's agreed call (roots as group ranks)
        self.movement: Signature | None = None  # what moves it (``moved``)

    def source(self) -> Array | None:
        return self.call.source()

    def unpacked(self) -> list[Array] | None:
        return self.call.unpacked()

    def moved(self, agreed: Signature) -> Signature:
        """The shared-memory collective that brings this host's inputs to its leader (rank 0)."""
        self.movement = self._movement(agreed)
        return self.movement

    def _movement(self, agreed: Signature) -> Signature:
        kind, tier = agreed.kind, self.tier
        root: int | None
        if kind == "broadcast" and agreed.has_data and agreed.root is not None:
            root = agreed.root  # the source's rank on this host
            self.outer = agreed._replace(root=tier.ranks[agreed.root])
        else:
            self.outer = agreed
            root = tier.host_rank(agreed.root)
        total = math.prod(agreed.shape or ())
        if kind in REDUCING or kind == "reduce_scatter":
            return Signature("reduce", agreed.op, 0, (total,), agreed.dtype)
        if kind in _GATHERED:
            return Signature("gather", None, 0, (total,), agreed.dtype)
        if kind in ("broadcast", "scatter") and agreed.has_data and root is not None and root != 0:
            size = total * (len(tier.members) if kind == "scatter" else 1)
            return Signature("broadcast", None, root, (size,), agreed.dtype)
        return Signature("barrier")  # (a root that leads its host has its source already)

    def new_result(self, device: Device, moved: Signature, size: int, rank: int) -> Array | None:
        if moved.kind == "barrier" or (moved.kind != "broadcast" and rank != 0):
            return None
        assert moved.shape is not None
        if moved.kind == "broadcast" and rank == moved.root:
            src = self.call.source()  # the source itself: nothing to copy (the others need a buffer)
            if type(src) is np.ndarray:
                return src
        return pool.empty((moved.shape[0] * (size if moved.kind == "gather" else 1),), moved.dtype)

    def part(self, moved: Signature, inputs: list[Any], state: Any, rank: int, dst: Array | None) -> None:
        """The small path: the leader's gathered inputs, or the root's array."""
        if dst is None:
            return
        if moved.kind == "gather":
            np.concatenate(inputs, out=dst)
        elif moved.root is not None and moved.root != rank:
            copy_into(dst, inputs[moved.root])


def _own(call: Call) -> list[Any]:
    """This process's input as the leader's inputs (in host memory), or none."""
    src = call.source()
    return [] if src is None else [CPU.adopt(src)]


class HostTier:
    """This process's part of a group spanning hosts: the group's processes on its host (one peer
    each, by group rank), their ShmGroup (None when this is the host's only one), the layout of
    hosts as nodes."""

    def __init__(
        self, group: ShmGroup | None, host: tuple[int, ...], members: tuple[int, ...], layout: Layout
    ) -> None:
        self.group = group
        self.host = host
        self.members = members
        self.ranks = [members.index(peer) for peer in host]  # group ranks of the host's peers
        self.layout = layout  # hosts are its nodes (each named by its leader's node)
        self.leader = group is None or group.rank == 0
        self._out = -1  # the last phase-3 step this process entered

    def host_rank(self, rank: int | None) -> int | None:
        """Group rank ``rank``'s rank on this host (None where it runs elsewhere)."""
        return self.ranks.index(rank) if rank in self.ranks else None

    # -- phase 1 --------------------------------------------------------------------------------

    def collect(self, step: Any) -> tuple[Signature, list[Any]]:
        """Phase 1: (the host's agreed call, the leader's inputs by local index; [] elsewhere).

        Raises the host's verdict on every process of the host (a mismatch, a bad argument, a
        lost process), the same everywhere.
        """
        plan, call = step.plan, step.call
        if self.group is None:
            return plan.agreed, _own(call)
        inward = _Inward(call, self)
        phase = _Phase(2 * plan.number, plan.label, plan.error)
        result = self.group.run(_Sub(phase, inward, step.deadline, step.timeout))
        assert inward.outer is not None and inward.movement is not None
        if self.leader and inward.movement.kind == "barrier":  # a broadcast or scatter from here
            return inward.outer, _own(call)
        if not self.leader or result is None:
            return inward.outer, []
        if inward.movement.kind == "gather":
            return inward.outer, list(result.reshape(len(self.host), -1))
        return inward.outer, [result]

    # -- phase 3 --------------------------------------------------------------------------------

    def _product_here(self, agreed: Signature) -> bool:
        """Whether the host's processes take a product in phase 3 (else they meet at a barrier)."""
        if agreed.kind == "barrier":
            return False
        if agreed.kind in ("reduce", "gather"):  # for the root only: none when it leads the host
            return agreed.root in self.ranks[1:]
        return True

    def send(self, step: Any, agreed: Signature, product: Any) -> None:
        """Phase 3 on the leader: the host's product to the others (nothing to do when alone)."""
        if self.group is None:
            return
        if not self._product_here(agreed):
            out: Call = Barrier()
        else:
            shaped = product
            if agreed.kind in WHOLE and agreed.shape is not None:
                shaped = product.reshape(agreed.shape)
            elif agreed.kind == "scatter" and agreed.shape is not None:
                shaped = product.reshape(self.layout.width, *agreed.shape)
            out = Broadcast(shaped, out=shaped)
        out.prepare(CPU, self.host, 0)
        self.group.run(_Sub(self._enter(step), out, step.deadline, step.timeout))

    def _enter(self, step: Any) -> _Phase:
        number = 2 * step.plan.number + 1
        self._out = number
        return _Phase(number, step.plan.label, None)

    def fail(self, step: Any, error: CollectiveError) -> None:
        """Phase 3 for a process that failed after phase 1 (a leader whose phase 2 failed, say):
        the host's others raise ``error``'s class at once. Nothing to do once phase 3 was entered
        (the shared-memory step tells the others itself)."""
        if self.group is None or self._out == 2 * step.plan.number + 1:
            return
        phase = self._enter(step)
        phase.error = error
        with contextlib.suppress(CollectiveError):  # ``error`` itself, recorded for the others
            self.group.run(_Sub(phase, None, step.deadline, step.timeout))

    def receive(self, step: Any) -> tuple[Signature, Any, Array | None]:
        """Phase 3 on the others: (the agreed call as this process sees it, the product, or its
        result when the product went straight into it)."""
        assert self.group is not None
        call, agreed = step.call, step.plan.agreed
        # the leader may wait for the other hosts until its deadline and a grace: then tells why
        deadline = step.deadline + 2 * VERDICT_GRACE
        if not self._product_here(agreed):
            barrier = Barrier()
            barrier.prepare(CPU, self.host, self.group.rank)
            self.group.run(_Sub(self._enter(step), barrier, deadline, step.timeout))
            return agreed, None, None
        kind = agreed.kind
        into = None
        if kind in WHOLE and agreed.shape is not None and (kind != "reduce" or agreed.root == step.rank):
            into = call.new_result(call.device, agreed, step.plan.size, step.rank)
            if into is not None and type(into) is not np.ndarray:
                into = None  # a CuPy result: received on the host, then copied over
        inward = Broadcast(None, out=into)
        inward.prepare(CPU, self.host, self.group.rank)
        product = self.group.run(_Sub(self._enter(step), inward, deadline, step.timeout))
        assert product is not None  # every process of the host receives the product
        if kind == "broadcast":
            agreed = agreed._replace(shape=tuple(product.shape), dtype=product.dtype)
            if into is None and call.device is CPU and call.out is None:
                into = product  # received into a new array: that is the result
        elif kind == "scatter":
            agreed = agreed._replace(shape=tuple(product.shape[1:]), dtype=product.dtype)
        return agreed, product, into
