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
from collective.errors import CollectiveError, CollectiveTimeout, PeerLostError

__all__ = ["Mailbox"]

Key = tuple[int, int, int]  # (src, dst, tag)


class Mailbox:
    """The messages waiting for this process's peers."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._boxes: dict[Key, deque[Array]] = {}
        self._closed: CollectiveError | None = None

    def put(self, src: int, dst: int, tag: int, data: Array) -> None:
        with self._cv:
            self._boxes.setdefault((src, dst, tag), deque()).append(data)
            self._cv.notify_all()

    def take(
        self,
        src: int,
        dst: int,
        tag: int,
        deadline: float,
        timeout: float,
        gone: Callable[[int], CollectiveError | None],
    ) -> Array:
        """The next message from ``src`` to ``dst`` with ``tag``; raises at the deadline or on loss."""
        key = (src, dst, tag)
        with self._cv:
            while True:
                box = self._boxes.get(key)
                if box:
                    data = box.popleft()
                    if not box:
                        del self._boxes[key]
                    return data
                if self._closed is not None:
                    raise self._closed
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
                self._cv.wait(min(remaining, 0.05))

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
