"""Executors: the ways one agreed collective runs, behind one interface, chosen in one place.

* ``Fused``: small numpy arrays in one process. The last peer at the rendezvous computes every
  peer's result (``Movement.fuse``) and writes it where that peer gets it. One wake-up per peer.
* ``Shared``: mid-size numpy arrays in one process. Every peer reads the others' inputs directly
  and does its share (``Movement.part``: e.g. its slice of a reduction), all meet at one barrier,
  then each finishes (``Movement.after``: e.g. copies the shared result out).
* ``Linked``: anything else in one process (large arrays, CuPy): the configured strategy's
  schedule (collective.algorithms) over the in-process Link.
* ``ShmExecutor`` (collective.shm_executor): peers each in their own process, all on this host.
* ``ThreePhase`` (collective.three_phase): peers on several nodes; with a ``HostTier``
  (collective.host_tier) when hosts run several of the group's processes.

Each asks the call's movement (collective.movement) what to do, never the collective's name.

Every path gives every peer the same bits. Fused, Shared, the shared-memory path and the
Centralized and Direct schedules combine inputs in rank order ((x0 op x1) op x2 ...), so for a
given input they agree with each other bit for bit; Tree and Ring combine in their own fixed
order (docs/algorithms), which float rounding may tell apart. ``choose`` is the one place that
picks the executor: every rule of eligibility is here, from facts the node gives (host identities
of the topology), the same on every process of a group.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from collective.algorithms.ops import Array, array_module, copy_into
from collective.algorithms.strategies import Strategy
from collective.arrays import CPU, flat
from collective.call import Call
from collective.errors import CollectiveError
from collective.host_tier import HostTier
from collective.layout import Layout
from collective.movement import Movement
from collective.shm_executor import ShmExecutor, ShmGroup
from collective.signature import Signature
from collective.step import Executor, Site, Step
from collective.three_phase import ThreePhase
from collective.transport.inproc import Exchange, InProcessLink

__all__ = ["DEFAULT_FUSE_BELOW", "DEFAULT_SHARE_BELOW", "Fused", "Linked", "Shared", "choose"]

log = logging.getLogger("collective.executors")  # DEBUG: the path every step takes

DEFAULT_FUSE_BELOW = 64 * 1024
DEFAULT_SHARE_BELOW = 4 << 20


def _numpy_within(calls: list[Call], inputs: list[Any], limit: int) -> bool:
    """Every peer is on the host and every input is a numpy array of at most ``limit`` bytes (peers
    without an input, e.g. a broadcast's receivers, are fine)."""
    for call, a in zip(calls, inputs, strict=True):
        if call.device is not CPU or (a is not None and (type(a) is not np.ndarray or a.nbytes > limit)):
            return False
    return True


def choose(
    site: Site,
    members: tuple[int, ...],
    local: tuple[int, ...],
    agreed: Signature,
    calls: list[Call],
    label: str,
) -> Executor:
    """How the step ``agreed`` of the group ``members`` runs, given every local peer's call.

    Raises a CollectiveError the call's movement finds in the agreed call (the same on every peer).
    """
    executor = _choose(site, members, local, agreed, calls, label)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s of group %s: %s", label, members, executor.path)
    return executor


def _choose(
    site: Site,
    members: tuple[int, ...],
    local: tuple[int, ...],
    agreed: Signature,
    calls: list[Call],
    label: str,
) -> Executor:
    if site.node is not None:
        return _across_processes(site, members, local, label)
    movement = calls[0].movement(agreed, len(members))
    inputs = [call.source() for call in calls]
    if site.fuse_below and _numpy_within(calls, inputs, site.fuse_below):
        return Fused(agreed, calls, movement.fuse(inputs))
    exchange = Exchange(members, label)
    site.exchanges.add(exchange)
    if site.share_below and _numpy_within(calls, inputs, site.share_below):
        return Shared(exchange, inputs, movement, movement.shared(inputs))
    return Linked(exchange, site.config.local_strategy(calls[0].strategy_kind), movement)


def _across_processes(site: Site, members: tuple[int, ...], local: tuple[int, ...], label: str) -> Executor:
    """A group of a multi-node job: shared memory when its processes all run on this host, each
    the one peer of its process in the group; three phases otherwise, with a host tier when it
    spans several hosts and some host runs several of its processes."""
    place = site.once(members, _placed, site, members)
    if isinstance(place, ShmExecutor):
        return place
    if isinstance(place, HostTier):
        return ThreePhase(site, members, local, label, place.layout, place)
    return ThreePhase(site, members, local, label, place)


def _placed(site: Site, members: tuple[int, ...]) -> ShmExecutor | HostTier | Layout:
    """Where the group ``members`` of a multi-node job runs (decided once per group, the same way
    on every process of it): its shared-memory executor, its host tier, or the layout of its
    nodes for three phases."""
    node = site.node
    assert node is not None
    hosts = node.hosts_of(members)  # None: not one process per peer, each with a ring segment
    if hosts is not None:
        if all(host == node.host for host in hosts):
            return ShmExecutor(ShmGroup(node.ring(), members, node.me_in(members)))
        if len(set(hosts)) > 1 and max(map(hosts.count, set(hosts))) > 1:
            return HostTier.of(node, members, hosts)
    return node.layout_of(members)


def _target(step: Step, movement: Movement) -> tuple[Array | None, Array | None, Array | None]:
    """(the result, the flat buffer the work writes, a scratch buffer to copy back from or None).

    A scratch stands in for the result when the movement's schedules may not write ``out`` while
    it is also ``x`` (an exchange reads x's blocks while it writes the result).
    """
    call, plan = step.call, step.plan
    result = call.new_result(call.device, plan.agreed, plan.size, step.rank)
    if result is None:
        return None, None, None
    buffer = flat(result)
    if (
        not movement.alias_safe
        and call.x is not None
        and array_module(buffer).may_share_memory(buffer, call.x)
    ):
        scratch = array_module(buffer).empty_like(buffer)
        return result, scratch, scratch
    return result, buffer, None


class Fused:
    """The last peer at the rendezvous computed every peer's result and wrote it into that peer's
    ``out`` or a new array, so a woken peer only returns it: a woken peer with work left would queue
    for the GIL behind the others (measured: the slower the path after the wake-up, the more
    wake-ups wait for the GIL). In one process every member is local, so local index = rank.

    ``fused`` holds fresh arrays (never views of an input), so writing a result into ``out = x``
    cannot change what another rank reads, even for an exchange in place.
    """

    path = "fused"

    def __init__(self, agreed: Signature, calls: list[Call], fused: list[Any]) -> None:
        size = len(calls)
        self.results: list[Array | None] = []
        for rank, call in enumerate(calls):
            value = fused[rank]
            if call.out is None and value is not None and value.dtype == agreed.dtype:  # a new result:
                shape = call.result_shape(agreed, size, rank)  # a copy of the value, in one call
                if shape is not None and value.shape != shape:
                    value = value.reshape(shape)
                result = None if shape is None else value.copy()
            else:
                result = call.new_result(call.device, agreed, size, rank)
                if result is not None:
                    result.reshape(-1)[...] = value  # results are C-contiguous numpy arrays
            self.results.append(result)

    def run(self, step: Step) -> Array | None:
        return self.results[step.rank]

    def abort(self, error: CollectiveError) -> None:
        """Nobody waits for anybody on this path."""


class Shared:
    """Each peer does its part reading the others' inputs, all meet at one barrier, each finishes."""

    path = "shared"

    def __init__(self, exchange: Exchange, inputs: list[Any], movement: Movement, state: Any) -> None:
        self.exchange = exchange
        self.inputs = inputs
        self.movement = movement
        self.state = state

    def run(self, step: Step) -> Array | None:
        movement = self.movement
        result, buffer, scratch = _target(step, movement)
        movement.part(self.inputs, self.state, step.rank, buffer)
        self.exchange.barrier(step.index, step.deadline)
        movement.after(self.state, step.rank, buffer)
        if scratch is not None:
            copy_into(flat(result), scratch)
        return result

    def abort(self, error: CollectiveError) -> None:
        self.exchange.abort(error)


class Linked:
    """The configured strategy's schedule over the in-process Link."""

    path = "linked"

    def __init__(self, exchange: Exchange, strategy: Strategy, movement: Movement) -> None:
        self.exchange = exchange
        self.strategy = strategy
        self.movement = movement

    def run(self, step: Step) -> Array | None:
        result, buffer, scratch = _target(step, self.movement)
        link = InProcessLink(self.exchange, step.index, step.deadline)
        self.movement.run_link(self.strategy, link, step.call.source(), buffer)
        link.flush()
        if scratch is not None:
            copy_into(flat(result), scratch)
        return result

    def abort(self, error: CollectiveError) -> None:
        self.exchange.abort(error)
