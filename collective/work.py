"""Asynchronous collectives: ``Work`` handles, and the sequencer that keeps one peer's calls in order.

``async_op=True`` returns a Work at once; the collective runs on a worker thread of its
``Sequencer`` (one per peer and group), which runs that peer's calls on that group one after
another in the order they were issued, blocking calls included: a blocking call made while
asynchronous ones are queued waits its turn. A worker thread ends ``Sequencer.LINGER`` seconds
after its queue drained, so a Work dropped unwaited leaks nothing once its collective ends. The
torch backend (collective.torch) keeps its groups' calls in order with a Sequencer too.

Buffer rule: an array passed to an asynchronous collective (input or ``out``) must not be modified
until ``wait()`` has returned.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

from collective.arrays import real
from collective.errors import CollectiveError, CollectiveTimeout, InvalidArgumentError
from collective.transport.inproc import clone_error

__all__ = ["Sequencer", "Work"]


class Work:
    """The handle of one asynchronous collective."""

    def __init__(self, label: str = "collective") -> None:
        self._label = label
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def wait(self, timeout: float | None = None) -> Any:
        """The collective's result, or its error raised here; CollectiveTimeout after ``timeout`` seconds.

        A timeout here does not cancel the collective: wait again, or let it end by itself. None
        (or infinity) waits until it ends, which its own timeout bounds. Raises InvalidArgumentError
        for a timeout that is no number of seconds >= 0.
        """
        if timeout is not None:
            value = real(timeout)
            if value is None or not value >= 0:
                raise InvalidArgumentError(f"wait(timeout) takes seconds >= 0 or None, got {timeout!r}")
            timeout = value
            if timeout >= threading.TIMEOUT_MAX:  # (infinity included): longer than the collective can run
                timeout = None
        if not self._done.wait(timeout):
            raise CollectiveTimeout(
                f"{self._label} did not complete within {timeout:g}s of wait(); it is still running "
                f"(its own timeout still applies)"
            )
        if self._error is not None:
            raise clone_error(self._error) if isinstance(self._error, CollectiveError) else self._error
        return self._result

    def is_completed(self) -> bool:
        """Whether the collective has ended (successfully or not)."""
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        """The error the collective ended with; None while it runs or when it succeeded."""
        return self._error if self._done.is_set() else None

    def _settle(self, call: Callable[[], Any]) -> None:
        try:
            self._result = call()
        except BaseException as exc:  # handed to wait(), re-raised there
            self._error = exc
        finally:
            self._done.set()

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("failed" if self._error else "done")
        return f"<Work {self._label} {state}>"


class Sequencer:
    """Runs the calls of one peer on one group one at a time, in the order they were issued.

    One party at a time is *active*: the caller's thread running a blocking call inline, or the
    worker thread draining the queue. When the worker has drained the queue it parks for up to
    LINGER seconds before it ends: waking a parked thread costs ~20 us here, starting one ~110 us,
    and a training step hands the worker a bucket every few milliseconds. It parks on a bell of
    its own, rung after the lock is released (a Condition would make it wake to a lock its waker
    still holds, and sleep again).

    A call made on the worker thread while it runs a call (a callback run as a torch work
    completes, as DDP's PowerSGD hook makes them) runs there at once, ``submit`` and ``call``
    alike: queued, it would wait for the call that waits for it. Every peer makes it at the same
    point of its order (as that call completes).
    """

    LINGER = 0.5

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()  # guards every field below (a plain lock: blocking calls take it)
        self._idle = threading.Condition(self._lock)  # notified when no call runs or waits
        self._idle_waiters = 0  # (a notify costs ~1 us: only when finish() waits)
        self._queue: deque[Callable[[], None]] = deque()  # jobs that hand their outcome on
        self._active = False  # a call is running (in its caller's thread or the worker)
        self._parked = False  # the worker thread exists and waits for a hand-off (which clears this)
        self._bell = threading.Lock()  # released once per hand-off to the parked worker
        self._bell.acquire()
        self._worker: threading.Thread | None = None

    @property
    def pending(self) -> int:
        """Calls issued and not ended yet: the one running (if any) and those queued behind it (for
        tests and diagnostics). 0 is exact (idle); while the worker thread passes from one call to
        the next, the count may include one call too many for a moment."""
        with self._lock:
            return len(self._queue) + self._active

    def submit(self, call: Callable[[], Any], label: str) -> Work:
        """Queue ``call``; its Work completes when it has run after every earlier call."""
        work = Work(label)
        self.enqueue(partial(work._settle, call))
        return work

    def enqueue(self, job: Callable[[], None]) -> None:
        """Queue ``job``, which hands its outcome on itself (a torch work's ``run`` does), to run
        after every earlier call."""
        if self._worker is not None and threading.get_ident() == self._worker.ident:  # made by the call
            job()  # the worker runs
            return
        with self._lock:
            self._queue.append(job)
            ring = not self._active and self._hand_to_worker()
        if ring:
            self._bell.release()

    def call(self, call: Callable[..., Any], label: str, *args: Any) -> Any:
        """Run ``call(*args)`` now in this thread when nothing is queued, else after the queued ones."""
        if self._worker is not None and threading.get_ident() == self._worker.ident:  # made by the call
            return call(*args)  # the worker runs
        with self._lock:
            inline = not self._active
            self._active = True
        if not inline:
            return self.submit(partial(call, *args), label).wait()
        try:
            return call(*args)
        finally:
            with self._lock:
                ring = bool(self._queue) and self._hand_to_worker()
                if not self._queue:
                    self._active = False
                    if self._idle_waiters:
                        self._idle.notify_all()
            if ring:
                self._bell.release()

    def wait_idle(self) -> None:
        """Wait until every call issued so far has ended (each is bounded by its own timeout)."""
        with self._lock:
            self._idle_waiters += 1
            try:
                self._idle.wait_for(lambda: not self._active and not self._queue)
            finally:
                self._idle_waiters -= 1

    def _hand_to_worker(self) -> bool:
        """Make the worker the active party (lock held): start one, or claim the parked one and
        return True: the caller rings the bell once it has released the lock."""
        self._active = True
        parked, self._parked = self._parked, False
        if parked and self._worker is not None and self._worker.is_alive():  # (not after a fork)
            return True
        self._worker = threading.Thread(target=self._drain, name=f"collective-{self._name}", daemon=True)
        self._worker.start()
        return False

    def _drain(self) -> None:
        while True:
            with self._lock:
                job = self._queue.popleft() if self._queue else None
                if job is None:
                    self._active = False
                    if self._idle_waiters:
                        self._idle.notify_all()
                    self._parked = True
            if job is not None:
                job()
            elif not self._handed():
                return

    def _handed(self) -> bool:
        """Parked: True once a hand-off rang the bell, False after LINGER seconds without one."""
        if self._bell.acquire(timeout=self.LINGER):
            return True
        with self._lock:
            if self._parked:  # nobody claimed it: the thread ends
                self._parked = False
                return False
        self._bell.acquire()  # claimed just as the wait timed out: its ring is on the way
        return True
