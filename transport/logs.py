"""Logging that a hostile peer cannot turn against the service that logs.

Two tools:

``Throttle``  at most one line per ``interval`` seconds for one kind of event (a refused message,
              a refused connection); the events in between are counted and the next line (or
              ``flush()``) says how many there were. Random bytes sent to a ZeroMQ socket without
              CURVE parse as hundreds of ZMTP/1.0 messages: one line each would be a flood.
``nonblocking_logging()``  for a daemon whose stderr may be a pipe nobody reads: every handler of
              the root logger is replaced by a bounded queue that a writer thread empties with
              ``os.write``. A full pipe blocks only that thread; a full queue drops records (and
              the count is written once the pipe drains), so the service never waits on its logs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["Throttle", "nonblocking_logging"]

LOG_QUEUE = 1000  # records waiting for the writer thread; more are dropped


class Throttle:
    """Rate-limits warnings: per kind (``key``), the first at once, then at most one per ``interval`` s."""

    KINDS = 64  # kinds tracked separately; more share one

    def __init__(self, logger: logging.Logger, interval: float = 5.0) -> None:
        self._logger = logger
        self._interval = interval
        self._kinds: dict[str, list[Any]] = {}  # key -> [next time a line may go out, events held back]
        self._lock = threading.Lock()

    def warning(self, message: str, *args: object, key: str | None = None) -> None:
        """Log ``message % args`` now, or count it if a line of its kind went out within ``interval``.

        The kind is ``key``, or the message's format string.
        """
        with self._lock:
            key = key if key is not None else message
            if key not in self._kinds and len(self._kinds) >= self.KINDS:
                key = ""
            state = self._kinds.setdefault(key, [0.0, 0])
            now = time.monotonic()
            if now < state[0]:
                state[1] += 1
                return
            held, state[0], state[1] = state[1], now + self._interval, 0
        if held:
            message += f" (and {held} more like it in the last {self._interval:g}s)"
        self._logger.warning(message, *args)

    def flush(self, force: bool = False) -> None:
        """Log how many events were held back, once ``interval`` has passed since the last line (or now)."""
        with self._lock:
            now = time.monotonic()
            held = 0
            for state in self._kinds.values():
                if state[1] and (force or now >= state[0]):
                    held += state[1]
                    state[1] = 0
        if held:
            self._logger.warning("%d more like the last ones in %gs", held, self._interval)


class _QueueHandler(logging.Handler):
    """Formats records into a bounded queue; counts what does not fit."""

    def __init__(self, formatter: logging.Formatter | None, fd: int) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self.lines: queue.Queue[bytes | None] = queue.Queue(LOG_QUEUE)
        self.dropped = 0
        self._fd = fd
        self._writer = threading.Thread(target=self._write, name="collective-log-writer", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode(errors="replace")
        except Exception:
            self.handleError(record)
            return
        try:
            self.lines.put_nowait(line)
        except queue.Full:
            self.dropped += 1

    def _write(self) -> None:
        while True:
            line = self.lines.get()
            if line is None:
                return
            dropped, self.dropped = self.dropped, 0
            if dropped:
                line = f"({dropped} log lines dropped: stderr was not read)\n".encode() + line
            with contextlib.suppress(OSError):  # a closed stderr: nothing to be done
                while line:
                    line = line[os.write(self._fd, line) :]

    def stop(self, timeout: float) -> None:
        """Let the writer finish what is queued, for at most ``timeout`` seconds (it is a daemon)."""
        with contextlib.suppress(queue.Full):
            self.lines.put(None, timeout=timeout)
        self._writer.join(timeout)


@contextlib.contextmanager
def nonblocking_logging(fd: int = 2) -> Iterator[None]:
    """Within the block, the root logger's records go to ``fd`` without ever blocking the caller."""
    root = logging.getLogger()
    previous = list(root.handlers)
    formatter = previous[0].formatter if previous else None
    handler = _QueueHandler(formatter, fd)
    for old in previous:
        root.removeHandler(old)
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        for old in previous:
            root.addHandler(old)
        handler.stop(0.5)
