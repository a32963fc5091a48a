"""Messages that must go out before their process leaves: the point-to-point sends of a node.

A send returns once its message is queued (eager). When a node leaves, its sockets close without
lingering (a dead peer's queue must not hold up ``finish``), so a message still queued then was
dropped, and a zero-copy one could still be read by ZeroMQ after the interpreter had freed its
buffer at exit (a crash). The outbox tracks every message it sends; ``flush`` waits, bounded,
until each one went out or its destination is known to be lost. A node flushes when it leaves
and at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

# Imported before any flush is registered: at exit, pyzmq lets go of the buffers of zero-copy
# messages (its own atexit handler); handlers run last-registered first, so a flush runs before it.
import zmq
import zmq.utils.garbage

from collective.transport.network import POLL_SLICE

__all__ = ["Outbox", "went_out"]

Send = Callable[[int, dict[str, Any], Any], "zmq.MessageTracker | None"]


def went_out(tracker: zmq.MessageTracker, deadline: float, lost: Callable[[], Any]) -> Any:
    """Wait until ZeroMQ let go of ``tracker``'s message (None), its destination is lost (``lost()``'s
    error, looked at between slices of waiting) or ``deadline`` passed (None: see ``tracker.done``)."""
    while not tracker.done:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        error = lost()
        if error is not None:
            return error
        with contextlib.suppress(zmq.NotDone):
            tracker.wait(min(remaining, POLL_SLICE))
    return None


class Outbox:
    """``send(node, header, payload)`` tracked; ``lost(node)`` is not None once ``node`` is gone."""

    def __init__(self, send: Send, lost: Callable[[int], object]) -> None:
        self._send = send
        self._lost = lost
        self._lock = threading.Lock()
        self._pending: list[tuple[int, zmq.MessageTracker]] = []
        atexit.register(self.flush)

    def send(self, node: int, header: dict[str, Any], payload: Any) -> None:
        tracker = self._send(node, header, payload)
        if tracker is None:
            return
        with self._lock:
            if len(self._pending) >= 64:  # forget the ones that went out
                self._pending = [(n, t) for n, t in self._pending if not t.done]
            self._pending.append((node, tracker))

    def flush(self, limit: float = 60.0) -> None:
        """Wait at most ``limit`` seconds until every message went out or its node is lost."""
        deadline = time.monotonic() + limit
        with self._lock:
            pending, self._pending = self._pending, []
        for node, tracker in pending:
            went_out(tracker, deadline, partial(self._lost, node))

    def close(self, limit: float) -> None:
        """Flush, and no longer at exit (the node left)."""
        self.flush(limit)
        atexit.unregister(self.flush)
