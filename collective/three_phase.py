"""The ThreePhase executor: a collective among peers on several nodes.

As burn-collective does it, in three phases, for every collective:

1. the node's leader (its lowest local rank) makes the node's *contribution* from its local peers'
   inputs, read straight from their memory (they are threads of this process): the local
   reduction for all_reduce / reduce / reduce_scatter, the local blocks for all_gather / gather /
   all_to_all, the root's array for broadcast / scatter;
2. the leaders exchange their calls (every leader checks every call, so a mismatch is the same
   error everywhere), then run the same collective among themselves, node by node, with the
   global strategy over ZeroMQ; contributions of at most SMALL_BYTES travel with the calls instead
   and every leader combines them itself (one round);
3. the leader announces the node's product and each local peer takes its result from it.

Nodes may hold different numbers of a group's peers, in any rank order: node-level blocks are
laid out node-major and padded to the largest node (``Layout``), so the global phase always works
on equal blocks, and phase 3 picks every rank's block from its (node, local index) slot.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from collective.algorithms.ops import Array, array_module
from collective.arrays import CPU, flat
from collective.call import reduce_all
from collective.calls import WHOLE
from collective.errors import CollectiveError, MismatchError, PeerLostError
from collective.layout import Layout
from collective.protocol import VERDICT_GRACE
from collective.signature import Signature
from collective.transport.inproc import Exchange
from collective.transport.wire import SMALL_BYTES

if TYPE_CHECKING:
    from collective.host_tier import HostTier
    from collective.node import NodeJob
    from collective.step import Site, Step

__all__ = ["ThreePhase"]


def _rows(array: Array, rows: int) -> Array:
    return array.reshape(rows, -1) if rows else array.reshape(0, 0)


def _contribution(kind: str, agreed: Signature, srcs: list[Any], ranks: list[int], layout: Layout) -> Any:
    """This node's part of the global phase, from its local peers' flat inputs (by local index)."""
    n, m, width = len(layout.position), len(layout.nodes), layout.width
    present = [src for src in srcs if src is not None]
    xp = array_module(present[0]) if present else np
    if kind in ("all_reduce", "reduce", "all_reduce_coalesced"):
        assert agreed.op is not None
        return reduce_all(agreed.op, srcs) if len(srcs) > 1 else srcs[0]
    if kind == "broadcast":
        return present[0] if present else None
    if kind == "barrier":
        return None
    if kind in ("all_gather", "gather"):
        out = xp.zeros(width * srcs[0].size, srcs[0].dtype)
        for index, src in enumerate(srcs):
            _rows(out, width)[index] = src
        return out
    if kind == "reduce_scatter":
        assert agreed.op is not None
        total = reduce_all(agreed.op, srcs) if len(srcs) > 1 else srcs[0]
        out = xp.zeros(m * width * (total.size // n), total.dtype)
        _rows(out, m * width)[layout.slots] = _rows(total, n)
        return out
    if kind == "all_to_all":
        k = srcs[0].size // n
        out = xp.zeros(m * width * width * k, srcs[0].dtype)
        grid = out.reshape(m, width, width, k)
        for rank, src in zip(ranks, srcs, strict=True):
            grid[np.asarray(layout.position), layout.local[rank], np.asarray(layout.local)] = _rows(src, n)
        return out
    if kind == "scatter":
        if not present:
            return None
        root = present[0]
        out = xp.zeros(m * width * (root.size // n), root.dtype)
        _rows(out, m * width)[layout.slots] = _rows(root, n)
        return out
    raise AssertionError(f"no three-phase layout for {kind}")


def _product_size(kind: str, agreed: Signature, layout: Layout) -> int:
    """Elements of the node-level result this node receives."""
    n, m, width = len(layout.position), len(layout.nodes), layout.width
    total = math.prod(agreed.shape) if agreed.shape is not None else 0
    return {
        "all_gather": m * width * total,
        "gather": m * width * total,
        "reduce_scatter": width * (total // n),
        "all_to_all": m * width * width * (total // n),
        "scatter": width * total,
        "barrier": 0,
    }.get(kind, total)


def _take(kind: str, product: Any, rank: int, layout: Layout, dst: Array) -> None:
    """Phase 3: rank ``rank``'s result out of the node's product."""
    n, m, width = len(layout.position), len(layout.nodes), layout.width
    if kind in ("all_gather", "gather"):
        _rows(dst, n)[...] = _rows(product, m * width)[layout.slots]
    elif kind in ("reduce_scatter", "scatter"):
        dst[...] = _rows(product, width)[layout.local[rank]]
    elif kind == "all_to_all":
        grid = product.reshape(m, width, width, -1)
        _rows(dst, n)[...] = grid[np.asarray(layout.position), np.asarray(layout.local), layout.local[rank]]
    else:
        dst[...] = product


def _contribution_size(kind: str, agreed: Signature, layout: Layout) -> int:
    """Elements of a node's contribution (the root node's, for broadcast and scatter)."""
    n, m, width = len(layout.position), len(layout.nodes), layout.width
    total = math.prod(agreed.shape) if agreed.shape is not None else 0
    return {
        "all_gather": width * total,
        "gather": width * total,
        "reduce_scatter": m * width * (total // n) if n else 0,
        "all_to_all": m * width * width * (total // n) if n else 0,
        "scatter": m * width * total,
        "barrier": 0,
    }.get(kind, total)


class ThreePhase:
    """One step of a group whose peers live on several nodes (or a multi-node job's any step)."""

    def __init__(
        self,
        site: Site,
        members: tuple[int, ...],
        local: tuple[int, ...],
        label: str,
        tier: HostTier | None = None,
    ) -> None:
        assert site.node is not None
        self.node: NodeJob = site.node
        self.config = site.config
        self.members = members
        self.local = local  # the group's peers in this process
        self.tier = tier  # hosts as nodes: this host's processes of the group (NodeJob.tier)
        self.exchange = Exchange(local, label) if len(local) > 1 else None
        if self.exchange is not None:
            site.exchanges.add(self.exchange)

    @property
    def path(self) -> str:
        return "three phases" if self.tier is None else "host tier"

    def abort(self, error: CollectiveError) -> None:
        if self.exchange is not None:
            self.exchange.abort(error)
        if self.tier is not None and self.tier.group is not None:
            self.tier.group.abort(error)

    def run(self, step: Step) -> Array | None:
        plan, tier = step.plan, self.tier
        layout = self.node.layout(self.members)
        if tier is not None and tier.group is not None:
            return self._tiered(step, layout, tier)
        if plan.error is not None:  # this peer tells the other nodes the step failed here
            self.node.agree(self.members, plan.number, plan.error, None, step.deadline)
            raise plan.error  # not reached: agree() raises the shared verdict
        if step.index == 0:
            srcs = [_host(c.source()) for c in plan.calls]
            ranks = [self.members.index(peer) for peer in self.local]
            try:
                agreed, product, result = self._lead(step, layout, plan.agreed, srcs, ranks)
            except CollectiveError as exc:
                self.abort(exc)
                raise
            if self.exchange is not None:
                self.exchange.announce((agreed, product))
            if result is not None:  # the product was written straight into this peer's result
                return result
        else:
            assert self.exchange is not None
            agreed, product = self.exchange.announcement(
                step.index, step.deadline + 2 * VERDICT_GRACE, f"the leader of {plan.label}"
            )
        return _result(step, agreed, product, layout)

    def _tiered(self, step: Step, layout: Layout, tier: HostTier) -> Array | None:
        """The three phases with this host's processes as the node's local peers (host_tier)."""
        try:
            with self.node.giving_up(self.members, step.plan.number) if tier.leader else nullcontext():
                local, srcs = tier.collect(step)  # (giving_up: any other failure, told to the other hosts)
        except CollectiveError as exc:
            if tier.leader:  # the other hosts hear of it (agree raises the shared verdict)
                self.node.agree(self.members, step.plan.number, exc, None, step.deadline)
            raise
        try:
            if tier.leader:
                agreed, product, result = self._lead(step, layout, local, srcs, tier.ranks)
                tier.send(step, agreed, product)
            else:
                agreed, product, result = tier.receive(step)
        except BaseException as exc:  # the host's others, waiting in phase 3, raise it at once
            if not isinstance(exc, CollectiveError):
                exc = PeerLostError(f"{step.plan.label}: peer {step.peer} failed: {exc!r}", [step.peer])
            tier.fail(step, exc)
            raise
        if result is not None or product is None:
            return result
        return _result(step, agreed, product.reshape(-1), layout)

    def _lead(
        self, step: Step, layout: Layout, local: Signature, srcs: list[Any], ranks: list[int]
    ) -> tuple[Signature, Any, Array | None]:
        """Phases 1 and 2 on the leader, from its node's agreed call ``local`` and its local peers'
        inputs ``srcs`` (group ranks ``ranks``): (the globally agreed call, the node's product, and
        this peer's result when the product was written straight into it)."""
        plan, call, node = step.plan, step.call, self.node
        kind = local.kind
        with node.giving_up(self.members, plan.number):
            contribution = _contribution(kind, local, srcs, ranks, layout)
            attach = contribution if contribution is not None and contribution.nbytes <= SMALL_BYTES else None
            agreed, payloads = node.agree(self.members, plan.number, local, attach, step.deadline)
            root = None if agreed.root is None else layout.position[agreed.root]
            node_sig = agreed._replace(root=root)
            size = _contribution_size(kind, agreed, layout)
            needed = [root or 0] if kind in ("broadcast", "scatter") else range(len(layout.nodes))
            if kind == "barrier" or all(payloads.get(p) is not None for p in needed):
                inputs = [_payload(payloads.get(p), agreed, size) for p in range(len(layout.nodes))]
                return agreed, type(call).fuse(node_sig, inputs)[layout.me], None
            result = None
            if kind in ("reduce", "gather") and root != layout.me:
                product = None
            elif kind in WHOLE and self.exchange is None and call.out is not call.x:
                result = call.new_result(call.device, agreed, plan.size, step.rank)
                host = None if result is None else flat(result)
                product = host if isinstance(host, np.ndarray) else np.empty(size, agreed.dtype)
                if not isinstance(host, np.ndarray):
                    result = None
            else:
                product = np.empty(_product_size(kind, agreed, layout), agreed.dtype)
            link = node.link(self.members, plan.number, agreed, step.deadline)
            call.run_link(self.config.global_strategy, link, node_sig, contribution, product)
            link.flush()
        return agreed, product, result


def _result(step: Step, agreed: Signature, product: Any, layout: Layout) -> Array | None:
    """Phase 3 for one peer: its result taken from its node's product."""
    call, plan = step.call, step.plan
    result = call.new_result(call.device, agreed, plan.size, step.rank)
    if result is not None and product is not None:
        target = flat(result)
        if isinstance(target, np.ndarray):
            _take(agreed.kind, product, step.rank, layout, target)
        else:  # a CuPy result: take on the host, then copy over once
            staged = np.empty(target.shape, target.dtype)
            _take(agreed.kind, product, step.rank, layout, staged)
            target.set(staged)
    return result


def _host(array: Array | None) -> np.ndarray | None:
    return None if array is None else CPU.adopt(array)


def _payload(payload: Any, agreed: Signature, size: int) -> Any:
    """A node's small contribution (bytes from its call) as an array, its length checked first."""
    if payload is None or isinstance(payload, np.ndarray):
        return payload
    dtype = np.dtype(agreed.dtype)
    data = memoryview(payload).cast("B")
    if len(data) != size * dtype.itemsize:
        raise MismatchError(f"a contribution of {len(data)} bytes arrived for {size} elements of {dtype}")
    return np.frombuffer(data, dtype) if size else np.empty(0, dtype)
