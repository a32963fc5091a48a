"""The host tier of a multi-node job: a host's processes meet in shared memory, its leader goes out.

When a group spans several hosts and some host runs several of its processes (one peer each, the
way torchrun, Slurm and ``collective launch`` start jobs), the ThreePhase executor
(collective.executors.three_phase) takes each *host* as one node of its three phases:

1. **in**: the host's processes meet in shared memory (a step of their own ShmGroup, two steps
   per collective). They agree on the call by the collective's own rules, and their inputs reach
   the host's leader (its lowest rank) the way the call's movement wants them for its contribution
   (``Movement.inward``: reduced, stacked, the root's array, or not at all);
2. the leaders run the global phase among hosts over ZeroMQ, as ThreePhase does among nodes, each
   with its host's inputs as a node's local peers' inputs;
3. **out**: the leader relays the globally agreed call through shared memory, with the host's
   product when another process of the host gets a result, and every process takes its result.

An error of phase 2 (a mismatch between hosts, a lost host) reaches the host's other processes in
phase 3 as the same class; an error of phase 1 is every host process's verdict, and the leader
tells the other hosts. A host with only one of the group's processes skips both shared-memory
phases.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np

from collective.algorithms.ops import Array
from collective.arrays import CPU
from collective.calls import rules_of
from collective.calls.base import Call
from collective.calls.layout import Layout
from collective.calls.movement import Copy, Movement, Nothing
from collective.calls.signature import Rules, Signature
from collective.errors import CollectiveError
from collective.executors.step import Step
from collective.node.protocol import VERDICT_GRACE
from collective.pool import pool
from collective.shm.chunks import Pieces
from collective.shm.group import ShmGroup
from collective.transport.shm_ring import INLINE_BYTES

if TYPE_CHECKING:
    from collective.node import Host, NodeJob

__all__ = ["HostTier"]

_RELAYED = Rules(())  # phase 3: the leader's call is the host's (only the kinds are compared)


def _own(call: Call) -> Array | None:
    """This process's input in host memory (None where it has none)."""
    src = call.source()
    return None if src is None else CPU.adopt(src)


class _Inward:
    """Phase 1 of one process: its call, agreed as the collective's own, its input moved to the
    host's leader as the call's movement wants it (``Movement.inward``)."""

    source_elsewhere = True  # a broadcast or scatter rooted on another host has no source here
    repeated = False

    def __init__(self, call: Call, tier: HostTier) -> None:
        self.call = call
        self.tier = tier
        self.signature = call.signature

    def rules(self, kind: str) -> Rules:
        return rules_of(kind)

    def outer(self, agreed: Signature) -> Signature:
        """The host's agreed call as the group's: a source found on this host named by its group rank."""
        if self.call.rules.sourced and self.signature.root is None and agreed.root is not None:
            return agreed._replace(root=self.tier.ranks[agreed.root])
        return agreed

    def movement(self, agreed: Signature) -> Movement:
        """The host-level movement that brings this host's inputs to its leader."""
        tier = self.tier
        return self.call.movement(self.outer(agreed), len(tier.members)).inward(tuple(tier.ranks))

    def source(self) -> np.ndarray | Pieces | None:
        pieces = self.call.unpacked()
        if pieces is not None and self.call.x.nbytes > INLINE_BYTES:
            return Pieces(pieces)  # read in place by the chunks, never packed
        return _own(self.call)

    def target(self, agreed: Signature, movement: Movement) -> Array | None:
        assert self.tier.group is not None
        size = movement.result_size(self.tier.group.rank)
        return None if size is None else pool.empty((size,), movement.dtype)


class _Relay:
    """Phase 3 of one process: the leader's globally agreed call, and the host's product where
    another process of the host gets a result from it."""

    source_elsewhere = False
    repeated = False

    def __init__(
        self, tier: HostTier, step: Step, signature: Signature, product: Array | None = None
    ) -> None:
        self.tier = tier
        self.step = step
        self.signature = signature  # the leader's: the global call; the others': their own
        self.product = product  # the leader's
        self.into: Array | None = None  # a receiver's result, when the product went straight into it

    def rules(self, kind: str) -> Rules:
        return _RELAYED

    def movement(self, agreed: Signature) -> Movement:
        tier, call = self.tier, self.step.call
        outer = call.movement(agreed, len(tier.members))
        h = len(tier.host)
        if all(outer.result_size(rank) is None for rank in tier.ranks[1:]):
            return Nothing(h, agreed.dtype)  # (no other process here gets a result: a barrier)
        size = outer.between(tier.layout).result_size(tier.layout.me)
        assert size is not None
        return Copy(h, agreed.dtype, size, 0)

    def source(self) -> np.ndarray | Pieces | None:
        return None if self.product is None else self.product.reshape(-1)

    def target(self, agreed: Signature, movement: Movement) -> Array | None:
        assert self.tier.group is not None
        size = movement.result_size(self.tier.group.rank)
        if size is None or self.tier.leader:
            return None
        step, call = self.step, self.step.call
        outer = call.movement(agreed, len(self.tier.members))
        if outer.whole and outer.result_size(step.rank) is not None:  # the product is the result
            into = call.new_result(call.device, agreed, step.plan.size, step.rank)
            if type(into) is np.ndarray:  # (a CuPy result: received on the host, then copied over)
                self.into = into
                return into
        return pool.empty((size,), movement.dtype)


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

    @classmethod
    def of(cls, node: NodeJob, members: tuple[int, ...], hosts: list[Host]) -> HostTier:
        """The tier of the group ``members`` whose processes run on ``hosts`` (one each)."""
        nodes = node.nodes_of(members)
        leader_of = {host: nodes[hosts.index(host)] for host in set(hosts)}  # its lowest rank's node
        here = tuple(peer for peer, host in zip(members, hosts, strict=True) if host == node.host)
        node_of = {peer: leader_of[host] for peer, host in zip(members, hosts, strict=True)}
        layout = Layout.of(members, node_of, leader_of[node.host])
        purpose = f"host tier of {members}"  # another group with these processes here: another channel
        group = ShmGroup(node.ring(), here, node.me_in(members), purpose) if len(here) > 1 else None
        return cls(group, here, members, layout)

    # -- phase 1 --------------------------------------------------------------------------------

    def collect(self, step: Step) -> tuple[Signature, list[Array]]:
        """Phase 1: (the host's agreed call, the leader's inputs for its contribution; [] elsewhere).

        Raises the host's verdict on every process of the host (a mismatch, a bad argument, a
        lost process), the same everywhere.
        """
        plan, call = step.plan, step.call
        own = _own(call)
        if self.group is None:
            return plan.agreed, [] if own is None else [own]
        inward = _Inward(call, self)
        agreed, result = self.group.run(
            2 * plan.number, plan.label, step.deadline, step.timeout, inward, plan.error
        )
        return inward.outer(agreed), inward.movement(agreed).at_leader(result, own) if self.leader else []

    # -- phase 3 --------------------------------------------------------------------------------

    def send(self, step: Step, agreed: Signature, product: Array | None) -> None:
        """Phase 3 on the leader: the agreed call and the host's product to the others."""
        if self.group is not None:
            relay = _Relay(self, step, agreed, product)
            self.group.run(self._enter(step), step.plan.label, step.deadline, step.timeout, relay)

    def _enter(self, step: Step) -> int:
        self._out = 2 * step.plan.number + 1
        return self._out

    def fail(self, step: Step, error: CollectiveError) -> None:
        """Phase 3 for a process that failed after phase 1 (a leader whose phase 2 failed, say):
        the host's others raise ``error``'s class at once. Nothing to do once phase 3 was entered
        (the shared-memory step tells the others itself)."""
        if self.group is None or self._out == 2 * step.plan.number + 1:
            return
        number = self._enter(step)
        with contextlib.suppress(CollectiveError):  # ``error`` itself, recorded for the others
            self.group.run(number, step.plan.label, step.deadline, step.timeout, None, error)

    def receive(self, step: Step) -> tuple[Signature, Array | None, Array | None]:
        """Phase 3 on the others: (the agreed call, the product, or this process's result when the
        product went straight into it)."""
        assert self.group is not None
        # the leader may wait for the other hosts until its deadline and a grace: then tells why
        deadline = step.deadline + 2 * VERDICT_GRACE
        relay = _Relay(self, step, step.call.signature)
        agreed, product = self.group.run(self._enter(step), step.plan.label, deadline, step.timeout, relay)
        return agreed, product, relay.into
