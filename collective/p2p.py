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

from collective.algorithms.ops import Array
from collective.errors import CollectiveError, CollectiveTimeout, MismatchError, PeerLostError

__all__ = ["Mailbox"]

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
