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
one, the array the first use received) as it is waited for. A use checks what can change: the
peer still in its job, a numpy buffer still the shape, strides and dtype it was (a receive's
still writable, checked again as it is waited for); any other buffer (a torch tensor may move,
or be a view read as a copy) is viewed anew at each use. A pair needs no agreement (a message
that does not fit the receive's buffer stays queued, InvalidArgumentError at the receiver), so a
handle is one peer's alone and ``free`` is local. Every failure of a normal send and receive
holds for a use: a receive times out naming the source (``wait(timeout)`` shorter than the use's
own: the use goes on, wait again, and the flight recorder counts one receive), and fails with
PeerLostError when the source left. Each use is recorded in the flight recorder as a send or a
receive (a receive from its start).
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from collective import p2p
from collective.arrays import Device, timeout_seconds
from collective.errors import CollectiveTimeout, InvalidArgumentError
from collective.persistent.handle import _Watched
from collective.trace import RECORDER, SIGNATURE, caller

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
        return self._end(None if timeout is None else timeout_seconds(timeout))

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
        if self._deadline is not None:  # (leaving the block ends a use left running)
            self._ended(InvalidArgumentError(f"a persistent {self.kind} freed with its use running"))
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
        self._check()
        self._begin(frame)
        self._deadline, self._use_seconds = time.monotonic() + seconds, seconds

    def _check(self) -> None:
        """What a use checks: the peer still in its job (as a send or receive checks it), and its
        buffer as it was made."""
        job = self._job
        with job.lock:
            job.check_member(self.peer)

    def _begin(self, frame: Any) -> None:
        """What a use does as it starts."""

    def _end(self, timeout: float | None) -> Any:
        """What a use does as it is waited for (``timeout``: the wait's own bound, or None)."""
        raise NotImplementedError

    def _ended(self, error: BaseException | None = None) -> None:
        """The use is over (``error``: it failed)."""
        self._deadline = None


def _changed(kind: str, peer: int, watched: _Watched | None) -> None:
    """Raise InvalidArgumentError if the buffer ``watched`` changed since it was made."""
    change = watched.change() if watched is not None else None
    if change is not None:
        raise InvalidArgumentError(
            f"{kind}: peer {peer}: a buffer of this persistent {kind} changed since it was made: {change}; "
            f"make a new one for the new buffer"
        )


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
        # A numpy array is read through the same array every use (its layout watched); anything
        # else is viewed anew (a torch tensor may move, a conjugate view is read as a copy, ...).
        self._watched = _Watched(x) if type(x) is np.ndarray else None

    def _begin(self, frame: Any) -> None:
        peer, dst, tag = self.peer, self.dst, self.tag
        if self._watched is None:
            array = self._array = p2p.sent_array(peer, self._device, self._given)
        else:
            _changed(self.kind, peer, self._watched)
            array = self._array
        sent = partial(p2p.deliver, self._job, self._mailbox, peer, array, dst, tag)
        p2p.traced("send", peer, peer, dst, tag, frame, sent, lambda _: array)

    def _end(self, timeout: float | None) -> None:
        self._ended()


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
        if src is None:
            raise InvalidArgumentError(
                f"recv_init: peer {peer}: a persistent receive is from one peer: name src (a receive from "
                f"any peer has no persistent form: call recv_any)"
            )
        found, self.tag, self._target = p2p.recv_checked(job, peer, device, src, tag, out)
        self.src: int = found  # type: ignore[assignment]  # (a peer: src is not None)
        self._out = out
        self._watched = _Watched(out, written=True) if type(out) is np.ndarray else None
        self._entry: list[Any] | None = None  # the flight recorder's entry of the use started

    @property
    def out(self) -> Any:
        """Where each use writes its message (None until the first use, where that use makes it)."""
        return self._out

    def _begin(self, frame: Any) -> None:
        if self._watched is not None:
            _changed(self.kind, self.peer, self._watched)
        if RECORDER.enabled:  # (open from the start: a dump shows a receive started, not yet met)
            self._entry = RECORDER.open_p2p(self.peer, self.src, self.peer, self.tag, "recv", frame)

    def _end(self, timeout: float | None) -> Any:
        assert self._deadline is not None
        deadline, seconds = self._deadline, self._use_seconds
        bounded = timeout is not None and time.monotonic() + timeout < deadline  # (the wait's own bound
        if bounded:  # comes first: when it passes, the use goes on; wait again)
            assert timeout is not None
            deadline, seconds = time.monotonic() + timeout, timeout
        peer, device, out = self.peer, self._device, self._out
        try:
            self._check()  # (again: the buffer may have changed since the use started)
            if self._watched is not None:
                _changed(self.kind, peer, self._watched)
                target = self._target
            else:
                target = p2p.out_target(peer, device, out)  # (anything else is viewed anew)
            _, got = p2p.receive(
                self._job, self._mailbox, peer, device, self.src, self.tag, seconds, out, target, deadline
            )
        except CollectiveTimeout as exc:
            if not bounded:
                self._ended(exc)
            raise
        except BaseException as exc:
            self._ended(exc)
            raise
        self._ended()
        if out is None:  # (the first use's array: every later use writes into it)
            self._out, self._target = got, p2p.out_target(peer, device, got)
            self._watched = _Watched(got, written=True) if type(got) is np.ndarray else None
        if self._entry is not None:
            self._entry[SIGNATURE] = p2p.described(got)
        return got

    def _ended(self, error: BaseException | None = None) -> None:
        self._deadline = None
        entry, self._entry = self._entry, None
        if entry is not None:
            RECORDER.closed(entry, error)
