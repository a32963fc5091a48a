"""The in-process server: coordinates the peers (threads) of one job in this process.

Life cycle: every peer ``join``s (register blocks until all have); each collective starts with
a ``rendezvous`` where every peer posts its CallSpec; the last to arrive checks that all agree
and opens an Exchange (the mailboxes the algorithm runs over), or records the error every
peer will raise. Peers count their collectives, so step k of every peer meets at slot k: a
peer that arrives after the others timed out at slot k gets the same timeout and moves on to
k+1 with them, which is why the job stays usable after a timeout or a mismatch.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass, field

from collective.calls import CallSpec, agree, describe_peers
from collective.config import CollectiveConfig
from collective.errors import (
    CollectiveError,
    CollectiveTimeout,
    JobClosedError,
    PeerLostError,
    RegistrationError,
)
from transport.inproc import Exchange, clone_error

__all__ = ["LocalJob", "Plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """What the rendezvous decided: the agreed call and where its messages go."""

    call: CallSpec
    exchange: Exchange
    label: str


@dataclass
class _Slot:
    arrivals: dict[int, CallSpec] = field(default_factory=dict)
    outcome: Plan | CollectiveError | None = None
    seen: set[int] = field(default_factory=set)


class LocalJob:
    """The peers ``peer_ids`` of one job that live in this process."""

    def __init__(self, config: CollectiveConfig, peer_ids: tuple[int, ...]) -> None:
        self.config = config
        self.peer_ids = peer_ids
        self.index = {peer: i for i, peer in enumerate(peer_ids)}
        self._lock = threading.Lock()
        self._wakeup = {peer: threading.Condition(self._lock) for peer in peer_ids}
        self._registered: set[int] = set()
        self._active = False
        self._left: set[int] = set()
        self._busy: set[int] = set()
        self._closed: JobClosedError | None = None
        self._next_step = dict.fromkeys(peer_ids, 0)
        self._slots: dict[int, _Slot] = {}
        self._exchanges: weakref.WeakSet[Exchange] = weakref.WeakSet()

    # -- registration -------------------------------------------------------------------------

    def join(self, peer: int, deadline: float) -> None:
        """Register ``peer`` and wait until every peer of the job has (raises CollectiveTimeout)."""
        with self._lock:
            if peer in self._left:
                raise RegistrationError(
                    f"peer {peer} already finished this job; it cannot rejoin it. Once peers "
                    f"{sorted(self._registered)} have called finish(), register again to start a new job"
                )
            if peer in self._registered:
                raise RegistrationError(f"peer {peer} is already registered; call finish({peer}) first")
            self._registered.add(peer)
            if len(self._registered) == len(self.peer_ids):
                self._active = True
                self._notify_all()
            while not self._active:
                self._raise_if_closed()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._registered.discard(peer)
                    missing = sorted(set(self.peer_ids) - self._registered - {peer})
                    raise CollectiveTimeout(
                        f"register: peer {peer} waited {self.config.timeout:g}s for "
                        f"{describe_peers(missing)} to register; start every peer of the job",
                        missing,
                    )
                self._wakeup[peer].wait(remaining)

    def leave(self, peer: int) -> bool:
        """Unregister ``peer``; peers waiting for it fail with PeerLostError. True if the job is now empty."""
        with self._lock:
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
            self._notify_all()
            return not self._registered

    def close(self, reason: str) -> None:
        """Fail everything now and later: waiting peers wake with JobClosedError."""
        with self._lock:
            self._closed = JobClosedError(reason)
            for slot in self._slots.values():
                if slot.outcome is None:
                    slot.outcome = self._closed
            self._notify_all()
            exchanges = list(self._exchanges)
        for exchange in exchanges:
            exchange.abort(JobClosedError(reason))

    def check_member(self, peer: int) -> None:
        """Raise RegistrationError (or JobClosedError) unless ``peer`` is registered in this job."""
        with self._lock:
            self._check_member(peer)

    def is_empty(self) -> bool:
        with self._lock:
            return not self._registered

    # -- collectives --------------------------------------------------------------------------

    def rendezvous(self, peer: int, spec: CallSpec, deadline: float) -> Plan:
        """Post this peer's call for its next step and wait for the verdict of all peers.

        Raises the shared verdict: MismatchError, InvalidArgumentError, CollectiveTimeout
        (naming the peers that never arrived), PeerLostError, JobClosedError.
        """
        with self._lock:
            self._check_member(peer)
            if peer in self._busy:
                raise RegistrationError(
                    f"peer {peer} is already inside a collective: each peer must be driven by one thread"
                )
            if self._left:
                gone = sorted(self._left)
                raise PeerLostError(
                    f"{describe_peers(gone)} left the job (finish), so peer {peer}'s {spec.kind} cannot "
                    f"complete; finish the remaining peers",
                    gone,
                )
            step = self._next_step[peer]
            self._next_step[peer] = step + 1
            slot = self._slots.setdefault(step, _Slot())
            slot.arrivals[peer] = spec
            if slot.outcome is None and len(slot.arrivals) == len(self.peer_ids):
                slot.outcome = self._decide(step, slot)
                self._notify_all()
            while slot.outcome is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(self.peer_ids) - set(slot.arrivals))
                    slot.outcome = CollectiveTimeout(
                        f"{spec.kind} #{step}: peers waited {self.config.timeout:g}s for "
                        f"{describe_peers(missing)} to call it",
                        missing,
                    )
                    log.warning("%s", slot.outcome)
                    self._notify_all()
                    break
                self._wakeup[peer].wait(remaining)
            slot.seen.add(peer)
            if len(slot.seen) == len(self.peer_ids):
                del self._slots[step]
            outcome = slot.outcome
            if isinstance(outcome, Plan):
                self._busy.add(peer)
        if isinstance(outcome, CollectiveError):
            raise clone_error(outcome)
        return outcome

    def done(self, peer: int) -> None:
        """The peer finished running a collective that rendezvous() opened."""
        with self._lock:
            self._busy.discard(peer)

    def _decide(self, step: int, slot: _Slot) -> Plan | CollectiveError:
        try:
            call = agree(slot.arrivals, f"#{step}")
        except CollectiveError as exc:
            log.warning("%s", exc)
            return exc
        exchange = Exchange(self.peer_ids, f"{call.kind} #{step}")
        self._exchanges.add(exchange)
        return Plan(call, exchange, exchange.label)

    # -- helpers (lock held) ------------------------------------------------------------------

    def _notify_all(self) -> None:
        for condition in self._wakeup.values():
            condition.notify_all()

    def _raise_if_closed(self) -> None:
        if self._closed is not None:
            raise clone_error(self._closed)

    def _check_member(self, peer: int) -> None:
        self._raise_if_closed()
        if peer in self._left:
            raise RegistrationError(f"peer {peer} has finished; call register() to start a new job")
        if peer not in self._registered:
            raise RegistrationError(f"peer {peer} is not registered: call register() first")
