"""Persistent sends and receives: a point-to-point message made once, then sent and received by each use.

```python
s = col.send_init(0, x, dst=1, tag=7)            # peer 0: each use sends x's contents then
r = col.recv_init(1, src=0, tag=7, out=buf)      # peer 1: each use receives into buf
for step in range(n):
    x[:] = ...; s()                              # (a send never waits)
    r()                                          # or r.start(); ...; r.wait()
s.free(); r.free()                               # (or: with col.send_init(...) as s:)
```

MPI's ``MPI_Send_init`` / ``MPI_Recv_init``: the peer, the tag and the array are checked once
(``p2p.send_checked``, ``p2p.recv_checked``), and each use does only what a message needs: a
send copies ``x``'s contents into the destination's mailbox (here, or through its process), a
receive takes the next message from ``src`` with ``tag`` into the same buffer (``out``; without
one, the array the first use received). A use checks what can change between uses: the buffer is
still the shape and dtype it was (a torch tensor still its memory), else InvalidArgumentError. A
pair needs no agreement (a send and a receive never agree in this API: a message that does not fit
the receive's buffer stays queued, InvalidArgumentError at the receiver), so a handle is one
peer's alone and ``free`` is local. Every failure of a normal send and receive holds for a use:
a receive times out naming the source (``wait(timeout)`` shorter than the use's own: the use goes
on, wait again), and fails with PeerLostError when the source left. Each use is recorded in the
flight recorder as a send or a receive.
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Any

from collective import p2p
from collective.arrays import Device, timeout_seconds
from collective.errors import InvalidArgumentError
from collective.persistent.handle import _Watched
from collective.trace import RECORDER, caller

if TYPE_CHECKING:
    from collective.job import LocalJob
    from collective.p2p import Mailbox

__all__ = ["PersistentRecv", "PersistentSend"]


class _PointHandle:
    """What a persistent send and receive share: uses one at a time, ``start``/``wait``, ``free``."""

    kind = ""

    def __init__(self, peer: int, job: LocalJob, mailbox: Mailbox, device: Device, seconds: float) -> None:
        self.peer = peer
        self._job, self._mailbox, self._device = job, mailbox, device
        self._seconds = seconds  # each use's timeout, unless it names its own
        self._watched: list[_Watched] = []
        self._deadline: float | None = None  # of the use started (None: none is)
        self._use_seconds = seconds  # (its timeout)
        self._freed = False

    def __call__(self, timeout: float | None = None) -> Any:
        """One use: its result (a receive's buffer; None for a send), or its error."""
        self._start(timeout, caller(2) if RECORDER.enabled else None)
        return self.wait()

    def start(self, timeout: float | None = None) -> None:
        """Start a use (a send is made now: sends never wait); ``wait()`` ends it. One at a time."""
        self._start(timeout, caller(2) if RECORDER.enabled else None)

    def wait(self, timeout: float | None = None) -> Any:
        """The started use's result; CollectiveTimeout after ``timeout`` seconds of waiting when
        that comes before the use's own timeout (the use goes on: wait again)."""
        if self._deadline is None:
            raise InvalidArgumentError(
                f"wait() on a persistent {self.kind} with no use started: call start()"
            )
        if timeout is not None:
            timeout = timeout_seconds(timeout)
        return self._end(timeout)

    def free(self) -> None:
        """End it (this peer's alone: nobody else holds it); a second free does nothing."""
        if self._deadline is not None and not self._freed:
            raise InvalidArgumentError(
                f"free() on a persistent {self.kind} whose use is running: wait() first"
            )
        self._freed = True

    def __enter__(self) -> _PointHandle:
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        self._deadline = None  # (leaving the block ends a use left running)
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self._freed else ("running" if self._deadline is not None else "ready")
        return f"<{type(self).__name__} of peer {self.peer} {state}>"

    def _start(self, timeout: float | None, frame: Any) -> None:
        if self._freed:
            raise InvalidArgumentError(f"this persistent {self.kind} was freed: make another")
        if self._deadline is not None:
            raise InvalidArgumentError(f"a use of this persistent {self.kind} is running: wait() first")
        seconds = self._seconds if timeout is None else timeout_seconds(timeout)
        for watched in self._watched:
            change = watched.change()
            if change is not None:
                raise InvalidArgumentError(
                    f"{self.kind}: peer {self.peer}: a buffer of this persistent {self.kind} changed since "
                    f"it was made: {change}; make a new one for the new buffer"
                )
        self._begin(frame)
        self._deadline, self._use_seconds = time.monotonic() + seconds, seconds

    def _begin(self, frame: Any) -> None:
        """What a use does as it starts."""

    def _end(self, timeout: float | None) -> Any:
        """What a use does as it is waited for (``timeout``: the wait's own bound, or None)."""
        raise NotImplementedError


class PersistentSend(_PointHandle):
    """One peer's persistent send (``Runtime.send_init``): each use sends ``x``'s contents then."""

    kind = "send"

    def __init__(
        self,
        peer: int,
        job: LocalJob,
        mailbox: Mailbox,
        device: Device,
        seconds: float,
        x: Any,
        dst: Any,
        tag: Any,
    ) -> None:
        super().__init__(peer, job, mailbox, device, seconds)
        self.dst, self.tag, self._array = p2p.send_checked(job, peer, device, x, dst, tag)
        self._given = x
        self._watched = [_Watched(x)]

    def _begin(self, frame: Any) -> None:
        peer, array, dst, tag = self.peer, self._array, self.dst, self.tag
        sent = partial(p2p.deliver, self._job, self._mailbox, peer, array, dst, tag)
        p2p.traced("send", peer, peer, dst, tag, frame, sent, lambda _: array)

    def _end(self, timeout: float | None) -> None:
        self._deadline = None


class PersistentRecv(_PointHandle):
    """One peer's persistent receive (``Runtime.recv_init``): each use receives the next message
    from ``src`` with ``tag`` into ``out`` (without one: the array the first use received)."""

    kind = "recv"

    def __init__(
        self,
        peer: int,
        job: LocalJob,
        mailbox: Mailbox,
        device: Device,
        seconds: float,
        src: Any,
        tag: Any,
        out: Any,
    ) -> None:
        super().__init__(peer, job, mailbox, device, seconds)
        found, self.tag, self._target = p2p.recv_checked(job, peer, device, src, tag, out)
        assert found is not None  # (a source is named: recv_any has no persistent form)
        self.src = found
        self._out = out
        self._watched = [_Watched(out, written=True)] if out is not None else []
        self._frame: Any = None

    @property
    def out(self) -> Any:
        """Where each use writes its message (None until the first use, where that use makes it)."""
        return self._out

    def _begin(self, frame: Any) -> None:
        self._frame = frame

    def _end(self, timeout: float | None) -> Any:
        assert self._deadline is not None
        deadline, seconds = self._deadline, self._use_seconds
        use_ends = timeout is None or deadline <= time.monotonic() + timeout  # (else the wait's own
        if not use_ends:  # bound comes first: the use goes on, wait again)
            assert timeout is not None
            deadline, seconds = time.monotonic() + timeout, timeout
        job, mailbox, peer, device = self._job, self._mailbox, self.peer, self._device
        src, tag, out, target = self.src, self.tag, self._out, self._target

        def taken() -> tuple[int, Any]:
            return p2p.receive(job, mailbox, peer, device, src, tag, seconds, out, target, deadline)

        try:
            _, got = p2p.traced("recv", peer, src, peer, tag, self._frame, taken, lambda got: got[1])
        except BaseException:
            if use_ends:
                self._deadline = None
            raise
        self._deadline = None
        if self._out is None:  # (the first use's array: every later use writes into it)
            self._out, self._target = got, p2p.recv_checked(job, peer, device, src, tag, got)[2]
            self._watched = [_Watched(got, written=True)]
        return got
