"""Point-to-point messages: eager ``send``, ``recv`` matched by (source, tag) in order.

``send`` copies the array into the destination's mailbox (collective.node.mailbox) and returns
(it never waits for the matching ``recv``), so two peers may send to each other and then
receive. Messages of one (src, dst, tag) arrive in the order sent; different tags do not block
each other. A ``recv`` waits until its deadline: CollectiveTimeout naming the source, or
PeerLostError when the source left (or its node was lost) with nothing sent.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from collective.algorithms.ops import Array
from collective.arrays import Device, check_array, integer, overlaps_itself
from collective.errors import CollectiveError, InvalidArgumentError, PeerLostError
from collective.node.mailbox import Mailbox
from collective.persistent.p2p import PersistentRecv, PersistentSend, described, traced
from collective.tensors import native, writable

__all__ = [
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
