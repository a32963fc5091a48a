"""The ThreePhase executor: a collective among peers on several nodes.

As burn-collective does it, in three phases, for every collective:

1. the node's leader (its lowest local rank) makes the node's *contribution* from its local peers'
   inputs, read straight from their memory (they are threads of this process), as the call's
   movement says (``Movement.contribution``: reduced, stacked, the root's array, ...);
2. the leaders exchange their calls (every leader checks every call, so a mismatch is the same
   error everywhere), then run the same movement among themselves, node by node
   (``Movement.between``), with the call's strategy (else the global one; ``auto`` resolved by
   collective.tuning, from the agreed call) over ZeroMQ; contributions of at most
   SMALL_BYTES travel with the calls instead and every leader combines them itself (one round);
3. the leader announces the node's product and each local peer takes its result from it
   (``Movement.take``).

Nodes may hold different numbers of a group's peers, in any rank order: node-level blocks are
laid out node-major (``Layout``) and may be of any size, so no node is padded to another's.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from collective.algorithms.ops import Array
from collective.algorithms.strategies import Auto
from collective.arrays import CPU, flat
from collective.calls.layout import Layout
from collective.calls.signature import Signature
from collective.errors import CollectiveError, MismatchError, PeerLostError
from collective.executors.choice import call_size, leaders_hosts, leaders_key, requested
from collective.node.protocol import VERDICT_GRACE
from collective.transport.inproc import Exchange
from collective.transport.wire import SMALL_BYTES
from collective.tuning import resolve

if TYPE_CHECKING:
    from collective.executors.host_tier import HostTier
    from collective.executors.step import Site, Step
    from collective.node import NodeJob

__all__ = ["ThreePhase"]


class ThreePhase:
    """One step of a group whose peers live on several nodes (or a multi-node job's any step)."""

    runs_again = True  # (for a peer alone in its process: no exchange; the step's number is the plan's)

    def __init__(
        self,
        site: Site,
        members: tuple[int, ...],
        local: tuple[int, ...],
        label: str,
        layout: Layout,
        tier: HostTier | None = None,
    ) -> None:
        assert site.node is not None
        self.node: NodeJob = site.node
        self.config = site.config
        self.members = members
        self.local = local  # the group's peers in this process
        self.layout = layout  # where the group's ranks live: nodes, or hosts with a tier
        self.tier = tier  # hosts as nodes: this host's processes of the group
        self.chooser = site.chooser
        self.hosts = leaders_hosts(self.node, layout, tier is not None)
        self.exchange = Exchange(local, label) if len(local) > 1 else None
        if self.exchange is not None:
            site.exchanges.add(self.exchange)

    strategy = None  # (chosen per call between the leaders: the call is told, in _lead)

    @property
    def path(self) -> str:
        return "three phases" if self.tier is None else "host tier"

    def abort(self, error: CollectiveError) -> None:
        if self.exchange is not None:
            self.exchange.abort(error)
        if self.tier is not None and self.tier.group is not None:
            self.tier.group.abort(error)

    def lane(self, step: Step) -> None:
        """None: a use runs as ``run`` (through ``Rendezvous.again``), its exchange with the nodes'
        costs beyond what a lane would save."""
        return None

    def run(self, step: Step) -> Array | None:
        plan, tier = step.plan, self.tier
        if tier is not None and tier.group is not None:
            return self._tiered(step, tier)
        if plan.error is not None:  # this peer tells the other nodes the step failed here
            self.node.agree(self.members, self.layout, plan.number, plan.error, None, step.deadline)
            raise plan.error  # not reached: agree() raises the shared verdict
        if step.index == 0:
            srcs = [_host(c.source()) for c in plan.calls]
            ranks = [self.members.index(peer) for peer in self.local]
            try:
                agreed, product, result = self._lead(step, plan.agreed, srcs, ranks)
            except CollectiveError as exc:
                self.abort(exc)
                raise
            if self.exchange is not None:
                self.exchange.announce((agreed, product))
            if result is not None:  # the product was written straight into this peer's result
                step.agreed = agreed
                return result
        else:
            assert self.exchange is not None
            agreed, product = self.exchange.announcement(
                step.index, step.deadline + 2 * VERDICT_GRACE, f"the leader of {plan.label}"
            )
        step.agreed = agreed
        return self._result(step, agreed, product)

    def _tiered(self, step: Step, tier: HostTier) -> Array | None:
        """The three phases with this host's processes as the node's local peers (host_tier)."""
        layout = self.layout
        try:
            giving_up = self.node.giving_up(self.members, layout, step.plan.number)
            with giving_up if tier.leader else nullcontext():
                local, srcs = tier.collect(step)  # (giving_up: any other failure, told to the other hosts)
        except CollectiveError as exc:
            if tier.leader:  # the other hosts hear of it (agree raises the shared verdict)
                self.node.agree(self.members, layout, step.plan.number, exc, None, step.deadline)
            raise
        try:
            if tier.leader:
                agreed, product, result = self._lead(step, local, srcs, tier.ranks)
                tier.send(step, agreed, product)
            else:
                agreed, product, result = tier.receive(step)
        except BaseException as exc:  # the host's others, waiting in phase 3, raise it at once
            if not isinstance(exc, CollectiveError):
                exc = PeerLostError(f"{step.plan.label}: peer {step.peer} failed: {exc!r}", [step.peer])
            tier.fail(step, exc)
            raise
        step.agreed = agreed
        if result is not None or product is None:
            return result
        return self._result(step, agreed, product.reshape(-1))

    def _lead(
        self, step: Step, local: Signature, srcs: list[Array], ranks: list[int]
    ) -> tuple[Signature, Any, Array | None]:
        """Phases 1 and 2 on the leader, from its node's agreed call ``local`` and its local peers'
        inputs ``srcs`` (group ranks ``ranks``): (the globally agreed call, the node's product, and
        this peer's result when the product was written straight into it)."""
        plan, call, node, layout = step.plan, step.call, self.node, self.layout
        n = plan.size
        kind = call.strategy_kind
        # Every leader states the strategy it runs with: nodes configured apart fail alike, not hang.
        stating = local._replace(strategy=str(requested(local, self.config.global_strategy(kind))))
        with node.giving_up(self.members, layout, plan.number):
            contribution = call.movement(local, n).contribution(layout, srcs, ranks)
            attach = contribution if contribution is not None and contribution.nbytes <= SMALL_BYTES else None
            stated, payloads = node.agree(self.members, layout, plan.number, stating, attach, step.deadline)
            agreed = stated._replace(strategy=local.strategy)  # (as named: this host's others compare it)
            movement = call.movement(agreed, n)
            nodes = movement.between(layout)
            sizes = [nodes.source_size(p) for p in range(layout.size)]
            if all(payloads.get(p) is not None for p, size in enumerate(sizes) if size is not None):
                inputs = [_payload(payloads.get(p), nodes.dtype, size) for p, size in enumerate(sizes)]
                return agreed, nodes.fuse(inputs)[layout.me], None
            result = None
            size = nodes.result_size(layout.me)
            if size is None:  # this node gets nothing (a reduce or gather rooted elsewhere)
                product = None
            elif movement.whole and self.exchange is None and call.out is not call.x:
                result = call.new_result(call.device, agreed, n, step.rank)
                host = None if result is None else flat(result)
                product = host if isinstance(host, np.ndarray) else np.empty(size, agreed.dtype)
                if not isinstance(host, np.ndarray):
                    result = None
            else:
                product = np.empty(size, agreed.dtype)
            link = node.link(self.members, layout, plan.number, agreed, step.deadline)
            key = leaders_key(layout, self.hosts, kind)
            strategy = resolve(requested(stated, Auto()), self.chooser, key, *call_size(agreed))
            call.algorithm = strategy  # (for the flight recorder)
            nodes.run_link(strategy, link, contribution, product)
            link.flush()
        return agreed, product, result

    def _result(self, step: Step, agreed: Signature, product: Array | None) -> Array | None:
        """Phase 3 for one peer: its result taken from its node's product."""
        call, plan = step.call, step.plan
        result = call.new_result(call.device, agreed, plan.size, step.rank)
        if result is not None and product is not None:
            movement = call.movement(agreed, plan.size)
            target = flat(result)
            if isinstance(target, np.ndarray):
                movement.take(self.layout, product, step.rank, target)
            else:  # a CuPy result: take on the host, then copy over once
                staged = np.empty(target.shape, target.dtype)
                movement.take(self.layout, product, step.rank, staged)
                target.set(staged)
        return result


def _host(array: Array | None) -> np.ndarray | None:
    return None if array is None else CPU.adopt(array)


def _payload(payload: Any, dtype: Any, size: int | None) -> Any:
    """A node's small contribution (bytes from its call) as an array, its length checked first."""
    if payload is None or isinstance(payload, np.ndarray) or size is None:
        return payload
    dtype = np.dtype(dtype)
    data = memoryview(payload).cast("B")
    if len(data) != size * dtype.itemsize:
        raise MismatchError(f"a contribution of {len(data)} bytes arrived for {size} elements of {dtype}")
    return np.frombuffer(data, dtype) if size else np.empty(0, dtype)
