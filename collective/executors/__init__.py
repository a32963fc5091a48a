"""Executors: the ways one agreed collective runs, behind one interface, chosen in one place.

* ``Fused``: small numpy arrays in one process. The last peer at the rendezvous computes every
  peer's result (``Movement.fuse``) and writes it where that peer gets it. One wake-up per peer.
* ``Shared``: mid-size numpy arrays in one process. Every peer reads the others' inputs directly
  and does its share (``Movement.part``: e.g. its slice of a reduction), all meet at one barrier,
  then each finishes (``Movement.after``: e.g. copies the shared result out).
* ``Linked``: anything else in one process (large arrays, CuPy): the call's strategy's schedule
  (collective.algorithms) over the in-process Link, ``auto`` resolved by collective.tuning.
* ``ShmExecutor`` (collective.shm.group): peers each in their own process, all on this host.
* ``ThreePhase`` (collective.executors.three_phase): peers on several nodes; with a ``HostTier``
  (collective.executors.host_tier) when hosts run several of the group's processes.

Each asks the call's movement (collective.calls.movement) what to do, never the collective's name.

Every path gives every peer the same bits. Fused, Shared, the shared-memory path and the
Centralized and Direct schedules combine inputs in rank order ((x0 op x1) op x2 ...), so for a
given input they agree with each other bit for bit; Tree and Ring combine in their own fixed
order (docs/algorithms), which float rounding may tell apart. ``choose`` is the one place that
picks the executor: every rule of eligibility is here, from facts the node gives (host identities
of the topology), the same on every process of a group. ``schedule_key`` says where a group's
schedule runs (collective.tuning.Key), ``requested`` which strategy a call asks for.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from collective.algorithms.strategies import Auto
from collective.calls.base import Call
from collective.calls.layout import Layout
from collective.calls.signature import Signature
from collective.executors.choice import call_size, leaders_hosts, leaders_key, requested
from collective.executors.host_tier import HostTier
from collective.executors.local import Fused, Linked, Shared, numpy_within
from collective.executors.shm import ShmExecutor
from collective.executors.step import Executor, Site
from collective.executors.three_phase import ThreePhase
from collective.shm.group import ShmGroup
from collective.transport.inproc import Exchange
from collective.transport.wire import SMALL_BYTES
from collective.tuning import Explanation, Key, resolve
from collective.tuning.model import contribution_bytes

__all__ = [
    "DEFAULT_FUSE_BELOW",
    "DEFAULT_SHARE_BELOW",
    "Fused",
    "Linked",
    "Shared",
    "call_size",
    "choose",
    "explain",
    "leaders_key",
    "requested",
    "schedule_key",
]

log = logging.getLogger("collective.executors")  # DEBUG: the path every step takes

DEFAULT_FUSE_BELOW = 64 * 1024
DEFAULT_SHARE_BELOW = 4 << 20


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
    executor: Executor
    if site.node is not None:
        executor = _across_processes(site, members, local, label)
    else:
        movement = calls[0].movement(agreed, len(members))
        inputs = [call.source() for call in calls]
        if site.fuse_below and numpy_within(calls, inputs, site.fuse_below):
            executor = Fused(agreed, calls, movement.fuse(inputs))
        else:
            exchange = Exchange(members, label)
            site.exchanges.add(exchange)
            if site.share_below and numpy_within(calls, inputs, site.share_below):
                executor = Shared(exchange, inputs, movement, movement.shared(inputs))
            else:
                kind = calls[0].strategy_kind
                key = Key("inproc", kind, len(members))
                nbytes, elements = call_size(agreed)
                schedule = resolve(
                    requested(agreed, site.config.local_strategy(kind)), site.chooser, key, nbytes, elements
                )
                executor = Linked(exchange, schedule, movement)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s of group %s: %s", label, members, executor.path)
    return executor


def schedule_key(site: Site, members: tuple[int, ...], kind: str) -> tuple[str, Key | None]:
    """(the path, where its schedule runs) of a call of ``kind`` by the group ``members``: a path
    with no schedule to choose (shared memory) has no key. Fused and Shared, taken by small numpy
    arrays in one process, are decided per call (``choose``)."""
    if site.node is None:
        return "linked", Key("inproc", kind, len(members))
    place = site.once(members, _placed, site, members)
    if isinstance(place, ShmExecutor):
        return place.path, None
    if isinstance(place, HostTier):
        return "host tier", leaders_key(place.layout, leaders_hosts(site.node, place.layout, True), kind)
    return "three phases", leaders_key(place, leaders_hosts(site.node, place, False), kind)


def explain(site: Site, members: tuple[int, ...], kind: str, nbytes: int, elements: int) -> Explanation:
    """What a call of strategy kind ``kind`` with ``nbytes`` per peer (``elements`` of them, numpy
    arrays) by the group ``members`` would run, as choose() and ThreePhase decide it, and why."""
    path, key = schedule_key(site, members, kind)
    if key is None:
        return Explanation(kind, nbytes, path, "-", None, "-", note="shared memory runs its own schedule")
    if site.node is None and site.fuse_below and nbytes <= site.fuse_below:
        note = "numpy arrays this small complete at the rendezvous (CuPy arrays take the schedule)"
        return Explanation(kind, nbytes, "fused", "-", None, "-", key, note=note)
    if site.node is None and site.share_below and nbytes <= site.share_below:
        note = "numpy arrays this small are combined slice by slice by every peer (CuPy: the schedule)"
        return Explanation(kind, nbytes, "shared", "-", None, "-", key, note=note)
    if site.node is not None and contribution_bytes(key, nbytes) <= SMALL_BYTES:
        note = f"contributions of at most {SMALL_BYTES} bytes travel with the calls: one round, no schedule"
        return Explanation(kind, nbytes, "with the calls", "-", None, "-", key, note=note)
    config = site.config
    pinned = config.local_strategy(kind) if site.node is None else config.global_strategy(kind)
    found = site.chooser.explain(path, key, nbytes, elements < key.participants)
    if isinstance(pinned, Auto):
        return found
    note = "pinned by the config or COLLECTIVE_ALGO (a call's strategy= wins over both)"
    return replace(found, choice=str(pinned), seconds=None, source="pinned", note=note)


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
