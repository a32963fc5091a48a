"""Point-to-point messages: eager ``send``, ``recv`` matched by (source, tag) in order.

``send`` copies the array into the destination's mailbox and returns (it never waits for the
matching ``recv``), so two peers may send to each other and then receive. Messages of one
(src, dst, tag) arrive in the order sent; different tags do not block each other. A ``recv``
waits until its deadline: CollectiveTimeout naming the source, or PeerLostError when the source
left (or its node was lost) with nothing sent.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from collective.algorithms.ops import Array
from collective.arrays import Device, check_array
from collective.errors import (
    CollectiveError,
    CollectiveTimeout,
    InvalidArgumentError,
    MismatchError,
    PeerLostError,
)
from collective.tensors import native

__all__ = ["Mailbox", "recv", "send"]

if TYPE_CHECKING:
    from collective.job import LocalJob

Key = tuple[int, int, int]  # (src, dst, tag)
DEFAULT_LIMIT = 1 << 30  # unreceived bytes kept per source process
PUMP_SLICE = 0.005  # a receive waiting for another process lets its messages in this often


class Mailbox:
    """The messages waiting for this process's peers."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._cv = threading.Condition()
        self._boxes: dict[Key, deque[tuple[Array, bool]]] = {}  # (array, from another process)
        self._closed: CollectiveError | None = None
        self._limit = limit
        self._pending: dict[int, int] = {}  # src -> bytes from another process not yet received
        self._overflowed: dict[int, str] = {}

    def put(self, src: int, dst: int, tag: int, data: Array, remote: bool = False) -> None:
        """Keep ``data`` for ``dst``. From another process (``remote``), at most ``limit`` unreceived
        bytes per source are kept; beyond that the message is dropped and ``src``'s next receive fails."""
        with self._cv:
            if remote:
                pending = self._pending.get(src, 0) + data.nbytes
                if pending > self._limit:
                    self._overflowed[src] = (
                        f"peer {src} sent more than {self._limit >> 20} MiB that were not received yet: "
                        f"a message of {data.nbytes} bytes to peer {dst} (tag {tag}) was dropped"
                    )
                    self._cv.notify_all()
                    return
                self._pending[src] = pending
            self._boxes.setdefault((src, dst, tag), deque()).append((data, remote))
            self._cv.notify_all()

    def take(
        self,
        src: int,
        dst: int,
        tag: int,
        deadline: float,
        timeout: float,
        gone: Callable[[int], CollectiveError | None],
        pump: Callable[[float], None] | None = None,
    ) -> Array:
        """The next message from ``src`` to ``dst`` with ``tag``; raises at the deadline or on loss.

        ``pump(seconds)`` lets messages from other processes arrive while this waits.
        """
        key = (src, dst, tag)
        while True:
            with self._cv:
                box = self._boxes.get(key)
                if box:
                    data, remote = box.popleft()
                    if not box:
                        del self._boxes[key]
                    if remote:
                        self._pending[src] -= data.nbytes
                    return data
                if self._closed is not None:
                    raise self._closed
                if src in self._overflowed:
                    raise MismatchError(self._overflowed.pop(src))
                lost = gone(src)
                if lost is not None:
                    raise lost
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveTimeout(
                        f"recv: peer {dst} waited {timeout:g}s for a message from peer {src} with tag {tag}; "
                        f"check that peer {src} calls send(..., dst={dst}, tag={tag})",
                        [src],
                    )
                if pump is None:
                    self._cv.wait(min(remaining, 0.05))
            if pump is not None:
                pump(min(remaining, PUMP_SLICE))

    def wake(self) -> None:
        """Let waiting receivers look again (a peer left, a node was lost)."""
        with self._cv:
            self._cv.notify_all()

    def close(self, error: CollectiveError) -> None:
        with self._cv:
            self._closed = error
            self._cv.notify_all()


def left_error(src: int, dst: int) -> PeerLostError:
    return PeerLostError(f"recv: peer {src} left the job (finish) before sending to peer {dst}", [src])


HOST = Device("cpu")


def send(job: LocalJob, mailbox: Mailbox, peer: int, device: Device, x: Any, dst: int, tag: int) -> None:
    """Peer ``peer``'s send: checked, copied, and into ``dst``'s mailbox (here or in its process)."""
    _check(job, peer, dst, tag, "dst")
    x, _ = native(x)
    problem = check_array(x, device, None)
    if problem is not None:
        raise InvalidArgumentError(f"send: peer {peer}: {problem}")
    if job.node is not None and not job.node.is_local(dst, job.peer_ids):
        job.node.send_p2p(peer, dst, tag, HOST.adopt(x).copy())  # a copy the caller cannot touch
        return
    mailbox.put(peer, dst, tag, x.copy())


def recv(
    job: LocalJob,
    mailbox: Mailbox,
    finished: set[int],
    peer: int,
    device: Device,
    src: int,
    tag: int,
    seconds: float,
    out: Any,
) -> Any:
    """Peer ``peer``'s receive from ``src``: the array (on ``device``), or ``out`` filled with it."""
    _check(job, peer, src, tag, "src")

    def gone(source: int) -> CollectiveError | None:
        if source in finished or source in job.gone_among((source,)):
            return left_error(source, peer)
        return job.node.lost_peer(source) if job.node is not None else None

    remote = job.node is not None and not job.node.is_local(src, job.peer_ids)
    pump = job.node.pump if remote and job.node is not None else None
    data = device.adopt(mailbox.take(src, peer, tag, time.monotonic() + seconds, seconds, gone, pump))
    if out is None:
        return data
    target, _ = native(out)
    if tuple(target.shape) != tuple(data.shape) or target.dtype != data.dtype:
        raise InvalidArgumentError(
            f"recv: out has shape {tuple(target.shape)} and dtype {target.dtype}; peer {src} sent "
            f"{tuple(data.shape)} {data.dtype}"
        )
    target[...] = data
    return out


def _check(job: LocalJob, peer: int, other: Any, tag: Any, name: str) -> None:
    if isinstance(other, bool) or not isinstance(other, int) or not 0 <= other < job.world:
        raise InvalidArgumentError(f"{name}={other!r} is not a peer of the job (peers 0..{job.world - 1})")
    if other == peer:
        raise InvalidArgumentError(f"peer {peer} cannot send to or receive from itself")
    if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise InvalidArgumentError(f"tag must be an integer >= 0, got {tag!r}")
