"""The in-process server: coordinates the peers (threads) of one job in this process.

Life cycle: every peer ``join``s (register blocks until all have); each collective starts with
a ``rendezvous`` where every peer posts its CallSpec; the last to arrive checks that all agree
and opens an Exchange (the mailboxes the algorithm runs over), or records the error every
peer will raise. Peers count their collectives, so step k of every peer meets at slot k: a
peer that arrives after the others timed out at slot k gets the same timeout and moves on to
k+1 with them, which is why the job stays usable after a timeout or a mismatch.

Small and mid-size numpy arrays skip the algorithms (collective.fastpath): the decider either
computes the result at the rendezvous (up to ``fuse_below``) or hands every peer its share of
the arithmetic (up to ``share_below``). In process the peers share memory, so for these sizes
the cost is waking threads, and these paths wake each peer once or twice instead of once per
algorithm step.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from collective.algorithms.ops import Array
from collective.calls import CallSpec, agree, describe_peers
from collective.config import CollectiveConfig
from collective.errors import (
    CollectiveError,
    CollectiveTimeout,
    JobClosedError,
    PeerLostError,
    RegistrationError,
)
from collective.fastpath import DEFAULT_FUSE_BELOW, DEFAULT_SHARE_BELOW, SharedWork, reduce_all, usable
from collective.transport.inproc import Doorbell, Exchange, clone_error, ring_claimed

if TYPE_CHECKING:
    from collective.node import NodeJob

__all__ = ["LocalJob", "Plan"]

log = logging.getLogger(__name__)


class Plan(NamedTuple):
    """What the rendezvous decided: the agreed call and where its messages go.

    ``result`` is set when the rendezvous already computed the collective (small arrays): a
    flat array every peer (the root, for reduce) copies; no algorithm runs then.
    """

    call: CallSpec
    exchange: Exchange | None
    label: str
    result: Array | None = None
    step: int = 0
    shared: SharedWork | None = None  # the shared fast path: every peer does its part of this
    error: CollectiveError | None = None  # set for the one peer that reports a failed step to other nodes


@dataclass
class _Slot:
    step: int
    arrivals: dict[int, CallSpec] = field(default_factory=dict)
    data: dict[int, Array | None] = field(default_factory=dict)
    outcome: Plan | CollectiveError | None = None
    reporter: int | None = None  # multi-node: the peer that tells the other nodes this step failed


class _Guard:
    """``with guard:`` holds the job lock; bells claimed meanwhile are rung after it is released."""

    __slots__ = ("claimed", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.claimed: list[Doorbell] = []

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        claimed, self.claimed = self.claimed, []
        self.lock.release()
        ring_claimed(claimed)


class LocalJob:
    """The ``size`` peers of one job that live in this process (their ids fixed once all joined).

    ``expected``: the peer ids that must join (one-process jobs), to name the missing ones.
    ``report_errors``: multi-node; a failed step is handed to one peer as a Plan with ``error``
    set instead of being raised there, so that peer can tell the other nodes.
    """

    def __init__(
        self,
        config: CollectiveConfig,
        size: int,
        fuse_below: int = DEFAULT_FUSE_BELOW,
        expected: tuple[int, ...] | None = None,
        report_errors: bool = False,
        share_below: int = DEFAULT_SHARE_BELOW,
    ) -> None:
        self.config = config
        self.size = size
        self.expected = expected
        self.peer_ids: tuple[int, ...] = ()
        self.index: dict[int, int] = {}
        self.fuse_below = fuse_below
        self.share_below = 0 if report_errors else share_below
        self.report_errors = report_errors
        self._guard = _Guard()
        self._lock = self._guard.lock
        self._bells: dict[int, Doorbell] = {}
        self._registered: set[int] = set()
        self._active = False
        self._left: set[int] = set()
        self._busy: dict[int, threading.Lock] = {}  # held while the peer is in a collective
        self._closed: JobClosedError | None = None
        self._registration_failed: CollectiveTimeout | None = None
        self._next_step: dict[int, int] = {}
        self._slots: dict[int, _Slot] = {}
        self._exchanges: weakref.WeakSet[Exchange] = weakref.WeakSet()
        self.node: NodeJob | None = None  # multi-node: this process's membership of the global job

    @property
    def active(self) -> bool:
        """Every local peer has joined."""
        return self._active

    @property
    def world(self) -> int:
        """Peers in the whole job (every node's)."""
        return self.node.world if self.node is not None else len(self.peer_ids)

    def is_peer(self, peer: object) -> bool:
        """Whether ``peer`` is a peer id of the whole job (on any node)."""
        if isinstance(peer, bool) or not isinstance(peer, int):
            return False
        return peer in self.index or (self.node is not None and self.node.is_peer(peer))

    # -- registration -------------------------------------------------------------------------

    def join(self, peer: int, deadline: float) -> None:
        """Register ``peer`` and wait until every peer of the job has (raises CollectiveTimeout)."""
        with self._guard:
            if peer in self._left:
                raise RegistrationError(
                    f"peer {peer} already finished this job; it cannot rejoin it. Once peers "
                    f"{sorted(self._registered)} have called finish(), register again to start a new job"
                )
            if peer in self._registered:
                raise RegistrationError(f"peer {peer} is already registered; call finish({peer}) first")
            if len(self._registered) >= self.size:
                raise RegistrationError(
                    f"this process's job already has its num_devices={self.size} peers "
                    f"({describe_peers(sorted(self._registered))}); "
                    f"peer {peer} belongs to another process or job"
                )
            self._registered.add(peer)
            self._bells[peer] = Doorbell()
            self._busy[peer] = threading.Lock()
            self._next_step[peer] = 0
            if len(self._registered) == self.size:
                self.peer_ids = tuple(sorted(self._registered))
                self.index = {p: i for i, p in enumerate(self.peer_ids)}
                self._active = True
                self._ring_all()
        while True:
            with self._guard:
                if self._active:
                    return
                self._raise_if_closed()
                if self._registration_failed is None and time.monotonic() >= deadline:
                    missing = sorted(set(self.expected) - self._registered) if self.expected else []
                    who = (
                        describe_peers(missing)
                        if missing
                        else f"{self.size - len(self._registered)} more peer(s)"
                    )
                    self._registration_failed = CollectiveTimeout(
                        f"register: peers waited {self.config.timeout:g}s for {who} to register; "
                        f"start every peer of the job",
                        missing,
                    )
                    self._ring_all()
                if self._registration_failed is not None:
                    raise clone_error(self._registration_failed)
                self._bells[peer].arm()
            self._bells[peer].wait(deadline - time.monotonic(), self._lock)

    def leave(self, peer: int) -> bool:
        """Unregister ``peer``; peers waiting for it fail with PeerLostError. True if the job is now empty."""
        with self._guard:
            self._check_member(peer)
            self._registered.discard(peer)
            self._left.add(peer)
            for step, slot in self._slots.items():
                if slot.outcome is None:
                    waiting = describe_peers(sorted(slot.arrivals))
                    slot.outcome = PeerLostError(
                        f"collective #{step}: peer {peer} called finish() while {waiting} waited for it",
                        [peer],
                    )
                    slot.reporter = min(slot.arrivals)
            self._ring_all()
            return not self._registered

    def close(self, reason: str) -> None:
        """Fail everything now and later: waiting peers wake with JobClosedError."""
        with self._guard:
            self._closed = JobClosedError(reason)
            for slot in self._slots.values():
                if slot.outcome is None:
                    slot.outcome = self._closed
            self._ring_all()
            exchanges = list(self._exchanges)
        for exchange in exchanges:
            exchange.abort(JobClosedError(reason))
        if self.node is not None:
            self.node.close()

    def check_member(self, peer: int) -> None:
        """Raise RegistrationError (or JobClosedError) unless ``peer`` is registered in this job."""
        with self._guard:
            self._check_member(peer)

    # -- collectives --------------------------------------------------------------------------

    def rendezvous(self, peer: int, spec: CallSpec, data: Array | None, deadline: float) -> Plan:
        """Post this peer's call (and its flat input ``data``) for its next step; wait for the verdict.

        Raises the shared verdict: MismatchError, InvalidArgumentError, CollectiveTimeout
        (naming the peers that never arrived), PeerLostError, JobClosedError.
        """
        busy = self._busy.get(peer)
        if busy is None:
            raise RegistrationError(
                f"peer {peer} is not a peer of this job ({describe_peers(list(self.peer_ids))})"
            )
        if not busy.acquire(blocking=False):
            raise RegistrationError(
                f"peer {peer} is already inside a collective: each peer must be driven by one thread"
            )
        try:
            slot = self._arrive(peer, spec, data)
            outcome = slot.outcome
            while outcome is None:
                with self._guard:
                    outcome = slot.outcome
                    remaining = deadline - time.monotonic()
                    if outcome is None and remaining <= 0:
                        outcome = self._time_out(slot, spec)
                    elif outcome is None:
                        self._bells[peer].arm()
                if outcome is None:
                    self._bells[peer].wait(remaining, self._lock)
                    outcome = slot.outcome  # set before the ring: no need to take the lock again
            if isinstance(outcome, CollectiveError):
                if self.report_errors and slot.reporter == peer:
                    return Plan(
                        spec, None, f"{spec.kind} #{slot.step}", step=slot.step, error=clone_error(outcome)
                    )
                raise clone_error(outcome)
        except BaseException:
            busy.release()
            raise
        return outcome

    def _arrive(self, peer: int, spec: CallSpec, data: Array | None) -> _Slot:
        """Post the call at this peer's next step; the last peer to arrive decides the outcome."""
        with self._guard:
            self._check_member(peer)
            if self._left:
                gone = sorted(self._left)
                raise PeerLostError(
                    f"{describe_peers(gone)} left the job (finish), so peer {peer}'s {spec.kind} cannot "
                    f"complete; finish the remaining peers",
                    gone,
                )
            step = self._next_step[peer]
            self._next_step[peer] = step + 1
            slot = self._slots.get(step)
            if slot is None:
                slot = self._slots[step] = _Slot(step)
            slot.arrivals[peer] = spec
            slot.data[peer] = data
            if len(slot.arrivals) == len(self.peer_ids):
                del self._slots[step]  # nobody else will look for it
                if slot.outcome is None:
                    slot.outcome = self._decide(step, slot)
                    slot.reporter = min(slot.arrivals)
                    self._ring_all()
            return slot

    def _time_out(self, slot: _Slot, spec: CallSpec) -> CollectiveTimeout:
        """Fail ``slot`` for the peers that came; late peers find the same error there (lock held)."""
        missing = sorted(set(self.peer_ids) - set(slot.arrivals))
        error = CollectiveTimeout(
            f"{spec.kind} #{slot.step}: peers waited {self.config.timeout:g}s for "
            f"{describe_peers(missing)} to call it",
            missing,
        )
        slot.outcome = error
        slot.reporter = min(slot.arrivals)
        log.warning("%s", error)
        self._ring_all()
        return error

    def done(self, peer: int) -> None:
        """The peer finished running a collective that rendezvous() opened."""
        self._busy[peer].release()

    def _decide(self, step: int, slot: _Slot) -> Plan | CollectiveError:
        try:
            call = agree(slot.arrivals, f"#{step}", source_elsewhere=self.report_errors)
        except CollectiveError as exc:
            log.warning("%s", exc)
            return exc
        label = f"{call.kind} #{step}"
        inputs = [slot.data[peer] for peer in self.peer_ids]
        if self.fuse_below and usable(slot.data, self.fuse_below):
            if call.kind == "broadcast":
                result = slot.data[call.root].copy()  # type: ignore[index, union-attr]  # root may reuse x at once
            else:
                assert call.op is not None
                result = reduce_all(call.op, inputs)
            return Plan(call, None, label, result, step)
        if self.report_errors and len(self.peer_ids) == 1:
            return Plan(call, None, label, step=step)  # a node with one peer has no local phases
        exchange = Exchange(self.peer_ids, label)
        self._exchanges.add(exchange)
        if self.share_below and usable(slot.data, self.share_below):
            return Plan(call, exchange, label, step=step, shared=SharedWork.plan(call, inputs))
        return Plan(call, exchange, label, step=step)

    # -- helpers (lock held) ------------------------------------------------------------------

    def _ring_all(self) -> None:
        """Wake every waiting peer once the lock is released."""
        self._guard.claimed.extend(bell for bell in self._bells.values() if bell.claim())

    def _raise_if_closed(self) -> None:
        if self._closed is not None:
            raise clone_error(self._closed)

    def _check_member(self, peer: int) -> None:
        self._raise_if_closed()
        if peer in self._left:
            raise RegistrationError(f"peer {peer} has finished; call register() to start a new job")
        if peer not in self._registered:
            raise RegistrationError(f"peer {peer} is not registered: call register() first")
