"""Executors: the ways one agreed collective runs, behind one interface, chosen in one place.

* ``Fused``: small numpy arrays in one process. The last peer at the rendezvous computes every
  peer's result (``Call.fuse``) and writes it where that peer gets it. One wake-up per peer.
* ``Shared``: mid-size numpy arrays in one process. Every peer reads the others' inputs directly
  and does its share (``Call.part``: e.g. its slice of a reduction), all meet at one barrier, then
  each finishes (``Call.after``: e.g. copies the shared result out).
* ``Linked``: anything else in one process (large arrays, CuPy): the configured strategy's
  schedule (collective.algorithms) over the in-process Link.
* ``ShmGroup`` (collective.shm_executor): peers each in their own process, all on this host
  (NodeJob.shm_group decides from the topology's host identities).
* ``ThreePhase`` (collective.three_phase): peers on several nodes.

Every path gives every peer the same bits. Fused, Shared, the shared-memory path and the
Centralized and Direct schedules combine inputs in rank order ((x0 op x1) op x2 ...), so for a
given input they agree with each other bit for bit; Tree and Ring combine in their own fixed
order (docs/algorithms), which float rounding may tell apart. ``choose`` is the one place that
picks the executor.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from collective.algorithms.ops import Array, array_module, copy_into
from collective.arrays import CPU, flat
from collective.call import Call
from collective.errors import CollectiveError
from collective.signature import Signature
from collective.step import Executor, Site, Step
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
    """How the step ``agreed`` of the group ``members`` runs, given every local peer's call."""
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
        shm = site.node.shm_group(members)  # every member its own process, all on this host
        if shm is not None:
            return shm
        from collective.three_phase import ThreePhase

        return ThreePhase(site, members, local, label, site.node.tier(members))
    inputs = [call.source() for call in calls]
    if site.fuse_below and _numpy_within(calls, inputs, site.fuse_below):
        return Fused(agreed, calls, type(calls[0]).fuse(agreed, inputs))
    exchange = Exchange(members, label)
    site.exchanges.add(exchange)
    if site.share_below and _numpy_within(calls, inputs, site.share_below):
        return Shared(exchange, inputs, type(calls[0]).shared(agreed, inputs))
    return Linked(exchange, site.config.local_strategy)


def _target(step: Step) -> tuple[Array | None, Array | None, Array | None]:
    """(the result, the flat buffer the work writes, a scratch buffer to copy back from or None).

    A scratch stands in for the result when the call's schedule may not write ``out`` while it is
    also ``x`` (all_to_all reads x's blocks while it writes the result).
    """
    call, plan = step.call, step.plan
    result = call.new_result(call.device, plan.agreed, plan.size, step.rank)
    if result is None:
        return None, None, None
    buffer = flat(result)
    if not call.alias_safe and call.x is not None and array_module(buffer).may_share_memory(buffer, call.x):
        scratch = array_module(buffer).empty_like(buffer)
        return result, scratch, scratch
    return result, buffer, None


class Fused:
    """The last peer at the rendezvous computed every peer's result and wrote it into that peer's
    ``out`` or a new array, so a woken peer only returns it: a woken peer with work left would queue
    for the GIL behind the others (measured: the slower the path after the wake-up, the more
    wake-ups wait for the GIL). In one process every member is local, so local index = rank.

    ``fused`` holds fresh arrays (never views of an input), so writing a result into ``out = x``
    cannot change what another rank reads, even for all_to_all in place.
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

    def __init__(self, exchange: Exchange, inputs: list[Any], state: Any) -> None:
        self.exchange = exchange
        self.inputs = inputs
        self.state = state

    def run(self, step: Step) -> Array | None:
        call, agreed = step.call, step.plan.agreed
        result, buffer, scratch = _target(step)
        call.part(agreed, self.inputs, self.state, step.rank, buffer)
        self.exchange.barrier(step.index, step.deadline)
        call.after(agreed, self.state, step.rank, buffer)
        if scratch is not None:
            copy_into(flat(result), scratch)
        return result

    def abort(self, error: CollectiveError) -> None:
        self.exchange.abort(error)


class Linked:
    """The configured strategy's schedule over the in-process Link."""

    path = "linked"

    def __init__(self, exchange: Exchange, strategy_for: Any) -> None:
        self.exchange = exchange
        self.strategy_for = strategy_for

    def run(self, step: Step) -> Array | None:
        result, buffer, scratch = _target(step)
        link = InProcessLink(self.exchange, step.index, step.deadline)
        step.call.run_link(self.strategy_for, link, step.plan.agreed, step.call.source(), buffer)
        link.flush()
        if scratch is not None:
            copy_into(flat(result), scratch)
        return result

    def abort(self, error: CollectiveError) -> None:
        self.exchange.abort(error)
