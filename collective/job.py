"""LocalJob: the peers of one job that live in this process, their registration and their groups.

Registration waits until every local peer has joined (or the timeout names the missing ones).
Each group the local peers call on has its own Rendezvous, made on first use: groups need no
creation call across peers. One lock (``guard``) protects membership and every rendezvous of the
job; threads are woken with doorbells rung after the lock is released (transport.inproc).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from collective.calls.signature import describe_peers
from collective.config import CollectiveConfig
from collective.errors import CollectiveTimeout, JobClosedError, PeerLostError, RegistrationError
from collective.executors import schedule_key
from collective.executors.rendezvous import Rendezvous
from collective.executors.step import Site
from collective.transport.inproc import Doorbell, Exchange, claim_armed, clone_error, ring_claimed
from collective.tuning.model import Key
from collective.tuning.probe import Intent, Probing, decide, measure

if TYPE_CHECKING:
    from collective.node import NodeJob

__all__ = ["LocalJob", "ProbeCalls"]

_SERIALS = itertools.count(1)


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
    """The ``size`` peers of one job in this process (their ids fixed once all joined).

    ``expected``: the peer ids that must join (one-process jobs), to name the missing ones.
    ``fuse_below`` / ``share_below``: the in-process fast paths (collective.executors).
    """

    def __init__(
        self,
        config: CollectiveConfig,
        size: int,
        fuse_below: int = 0,
        share_below: int = 0,
        expected: tuple[int, ...] | None = None,
        node: NodeJob | None = None,
    ) -> None:
        self.config = config
        self.serial = next(_SERIALS)  # this process's jobs, told apart (the flight recorder's ring)
        self.size = size
        self.expected = expected
        self.peer_ids: tuple[int, ...] = ()
        self.node = node  # multi-node: this process's membership of the global job
        self.exchanges: weakref.WeakSet[Exchange] = weakref.WeakSet()  # live ones, aborted by close()
        self.site = Site(config, fuse_below, share_below, node, self.exchanges)
        self.intent = Intent(None, None, "auto")  # what this process brings to the choice of figures
        self.guard = self._guard = _Guard()  # ``with guard:`` holds ``lock``, rings claimed bells after
        self.lock = self._guard.lock
        self._bells: dict[int, Doorbell] = {}
        self._registered: set[int] = set()
        self._active = False
        self.left: set[int] = set()
        self._closed: JobClosedError | None = None
        self._registration_failed: CollectiveTimeout | None = None
        self._groups: dict[tuple[int, ...], Rendezvous] = {}
        self._everyone: tuple[int, ...] = ()  # multi-node: every peer id, 0..world-1

    @property
    def active(self) -> bool:
        """Every local peer has joined."""
        return self._active

    @property
    def world(self) -> int:
        """Peers in the whole job (every node's; 0 while the nodes have not all joined)."""
        return self.node.world if self.node is not None else self.size

    @property
    def members(self) -> tuple[int, ...]:
        """Every peer id of the job, sorted."""
        if self.node is None:
            return self.peer_ids
        world = self.node.world
        if len(self._everyone) != world:  # the world is known once the nodes joined
            self._everyone = tuple(range(world))
        return self._everyone

    def claim(self, bells: list[Doorbell]) -> None:
        """Ring ``bells`` once the lock is released (lock held)."""
        self._guard.claimed.extend(bells)

    def ring_all(self) -> None:
        """Wake every peer waiting to register, once the lock is released (lock held)."""
        self.claim(claim_armed(self._bells.values()))

    def adopt_figures(self, calls: Probing) -> None:
        """Give the job the figures ``auto`` chooses from, the same on every peer (tuning.probe):
        its profile's, a probe's (every local peer runs it here, with ``calls``, as the job starts)
        or the built-in ones."""
        site = self.site
        key = schedule_key(site, self.members, "all_reduce")[1]
        if key is None:  # shared memory: no schedule to choose
            return
        wanted = self.intent
        if self.node is None:  # (threads: no probe; they would measure the fast paths)
            infos = [{**wanted.info(), "probe": "never"}]
        else:
            assert self.node.topology is not None
            infos = self.node.topology.infos
        decision = site.once("tuning", decide, infos, key, wanted)
        if decision == "profile":
            site.chooser.adopt(wanted.figures)
        elif decision == "probe":
            site.chooser.adopt(measure(calls, partial(_world_key, site, self.members)))

    # -- registration -------------------------------------------------------------------------

    def reserve(self, peer: int) -> None:
        """Claim ``peer``'s place in this job, or raise RegistrationError and change nothing."""
        with self._guard:
            self._raise_if_closed()
            if peer in self.left:
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
            if len(self._registered) == self.size:
                self.peer_ids = tuple(sorted(self._registered))
                self._active = True
                self.ring_all()

    def wait_joined(self, peer: int, deadline: float) -> None:
        """Wait until every local peer of the job has registered (raises CollectiveTimeout)."""
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
                    self.ring_all()
                if self._registration_failed is not None:
                    raise clone_error(self._registration_failed)
                self._bells[peer].arm()
            self._bells[peer].wait(deadline - time.monotonic(), self.lock)

    def leave(self, peer: int) -> bool:
        """Unregister ``peer``; peers waiting for it fail with PeerLostError. True if the job is now empty."""
        with self._guard:
            self.check_member(peer)
            self._registered.discard(peer)
            self.left.add(peer)
            for rendezvous in self._groups.values():
                if peer in rendezvous.local:
                    rendezvous.fail_open(
                        PeerLostError(f"peer {peer} called finish() while others waited for it", [peer])
                    )
            self.ring_all()
            return not self._registered

    def close(self, reason: str) -> None:
        """Fail everything now and later: waiting peers wake with JobClosedError."""
        with self._guard:
            self._closed = JobClosedError(reason)
            for rendezvous in self._groups.values():
                rendezvous.fail_open(self._closed)
            self.ring_all()
            exchanges = list(self.exchanges)
        for exchange in exchanges:
            exchange.abort(JobClosedError(reason))
        if self.node is not None:
            self.node.close()

    def check_member(self, peer: int) -> None:
        """Raise RegistrationError (or JobClosedError) unless ``peer`` is registered (lock held)."""
        if self._closed is not None:
            raise clone_error(self._closed)
        if peer in self.left:
            raise RegistrationError(f"peer {peer} has finished; call register() to start a new job")
        if peer not in self._registered:
            raise RegistrationError(f"peer {peer} is not registered: call register() first")

    def gone_among(self, peers: tuple[int, ...]) -> list[int]:
        """The peers of ``peers`` that left the job (lock held)."""
        return sorted(self.left.intersection(peers)) if self.left else []

    # -- groups -------------------------------------------------------------------------------

    def rendezvous(self, members: tuple[int, ...]) -> Rendezvous:
        """The rendezvous of the group ``members`` (sorted peer ids) among this process's peers."""
        found = self._groups.get(members)
        if found is not None:
            return found
        with self._guard:
            found = self._groups.get(members)
            if found is None:
                local = tuple(peer for peer in members if peer in self._bells)
                found = self._groups[members] = Rendezvous(self, members, local)
            return found

    def waiting(self, members: tuple[int, ...]) -> tuple[int, ...]:
        """The local peers whose call on the group ``members`` waits in its rendezvous for the others'."""
        rendezvous = self._groups.get(members)
        if rendezvous is None:
            return ()
        with self._guard:
            return rendezvous.waiting()

    # -- helpers (lock held) ------------------------------------------------------------------

    def _raise_if_closed(self) -> None:
        if self._closed is not None:
            raise clone_error(self._closed)


class ProbeCalls:
    """The probe's collectives as one peer of the whole job (tuning.probe.Probing)."""

    def __init__(self, runtime: Any, peer: int, world: int) -> None:  # (a Runtime)
        self.runtime, self.peer, self.world = runtime, peer, world
        self._arrays: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}

    def run(self, kind: str, nbytes: int, strategy: str) -> None:
        x, out = self._buffers(kind, nbytes)
        runtime, peer = self.runtime, self.peer
        if kind == "broadcast":
            runtime.broadcast(
                peer, x if peer == 0 else None, strategy=strategy, out=None if peer == 0 else out
            )
        else:
            getattr(runtime, kind)(peer, x, strategy=strategy, out=out)

    def _buffers(self, kind: str, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        found = self._arrays.get((kind, nbytes))
        if found is None:
            count = max(nbytes // 4, self.world)
            count -= count % self.world
            x = np.ones(count, np.float32)
            shapes = {"all_gather": (self.world, count), "reduce_scatter": (count // self.world,)}
            found = self._arrays[(kind, nbytes)] = (x, np.empty(shapes.get(kind, (count,)), np.float32))
        return found

    def agree_max(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(self.runtime.all_reduce(self.peer, values, "max"))


def _world_key(site: Site, members: tuple[int, ...], kind: str) -> Key:
    """Where the whole job's schedule of ``kind`` runs (a probe runs only where there is one)."""
    key = schedule_key(site, members, kind)[1]
    assert key is not None
    return key
