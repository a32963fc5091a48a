"""The Sequencer (collective.work) on its own: order, hand-offs between the caller and its worker,
calls made from the worker's own call, and the worker thread's life (parked between bursts of
asynchronous calls, gone after LINGER)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from collective.work import Sequencer
from tests.conftest import wait_until

WAIT = 10.0  # bound on every wait of these tests


def _worker_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"collective-{name}"]


def test_calls_run_in_issue_order_whoever_runs_them() -> None:
    sequencer = Sequencer("order")
    ran: list[int] = []
    gate, started = threading.Event(), threading.Event()
    first = sequencer.submit(lambda: (started.set(), gate.wait(WAIT), ran.append(0)), "first")
    works = [sequencer.submit(lambda i=i: ran.append(i), f"call {i}") for i in range(1, 5)]
    assert started.wait(WAIT)  # the worker runs the first call (held at the gate)
    blocking = threading.Thread(target=lambda: sequencer.call(lambda: ran.append(5), "blocking"))
    blocking.start()
    # the blocking call is queued behind the four (6 pending with the first), not run inline
    wait_until(lambda: sequencer.pending == 6 or ran, WAIT, "the blocking call queued behind the four")
    assert ran == []
    gate.set()
    blocking.join(WAIT)
    for work in (first, *works):
        work.wait(WAIT)
    assert ran == [0, 1, 2, 3, 4, 5]


def test_a_blocking_call_queued_behind_others_runs_in_its_own_thread() -> None:
    """The worker passes the turn to the blocking call's thread (thread-local state, such as
    torch's grad mode, is the caller's), then takes up what was queued after it."""
    sequencer = Sequencer("baton")
    gate, started = threading.Event(), threading.Event()
    ran: list[tuple[str, threading.Thread]] = []
    first = sequencer.submit(lambda: (started.set(), gate.wait(WAIT)), "first")
    assert started.wait(WAIT)
    caller = threading.Thread(
        target=lambda: sequencer.call(lambda: ran.append(("blocking", threading.current_thread())), "b")
    )
    caller.start()
    wait_until(lambda: sequencer.pending == 2, WAIT, "the blocking call queued behind the first")
    after = sequencer.submit(lambda: ran.append(("after", threading.current_thread())), "after")
    gate.set()
    caller.join(WAIT)
    first.wait(WAIT)
    after.wait(WAIT)
    assert [name for name, _ in ran] == ["blocking", "after"]
    assert ran[0][1] is caller and ran[1][1] is not caller


def test_a_blocking_call_interrupted_in_the_queue_leaves_the_others_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KeyboardInterrupt while a blocking call waits its turn (in a notebook, which goes on):
    the worker skips its place, and later calls run."""
    import collective.work as work

    class Interrupted(work._Baton):
        __slots__ = ()

        def __init__(self) -> None:
            super().__init__()
            self.passed = _Raising(self.passed)

    class _Raising:
        def __init__(self, lock: Any) -> None:
            self.lock = lock

        def acquire(self) -> bool:
            raise KeyboardInterrupt

        def release(self) -> None:
            self.lock.release()

    sequencer = Sequencer("interrupted")
    gate, started = threading.Event(), threading.Event()
    first = sequencer.submit(lambda: (started.set(), gate.wait(WAIT)), "first")
    assert started.wait(WAIT)
    monkeypatch.setattr(work, "_Baton", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        sequencer.call(lambda: 1, "interrupted")
    monkeypatch.undo()
    gate.set()
    first.wait(WAIT)
    done = threading.Event()
    runner = threading.Thread(target=lambda: sequencer.call(lambda: 5, "later") == 5 and done.set())
    runner.start()
    runner.join(WAIT)
    assert done.is_set(), "a call after the interrupted one never ran"
    assert sequencer.pending == 0


def test_a_parked_worker_is_reused_then_ends_after_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Sequencer, "LINGER", 0.3)
    sequencer = Sequencer("linger")
    seen: list[threading.Thread] = []
    for _ in range(3):  # bursts a little apart, as a training step's buckets are
        sequencer.submit(lambda: seen.append(threading.current_thread()), "bucket").wait(WAIT)
        time.sleep(0.02)  # (kept: the behaviour under test) bursts a little apart, the worker parked between
    assert len(set(seen)) == 1, "each burst woke the parked worker instead of starting a thread"
    assert seen[0] is not threading.current_thread()
    wait_until(lambda: not _worker_threads("linger"), WAIT, "the worker outlived LINGER with nothing to do")
    assert sequencer.submit(lambda: 7, "after").wait(WAIT) == 7  # a new worker starts


def test_an_inline_call_hands_queued_work_to_the_parked_worker() -> None:
    sequencer = Sequencer("handoff")
    assert sequencer.submit(lambda: 1, "warm").wait(WAIT) == 1  # the worker is now parked
    later: list[int] = []

    def inline() -> int:
        later.append(0)
        works.append(sequencer.submit(lambda: later.append(2), "queued meanwhile"))
        later.append(1)
        return 9

    works: list[Any] = []
    assert sequencer.call(inline, "inline") == 9
    works[0].wait(WAIT)
    assert later == [0, 1, 2]  # the queued call ran after the inline one, on the worker


def test_a_call_made_by_the_call_the_worker_runs_runs_there_at_once() -> None:
    """As a callback of a torch work's future does (DDP's PowerSGD hook): queued behind the call
    that made it, it would wait for the call that waits for it."""
    sequencer = Sequencer("reentrant")
    ran: list[str] = []
    gate = threading.Event()

    def callback() -> None:
        ran.append("callback")
        inner = sequencer.submit(lambda: ran.append("submitted by it"), "submitted by it")
        assert inner.is_completed()
        assert sequencer.call(lambda: 7, "called by it") == 7
        ran.append("callback done")

    first = sequencer.submit(lambda: (gate.wait(WAIT), callback()), "first")
    later = sequencer.submit(lambda: ran.append("queued after it"), "queued after it")
    gate.set()
    first.wait(WAIT)
    later.wait(WAIT)
    assert ran == ["callback", "submitted by it", "callback done", "queued after it"]


def _in_a_forked_child(check: Callable[[], bool]) -> bool:
    """Whether ``check()`` came true in a child forked now (False if it raised)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            ok = check()
        except BaseException:
            ok = False
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as pipe:
            return pipe.read(1) == b"1"
    finally:
        os.waitpid(pid, 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX-only")
def test_a_forked_child_starts_its_own_worker_instead_of_waking_the_parents() -> None:
    sequencer = Sequencer("fork")
    assert sequencer.submit(lambda: 1, "warm").wait(WAIT) == 1  # the parent's worker is now parked
    # the child: the parked worker did not come along
    ran = _in_a_forked_child(lambda: sequencer.submit(lambda: 2, "in the child").wait(5) == 2)
    assert ran, "the child's call never ran"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX-only")
def test_a_child_forked_while_the_parent_runs_a_call_runs_its_own() -> None:
    """The parent's call holds its turn as the child is forked: the child has no such call."""
    sequencer = Sequencer("fork-busy")
    gate, started = threading.Event(), threading.Event()
    running = sequencer.submit(lambda: (started.set(), gate.wait(WAIT)), "running")
    assert started.wait(WAIT)
    try:
        ran = _in_a_forked_child(
            lambda: (
                sequencer.submit(lambda: 2, "in the child").wait(5) == 2
                and sequencer.call(lambda: 3, "called in the child") == 3
            )
        )
    finally:
        gate.set()
        running.wait(WAIT)
    assert ran, "the child's calls never ran"
