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

import os
import threading
import weakref
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

    One party at a time holds the *turn* (a lock taken without waiting): the caller's thread
    running a blocking call, or the worker thread draining the queue. A blocking call that finds
    the turn free and nothing queued runs at once (a lock taken and let go: the per-call cost);
    otherwise it queues its place (a ``_Baton``), where the worker passes the turn to its thread.
    A party that lets the turn go looks at the queue again after, and a party that queues a job
    takes the turn if it is free, so a job is never left queued with nobody to run it. The party
    that takes the turn for queued jobs hands it to the worker.

    When the worker has drained the queue it parks for up to LINGER seconds before it ends:
    waking a parked thread costs ~20 us here, starting one ~110 us, and a training step hands the
    worker a bucket every few milliseconds. It parks on a bell of its own, rung by the party that
    hands it the turn.

    A call made on the worker thread while it runs a call (a callback run as a torch work
    completes, as DDP's PowerSGD hook makes them) runs there at once, ``submit`` and ``call``
    alike: queued, it would wait for the call that waits for it. Every peer makes it at the same
    point of its order (as that call completes).
    """

    LINGER = 0.5

    def __init__(self, name: str) -> None:
        self._name = name
        self._fresh()
        _SEQUENCERS.add(self)

    def _fresh(self) -> None:
        """No call run or queued, no worker: as made, and in a child process just forked (no thread
        of the parent's runs there: its turn, the calls it queued and its worker stay the parent's;
        a worker forked along keeps the old queue)."""
        self._turn = threading.Lock()  # held by the party running calls
        self._queue: deque[Callable[[], None]] = deque()  # jobs that hand their outcome on
        self._lock = threading.Lock()  # guards the worker's parking (the two fields below, batons' flags)
        self._parked = False  # the worker thread exists and waits for a hand-off (which clears this)
        self._worker: threading.Thread | None = None
        self._bell = threading.Lock()  # released once per hand-off to the parked worker
        self._bell.acquire()

    @property
    def pending(self) -> int:
        """Calls issued and not ended yet: the one running (if any) and those queued behind it (for
        tests and diagnostics). 0 is exact (idle); while the turn passes from one party to the
        next, the count may include one call too many for a moment."""
        return len(self._queue) + self._turn.locked()

    def submit(self, call: Callable[[], Any], label: str) -> Work:
        """Queue ``call``; its Work completes when it has run after every earlier call."""
        work = Work(label)
        self.enqueue(partial(work._settle, call))
        return work

    def enqueue(self, job: Callable[[], None]) -> None:
        """Queue ``job``, which hands its outcome on itself (a torch work's ``run`` does), to run
        after every earlier call."""
        worker = self._worker
        if worker is not None and threading.get_ident() == worker.ident:  # made by the call
            job()  # the worker runs
            return
        self._queue.append(job)
        if self._turn.acquire(False):  # (else the party holding it finds the job as it lets go)
            self._hand_to_worker()

    def call(self, call: Callable[..., Any], label: str, *args: Any) -> Any:
        """Run ``call(*args)`` in this thread, once the calls issued before it have run."""
        worker = self._worker
        if worker is not None and threading.get_ident() == worker.ident:  # made by the call
            return call(*args)  # the worker runs
        turn = self._turn
        if turn.acquire(False):
            if not self._queue:
                try:
                    return call(*args)
                finally:
                    turn.release()
                    if self._queue:  # (queued while this ran: its party left it to this one)
                        self._resume()
            self._hand_to_worker()  # (queued by a party as the turn was let go: before this call)
        baton = _Baton()  # this call's place in the queue: there the turn passes to this thread
        try:
            self.enqueue(baton)
            baton.passed.acquire()  # (no timeout: each call before this one ends by its own at the latest)
        except BaseException:  # (interrupted: a KeyboardInterrupt in a notebook, which goes on)
            with self._lock:
                given, baton.abandoned = baton.given, not baton.given  # (not given: the worker skips it)
            if given:
                self._let_go()
            raise
        try:
            return call(*args)
        finally:
            self._let_go()

    def wait_idle(self) -> None:
        """Wait until every call issued so far has ended (each is bounded by its own timeout)."""
        while True:
            self._turn.acquire()
            if not self._queue:
                self._let_go()
                return
            self._hand_to_worker()

    def _let_go(self) -> None:
        """Let the turn go, and take it again for jobs queued meanwhile (``call``'s first way does
        the same inline)."""
        self._turn.release()
        if self._queue:
            self._resume()

    def _resume(self) -> None:
        """Jobs were queued while the turn was held and it was let go: take it for them, unless
        another party did."""
        if self._turn.acquire(False):
            self._hand_to_worker()

    def _hand_to_worker(self) -> None:
        """Give the turn (held by the caller) to the worker: the parked one, or a new one."""
        with self._lock:
            parked, self._parked = self._parked, False
            worker = self._worker
            if not (parked and worker is not None and worker.is_alive()):  # (not after a fork)
                worker = self._worker = threading.Thread(
                    target=self._drain, name=f"collective-{self._name}", daemon=True
                )
                worker.start()
                return
        self._bell.release()

    def _drain(self) -> None:
        """The worker: run queued jobs while it holds the turn; park once none is left, or once it
        passed the turn to a blocking call's thread (``_Baton``)."""
        queue, turn = self._queue, self._turn
        while True:
            passed = False
            while queue and not passed:
                job = queue.popleft()
                if type(job) is _Baton:  # (parked before the turn passes: the next to take it claims this)
                    with self._lock:
                        if job.abandoned:
                            continue
                        job.given = self._parked = passed = True
                job()
            if not passed:
                with self._lock:
                    self._parked = True  # (before the turn is let go, as above)
                turn.release()
                if queue and turn.acquire(False):  # (queued as it let go, by a party that left it to this)
                    with self._lock:  # (nobody claimed it: the turn was free)
                        self._parked = False
                    continue
            if not self._handed():
                return

    def _handed(self) -> bool:
        """Parked: True once a hand-off rang the bell (the turn is this thread's), False after
        LINGER seconds without one."""
        if self._bell.acquire(timeout=self.LINGER):
            return True
        with self._lock:
            if self._parked:  # nobody claimed it: the thread ends (its id may be another's next)
                self._parked, self._worker = False, None
                return False
        self._bell.acquire()  # claimed just as the wait timed out: its ring is on the way
        return True


_SEQUENCERS: weakref.WeakSet[Sequencer] = weakref.WeakSet()


def _forked() -> None:
    for sequencer in list(_SEQUENCERS):
        sequencer._fresh()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


class _Baton:
    """A blocking call queued behind others: the worker that reaches it passes the turn to the
    call's thread (a blocking call always runs in its caller's thread)."""

    __slots__ = ("abandoned", "given", "passed")

    def __init__(self) -> None:
        self.passed = threading.Lock()
        self.passed.acquire()
        self.given = self.abandoned = False  # (set under the sequencer's lock)

    def __call__(self) -> None:
        self.passed.release()
