"""Point-to-point messages: eager ``send``, ``recv`` matched by (source, tag) in order.

``send`` copies the array into the destination's mailbox and returns (it never waits for the
matching ``recv``), so two peers may send to each other and then receive. Messages of one
(src, dst, tag) arrive in the order sent; different tags do not block each other. A ``recv``
waits until its deadline: CollectiveTimeout naming the source, or PeerLostError when the source
left (or its node was lost) with nothing sent.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from collective.algorithms.ops import Array
from collective.arrays import Device, check_array, integer, overlaps_itself
from collective.errors import (
    CollectiveError,
    CollectiveTimeout,
    InvalidArgumentError,
    MismatchError,
    PeerLostError,
)
from collective.node.protocol import PART_BYTES, P2PMessage
from collective.persistent.p2p import PersistentRecv, PersistentSend, described, traced
from collective.tensors import native, writable
from collective.transport.wire import WireError

__all__ = [
    "Mailbox",
    "PersistentPoints",
    "PeerMessages",
    "PersistentRecv",
    "PersistentSend",
    "deliver",
    "described",
    "receive",
    "recv",
    "recv_checked",
    "send",
    "send_checked",
    "sent_array",
    "out_target",
    "traced",
]

if TYPE_CHECKING:
    from collective.job import LocalJob

Key = tuple[int, int, int]  # (src, dst, tag)
DEFAULT_LIMIT = 1 << 30  # unreceived bytes kept per source process
MESSAGE_COST = 1 << 10  # bytes a message counts beyond its data (what keeping it costs, about)
MAX_DROPPED_KEYS = 1024  # (dst, tag) pairs of dropped messages remembered for any-source receives
PUMP_SLICE = 0.005  # a receive waiting for another process lets its messages in this often


class Mailbox:
    """The messages waiting for this process's peers."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._cv = threading.Condition()
        self._boxes: dict[Key, deque[tuple[Array, bool, int]]] = {}  # (array, from another process, order)
        self._order = itertools.count()  # of arrival: a receive from any source takes the earliest
        self._closed: CollectiveError | None = None
        self._limit = limit
        self._pending: dict[int, int] = {}  # src -> bytes counted from another process, not yet received
        self._cut_off: dict[int, str] = {}  # src -> why its messages are dropped (it passed the limit)
        self._dropped: dict[tuple[int, int], int] = {}  # (dst, tag) of a dropped message -> its src
        self._assembling: dict[tuple[int, int], tuple[np.ndarray, int]] = {}  # (node, id): (bytes, next part)
        # the receives started and not yet matched, by key, in the order started (``post``)
        self._posted: dict[Key, list[weakref.ref[Any]]] = {}

    def put(self, src: int, dst: int, tag: int, data: Array, remote: bool = False) -> None:
        """Keep ``data`` for ``dst``. From another process (``remote``), at most ``limit`` unreceived
        bytes per source are kept (see ``_reserve``)."""
        with self._cv:
            if not remote or self._reserve(src, dst, tag, data.nbytes):
                self._keep(src, dst, tag, data, remote)

    def arrived(self, origin: int, message: P2PMessage, chunk: Any) -> None:
        """A message from another process (``origin``: its node), or part ``message.part`` of one that
        comes in ``message.parts`` parts of PART_BYTES (in order: one connection carries them); a
        message in parts is kept once its last part is in. WireError: the bytes do not fit it."""
        dtype = np.dtype(message.dtype)
        nbytes = math.prod(message.shape) * dtype.itemsize
        if message.parts == 1:  # kept as it came, without a copy
            if len(chunk) != nbytes:
                raise WireError(f"{nbytes} bytes declared, {len(chunk)} sent")
            data = np.frombuffer(chunk, dtype) if nbytes else np.empty(0, dtype)
            self.put(message.sender, message.receiver, message.tag, data.reshape(message.shape), remote=True)
            return
        start = message.part * PART_BYTES
        key = (origin, message.ident)
        with self._cv:
            if message.part == 0:
                self._assembling.pop(key, None)
                if not self._reserve(message.sender, message.receiver, message.tag, nbytes):
                    return  # (its later parts find no assembly and are dropped too)
                self._assembling[key] = (np.empty(nbytes, np.uint8), 0)
            found = self._assembling.get(key)
            if found is None:
                return
            buffer, expected = found
            if message.part != expected or len(chunk) != min(PART_BYTES, nbytes - start) or start >= nbytes:
                del self._assembling[key]
                self._pending[message.sender] -= nbytes + MESSAGE_COST
                raise WireError(f"part {message.part} of {message.parts} ({len(chunk)} bytes) does not fit")
            buffer[start : start + len(chunk)] = np.frombuffer(chunk, np.uint8)
            if message.part + 1 < message.parts:
                self._assembling[key] = (buffer, expected + 1)
                return
            del self._assembling[key]
            self._keep(
                message.sender, message.receiver, message.tag, buffer.view(dtype).reshape(message.shape), True
            )

    def abandon(self, origin: int, message: P2PMessage) -> None:
        """The message ``message.ident`` of node ``origin`` will never be whole (its sender failed
        while sending its parts): what came of it is dropped, and no longer counted."""
        with self._cv:
            found = self._assembling.pop((origin, message.ident), None)
            if found is not None:
                self._pending[message.sender] -= found[0].nbytes + MESSAGE_COST

    def _keep(self, src: int, dst: int, tag: int, data: Array, remote: bool) -> None:
        """Queue ``data`` (its bytes already counted if ``remote``) and wake receivers (lock held)."""
        self._boxes.setdefault((src, dst, tag), deque()).append((data, remote, next(self._order)))
        self._cv.notify_all()

    def _reserve(self, src: int, dst: int, tag: int, nbytes: int) -> bool:
        """Count a message of ``nbytes`` from another process's ``src`` (lock held). A message alone
        is kept, whatever its size. One that would pass the limit while others of ``src`` wait is
        dropped (False), and ``src`` is cut off: its later messages are dropped too, so none is ever
        taken in place of a dropped one, and every receive from it fails once the messages it sent
        before are taken (at no cost per dropped message)."""
        before = self._pending.get(src, 0)
        if src not in self._cut_off and not (before and before + nbytes + MESSAGE_COST > self._limit):
            self._pending[src] = before + nbytes + MESSAGE_COST
            return True
        if len(self._dropped) < MAX_DROPPED_KEYS:  # (for receives from any source)
            self._dropped.setdefault((dst, tag), src)
        self._cut_off.setdefault(
            src,
            f"recv: peer {src} sent more than this process kept for it ({self._limit >> 20} MiB not yet "
            f"received; a message of {nbytes} bytes to peer {dst}, tag {tag}, was the first dropped): "
            f"its later messages are dropped too; receive sooner or send less ahead",
        )
        self._cv.notify_all()
        return False

    def post(self, src: int, dst: int, tag: int, receive: Any) -> None:
        """``receive`` (held weakly: one let go gives its turn up) started: it takes its message in
        the order started among the receives from ``src`` to ``dst`` with ``tag`` (MPI's order):
        the n-th of those not yet matched takes the n-th message, whichever is waited for first,
        and a receive made after it takes the next one. ``take(..., posted=receive)`` takes it."""
        with self._cv:
            self._posted.setdefault((src, dst, tag), []).append(weakref.ref(receive))

    def unpost(self, src: int, dst: int, tag: int, receive: Any) -> None:
        """``receive`` gives its turn up (its use ended without a message)."""
        with self._cv:
            self._ahead((src, dst, tag), receive, True)

    def _ahead(self, key: Key, receive: Any = None, remove: bool = False) -> int:
        """How many receives started before ``receive`` (None: all of them) still wait for a message
        of ``key`` (lock held); ``remove``: ``receive`` leaves the line."""
        posted = self._posted.get(key)
        if not posted:
            return 0
        if receive is not None and posted[0]() is receive:  # (first in line: the common case)
            if remove:
                del posted[0]
                if not posted:
                    del self._posted[key]
            return 0
        live = [ref for ref in posted if ref() is not None]  # (a receive let go: its turn is given up)
        found = next((i for i, ref in enumerate(live) if ref() is receive), len(live))
        if remove and found < len(live):
            del live[found]
        if live:
            self._posted[key] = live
        else:
            del self._posted[key]
        return found

    def take(
        self,
        src: int | None,
        dst: int,
        tag: int,
        deadline: float,
        timeout: float,
        gone: Callable[[int | None], CollectiveError | None],
        pump: Callable[[float], None] | None = None,
        refuse: Callable[[Array], str | None] | None = None,
        posted: Any = None,
    ) -> tuple[int, Array]:
        """(the source, the next message from ``src`` to ``dst`` with ``tag``); raises at the deadline
        or on loss (``gone(src)``). With ``src`` None, from any source: the earliest to arrive.
        The messages of receives started before (``post``) are theirs: this takes the one after;
        ``posted``: the receive started, which takes its own in its turn (and leaves the line).

        ``pump(seconds)`` lets messages from other processes arrive while this waits. A message
        that ``refuse`` finds a problem with stays where it is (InvalidArgumentError).
        """
        looked_last = False  # (a source is gone: what it sent before may still be on its way in)
        while True:
            with self._cv:
                if src is None:
                    key, index = self._earliest(dst, tag)
                else:
                    key = (src, dst, tag)
                    index = self._ahead(key, posted) if self._posted else 0
                box = self._boxes.get(key) if key is not None else None
                if key is not None and box is not None and len(box) > index:
                    problem = refuse(box[index][0]) if refuse is not None else None
                    if problem is not None:
                        raise InvalidArgumentError(problem)
                    data, remote, _ = box[index]
                    del box[index]
                    if not box:
                        del self._boxes[key]
                    if posted is not None:
                        self._ahead(key, posted, True)
                    if remote:
                        self._pending[key[0]] -= data.nbytes + MESSAGE_COST
                    return key[0], data
                if self._closed is not None:
                    raise self._closed
                if src in self._cut_off:
                    raise MismatchError(self._cut_off[src])
                dropped = self._dropped.get((dst, tag)) if src is None else None  # (one for it was)
                if dropped is not None:
                    raise MismatchError(self._cut_off[dropped])
                lost = gone(src)
                if lost is not None and (pump is None or looked_last):
                    raise lost
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    sender = f"peer {src}" if src is not None else "any peer"
                    raise CollectiveTimeout(
                        f"recv: peer {dst} waited {timeout:g}s for a message from {sender} with tag {tag}; "
                        f"check that {sender} calls send(..., dst={dst}, tag={tag})",
                        [src] if src is not None else [],
                    )
                if pump is None:
                    self._cv.wait(min(remaining, 0.05))
            if pump is not None:
                looked_last = lost is not None
                pump(0 if looked_last else min(remaining, PUMP_SLICE))

    def _earliest(self, dst: int, tag: int) -> tuple[Key | None, int]:
        """The key of the earliest message for ``dst`` with ``tag`` from any source that no receive
        started before waits for, and its place in its box (lock held)."""
        found = []
        for key, box in self._boxes.items():
            if key[1:] == (dst, tag):
                index = self._ahead(key) if self._posted else 0
                if len(box) > index:
                    found.append((box[index][2], key, index))
        if not found:
            return None, 0
        _, key, index = min(found)
        return key, index

    def wake(self) -> None:
        """Let waiting receivers look again (a peer left, a node was lost)."""
        with self._cv:
            self._cv.notify_all()

    def close(self, error: CollectiveError) -> None:
        with self._cv:
            self._closed = error
            self._cv.notify_all()


def left_error(src: int, dst: int) -> PeerLostError:
    return PeerLostError(f"recv: peer {src} left the job (finish), nothing more sent to peer {dst}", [src])


HOST = Device("cpu")


def send(job: LocalJob, mailbox: Mailbox, peer: int, device: Device, x: Any, dst: int, tag: int) -> None:
    """Peer ``peer``'s send: checked, copied, and into ``dst``'s mailbox (here or in its process).
    PeerLostError when ``dst`` is known to be gone: nothing would ever receive it."""
    dst, tag, array = send_checked(job, peer, device, x, dst, tag)
    deliver(job, mailbox, peer, array, dst, tag)


def send_checked(
    job: LocalJob, peer: int, device: Device, x: Any, dst: Any, tag: Any
) -> tuple[int, int, Array]:
    """A send's own checks: (the destination, the tag, ``x`` as the numpy or CuPy array sent);
    InvalidArgumentError naming what is wrong."""
    dst, tag = _check(job, peer, dst, tag, "dst")
    return dst, tag, sent_array(peer, device, x)


def sent_array(peer: int, device: Device, x: Any) -> Array:
    """``x`` as the numpy or CuPy array a send of ``peer`` copies (InvalidArgumentError if none)."""
    array, _ = native(x)
    problem = check_array(array, device, None)
    if problem is not None:
        raise InvalidArgumentError(f"send: peer {peer}: {problem}")
    return array


def deliver(job: LocalJob, mailbox: Mailbox, peer: int, x: Array, dst: int, tag: int) -> None:
    """A checked send's message: a copy of ``x`` into ``dst``'s mailbox, here or in its process."""
    if job.gone_among((dst,)):  # (this job's: a peer id may be another process's in a later job)
        raise PeerLostError(f"send: peer {dst} left the job (finish): it receives nothing more", [dst])
    lost = job.node.lost_peer(dst, orchestrator=False) if job.node is not None else None
    if lost is not None:  # (not the orchestrator's own loss: peers of this host go on without it)
        raise lost
    if job.node is not None and not job.node.is_local(dst, job.peer_ids):
        job.node.send_p2p(peer, dst, tag, HOST.adopt(x).copy())  # a copy the caller cannot touch
        return
    mailbox.put(peer, dst, tag, x.copy())


def recv(
    job: LocalJob,
    mailbox: Mailbox,
    peer: int,
    device: Device,
    src: int | None,
    tag: int,
    seconds: float,
    out: Any,
) -> tuple[int, Any]:
    """Peer ``peer``'s receive from ``src`` (None: any source): (the source, the array on
    ``device``, or ``out`` filled with it)."""
    src, tag, target = recv_checked(job, peer, device, src, tag, out)
    return receive(job, mailbox, peer, device, src, tag, seconds, out, target)


def recv_checked(
    job: LocalJob, peer: int, device: Device, src: Any, tag: Any, out: Any
) -> tuple[int | None, int, Any]:
    """A receive's own checks: (the source, the tag, ``out`` as the array written); the error
    InvalidArgumentError naming what is wrong."""
    if src is None:
        tag = _tag(tag)
    else:
        src, tag = _check(job, peer, src, tag, "src")
    return src, tag, out_target(peer, device, out)


def out_target(peer: int, device: Device, out: Any) -> Any:
    """The array a receive of ``peer`` writes its message through (``out``'s view; None for no
    ``out``); InvalidArgumentError when it cannot be written."""
    try:
        target = writable(out)
    except InvalidArgumentError as exc:  # an unreadable tensor, an immutable JAX array
        raise InvalidArgumentError(f"recv: peer {peer}: out: {exc}") from None
    if out is not None:
        problem = check_array(target, device, None, name="out")
        if problem is None and not target.flags.writeable:
            problem = "out must be a writeable array"
        if problem is None and overlaps_itself(target.shape, target.strides, target.itemsize):
            problem = (
                "out has elements that share memory (an expanded or stride-tricks view): a message "
                "cannot be written into it; pass an array of its own (a copy)"
            )
        if problem is not None:
            raise InvalidArgumentError(f"recv: peer {peer}: {problem}")
    return target


def receive(
    job: LocalJob,
    mailbox: Mailbox,
    peer: int,
    device: Device,
    src: int | None,
    tag: int,
    seconds: float,
    out: Any,
    target: Any,
    deadline: float | None = None,
    posted: Any = None,
) -> tuple[int, Any]:
    """A checked receive (``recv_checked``): (the source, the message on ``device``, or ``out``
    filled with it, written through ``target``), within ``seconds`` (or until ``deadline``, a
    time.monotonic() reading, when given: ``seconds`` is then the timeout its error names).
    ``posted``: a receive started before (``Mailbox.post``), which takes the message of its turn."""

    def gone(source: int | None) -> CollectiveError | None:
        """Why ``source`` can send no more; with None (any source): why no peer can."""
        if source is None:
            reasons = [gone(other) for other in range(job.world) if other != peer]
            return reasons[0] if reasons and all(reasons) else None
        if job.gone_among((source,)):  # (this job's: a peer id may be another process's in a later job)
            return left_error(source, peer)
        return job.node.lost_peer(source) if job.node is not None else None

    def unfit(data: Array) -> str | None:  # the message stays queued for a recv that fits it
        if tuple(target.shape) == tuple(data.shape) and target.dtype == data.dtype:
            return None
        return (
            f"recv: peer {peer}: out has shape {tuple(target.shape)} and dtype {target.dtype}; "
            f"{'the first message has' if src is None else f'peer {src} sent'} "
            f"{tuple(data.shape)} {data.dtype} (the message is still there for a recv that fits it)"
        )

    remote = job.node is not None and (src is None or not job.node.is_local(src, job.peer_ids))
    pump = job.node.pump if remote and job.node is not None else None
    deadline = time.monotonic() + seconds if deadline is None else deadline
    refuse = None if out is None else unfit
    source, taken = mailbox.take(src, peer, tag, deadline, seconds, gone, pump, refuse, posted)
    data = device.adopt(taken)
    if out is None:
        return source, data
    target[...] = data
    return source, out


MAX_TAG = (1 << 63) - 1  # tags travel between processes as signed 64-bit integers


def _check(job: LocalJob, peer: int, other: Any, tag: Any, name: str) -> tuple[int, int]:
    """(the other peer, the tag) as ints; InvalidArgumentError naming what is wrong."""
    other_id = integer(other)
    if other_id is None or not 0 <= other_id < job.world:
        raise InvalidArgumentError(f"{name}={other!r} is not a peer of the job (peers 0..{job.world - 1})")
    if other_id == peer:
        raise InvalidArgumentError(f"peer {peer} cannot send to or receive from itself")
    return other_id, _tag(tag)


def _tag(tag: Any) -> int:
    value = integer(tag)
    if value is None or not 0 <= value <= MAX_TAG:
        raise InvalidArgumentError(f"tag must be an integer from 0 to 2**63 - 1, got {tag!r}")
    return value


class PeerMessages:
    """``peer``'s messages in ``job`` (collective.persistent.p2p's ``Messages``: what its persistent
    sends and receives do at each use)."""

    def __init__(self, job: LocalJob, mailbox: Mailbox, peer: int, device: Device) -> None:
        self.job, self.mailbox, self.peer, self.device = job, mailbox, peer, device

    def check(self) -> None:
        with self.job.lock:
            self.job.check_member(self.peer)

    def sent_array(self, x: Any) -> Array:
        return sent_array(self.peer, self.device, x)

    def deliver(self, array: Array, dst: int, tag: int) -> None:
        deliver(self.job, self.mailbox, self.peer, array, dst, tag)

    def out_target(self, out: Any) -> Any:
        return out_target(self.peer, self.device, out)

    def post(self, src: int, tag: int, receive: Any) -> None:
        self.mailbox.post(src, self.peer, tag, receive)

    def unpost(self, src: int, tag: int, receive: Any) -> None:
        self.mailbox.unpost(src, self.peer, tag, receive)

    def receive(
        self, src: int, tag: int, seconds: float, out: Any, target: Any, deadline: float, posted: Any
    ) -> Any:
        job, mailbox, peer, device = self.job, self.mailbox, self.peer, self.device
        return receive(job, mailbox, peer, device, src, tag, seconds, out, target, deadline, posted)[1]


class PersistentPoints:
    """The Runtime's ``send_init`` and ``recv_init`` (a mixin of collective.runtime.Runtime)."""

    _mailbox: Mailbox

    def _road(self, peer_id: int, group: Any, timeout: float | None) -> tuple[Any, Any, float, str | None]:
        raise NotImplementedError

    def send_init(
        self, peer_id: int, x: Array, dst: int, tag: int = 0, *, timeout: float | None = None
    ) -> PersistentSend:
        """A persistent send of ``x`` to ``dst`` with ``tag``: each use sends x's contents then.
        Raises as send does (InvalidArgumentError for a bad peer, tag or array), when made."""
        member, seconds = self._point(peer_id, timeout)
        job, device = member.job, member.device
        dst, tag, array = send_checked(job, peer_id, device, x, dst, tag)
        return PersistentSend(
            peer_id, PeerMessages(job, self._mailbox, peer_id, device), seconds, x, array, dst, tag
        )

    def recv_init(
        self, peer_id: int, src: int, tag: int = 0, *, out: Array | None = None, timeout: float | None = None
    ) -> PersistentRecv:
        """A persistent receive from ``src`` with ``tag``: each use receives the next such message
        into ``out`` (without one: the array the first use received). Raises as recv does."""
        if src is None:
            raise InvalidArgumentError(
                f"recv_init: peer {peer_id}: a persistent receive is from one peer: name src (a receive from "
                f"any peer has no persistent form: call recv_any)"
            )
        member, seconds = self._point(peer_id, timeout)
        job, device = member.job, member.device
        found, tag, target = recv_checked(job, peer_id, device, src, tag, out)
        messages = PeerMessages(job, self._mailbox, peer_id, device)
        return PersistentRecv(peer_id, messages, seconds, found, tag, out, target)  # type: ignore[arg-type]

    def _point(self, peer_id: int, timeout: float | None) -> tuple[Any, float]:
        """The peer (registered: else RegistrationError) and a use's timeout (checked)."""
        member, _, seconds, problem = self._road(peer_id, None, timeout)
        if problem is not None:
            raise InvalidArgumentError(problem)
        return member, seconds
