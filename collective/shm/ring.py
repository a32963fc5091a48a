"""This process's side of the shared-memory ring of a job (for collective.shm.group).

``HostRing`` owns this process's ring segment, maps the segments of the job's other processes on
this host when a group first needs them, and lends the segment's channels to groups: a group
keeps its channel while it is used; when every channel is taken, the group used least recently
of those not inside a step whose members all left its last step gives its channel up.
``SignatureCodec`` is how a call travels in a slot: msgpack of collective.calls.fields',
decoded with bounds (transport.wire.decode_map), both cached (a group calls the same few
collectives over and over).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import msgpack

from collective.calls.fields import as_sent, digested, signature_fields, signature_from_fields
from collective.calls.signature import Signature
from collective.errors import (
    CollectiveError,
    CollectiveTimeout,
    JobClosedError,
    PeerLostError,
    describe_peers,
)
from collective.shm.chunks import ABORT, END, at
from collective.transport.shm_ring import CHANNELS, MESSAGE_BYTES, RingSegment
from collective.transport.wire import decode_map

__all__ = ["HostRing", "Moved", "SignatureCodec"]

log = logging.getLogger(__name__)


class User(Protocol):
    """A group that borrows a channel (collective.shm.group.ShmGroup)."""

    members: tuple[int, ...]
    key: int
    index: int | None
    busy: bool
    ended: tuple[int, str | None]  # the last step this process went through, and why it gave it up

    def releasable(self) -> bool: ...

    def release(self) -> None: ...


class HostRing:
    """This process's ring for a job: its segment, the others' (mapped on first use), its channels."""

    def __init__(
        self,
        segment: RingSegment,
        rings: dict[int, str],
        node_of: dict[int, int],
        lost_peer: Callable[[int], CollectiveError | None],
        processes: int = 1,
    ) -> None:
        self.segment = segment
        self.processes = processes  # the job's processes on this host (more than CPUs: spin less)
        self._rings = rings  # node -> its segment's name
        self._segments: dict[int, RingSegment] = {}
        self.node_of = node_of
        self.lost_peer = lost_peer
        self.closed: JobClosedError | None = None
        self._lock = threading.Lock()
        self._users: list[User | None] = [None] * CHANNELS
        self._used = [0.0] * CHANNELS

    def segment_of(self, node: int) -> RingSegment:
        """Node ``node``'s segment, validated and mapped (OSError, ValueError if it cannot be)."""
        found = self._segments.get(node)
        if found is None:
            name = self._rings[node]
            pid = int(name.split("-")[1])
            found = self._segments[node] = RingSegment.attach(name, pid)
        return found

    def segments_of(self, members: tuple[int, ...], me: int, label: str) -> list[RingSegment]:
        """Every member's segment, by rank (mapped; PeerLostError naming every member whose is gone:
        the first to leave is named, whoever else left since)."""
        segments, gone, reason = [], [], None
        for peer in members:
            try:
                segments.append(self.segment_of(self.node_of[peer]) if peer != me else self.segment)
            except (OSError, ValueError) as exc:  # (its process removes it when it leaves or ends)
                gone.append(peer)
                reason = exc
        if len(gone) == 1 and (known := self.lost_peer(gone[0])) is not None:
            raise known from reason
        if gone:
            whose = "its process" if len(gone) == 1 else "their processes"
            why = f"{label}: {describe_peers(gone)} left the job or {whose} ended ({reason})"
            raise PeerLostError(why, gone)
        return segments

    def channel(self, group: User, step: int, deadline: float, label: str) -> int:
        """This process's channel for ``group``: its own, a free one, or one given up by an idle
        group (the least recently used of those whose members all left its last step). While there
        is none (each holder is inside a step, or waits for a member still in its last one) this
        waits, until ``deadline``."""
        while True:
            with self._lock:
                index = self._take(group)
            if index is not None:
                return index
            if self.closed is not None:
                raise self.closed
            if time.monotonic() >= deadline:
                holders = ", ".join(describe_peers(list(user.members)) for user in self._users if user)
                raise CollectiveTimeout(
                    f"{label}: no shared-memory channel of this process came free for group "
                    f"{describe_peers(list(group.members))} in time: its {CHANNELS} channels are held by "
                    f"groups inside a collective or waiting for a member to leave their last step "
                    f"({holders})",
                    [],
                )
            time.sleep(0.0005)

    def hold(self, group: User) -> bool:
        """Mark ``group`` busy in the channel it holds (``channel``'s common case, without a step's
        label or deadline: a persistent use's lane); False when it holds none now (then ``channel``)."""
        with self._lock:
            if self._holding(group) is None:
                return False
            group.busy = True  # (under the lock: no other thread's group takes the channel now)
            return True

    def _holding(self, group: User) -> int | None:
        """The channel ``group`` holds, marked used now (None: it holds none) (lock held)."""
        index = group.index
        if index is None or self._users[index] is not group:
            return None
        self._used[index] = time.monotonic()
        return index

    def _take(self, group: User) -> int | None:
        index = self._holding(group)
        if index is not None:
            return index
        free = [i for i in range(CHANNELS) if self._users[i] is None]
        if not free:
            idle = [i for i, user in enumerate(self._users) if user and not user.busy and user.releasable()]
            if not idle:
                return None
            victim = min(idle, key=self._used.__getitem__)
            user = self._users[victim]
            assert user is not None
            user.release()
            free = [victim]
        index = free[0]
        self._users[index] = group
        self._used[index] = time.monotonic()
        last, reason = group.ended  # how this process left the group's step before: truly told
        progress = at(last, END if reason is None else ABORT)
        self.segment.assign(group.key, index, progress, None if reason is None else (last, reason))
        group.index = index
        log.debug("group %s uses channel %d of %s", group.members, index, self.segment.name)
        return index

    def close(self) -> None:
        """The job is over: waits raise JobClosedError, the others see this process left."""
        self.closed = JobClosedError("the job was closed")
        self.segment.close()


class Moved(Exception):
    """A member's process evicted a group's channel (its channels were all taken) for another
    group: the other members, which cached it, look it up again (the group gets another one)."""


class SignatureCodec:
    """Signatures to the bytes of a slot's message and back (bounded, cached).

    Each message also has a 63-bit digest (blake2b): members compare digests, and decode the
    others' messages only when they differ (or when the call has a problem or a source to find).
    """

    def __init__(self) -> None:
        self._encoded: dict[Signature, tuple[bytes, int]] = {}
        self._decoded: dict[bytes, Signature] = {}

    def encode(self, signature: Signature) -> tuple[bytes, int]:
        found = self._encoded.get(signature)
        if found is None:
            message = msgpack.packb(signature_fields(as_sent(signature)), use_bin_type=True)
            if len(message) > MESSAGE_BYTES:  # (shapes of absurdly many dimensions)
                message = msgpack.packb(signature_fields(digested(signature)), use_bin_type=True)
            digest = hashlib.blake2b(message, digest_size=8).digest()
            found = (message, int.from_bytes(digest, "little") >> 1)
            if len(self._encoded) > 64:
                self._encoded.clear()
            self._encoded[signature] = found
        return found

    def decode(self, message: bytes) -> Signature:
        """The Signature of ``message``; WireError if it is not one."""
        found = self._decoded.get(message)
        if found is None:
            fields = decode_map(message, MESSAGE_BYTES, "call", strings=MESSAGE_BYTES, entries=32)
            found = signature_from_fields(fields)
            if len(self._decoded) > 64:
                self._decoded.clear()
            self._decoded[message] = found
        return found
