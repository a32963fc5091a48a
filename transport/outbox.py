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
from typing import Any

# Imported before any flush is registered: at exit, pyzmq lets go of the buffers of zero-copy
# messages (its own atexit handler); handlers run last-registered first, so a flush runs before it.
import zmq
import zmq.utils.garbage

__all__ = ["Outbox"]

Send = Callable[[int, dict[str, Any], Any], "zmq.MessageTracker | None"]


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
            while not tracker.done and time.monotonic() < deadline and self._lost(node) is None:
                with contextlib.suppress(zmq.NotDone):
                    tracker.wait(0.05)

    def close(self, limit: float) -> None:
        """Flush, and no longer at exit (the node left)."""
        self.flush(limit)
        atexit.unregister(self.flush)
