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
receive takes its message from ``src`` with ``tag`` into the same buffer (``out``; without one,
the array the first use received) as it is waited for: receives match messages in the order they
were started (MPI's), whichever is waited for first, and a ``recv`` made after a receive started
takes the message after its. A use checks what can change: the peer still in its job, a numpy
buffer still the shape, strides and dtype it was (a receive's still writable, checked again as
it is waited for); any other buffer (a torch tensor may move, or be a view read as a copy) is
viewed anew at each use. A pair needs no agreement (a message that does not fit the receive's
buffer stays queued, InvalidArgumentError at the receiver), so a handle is one peer's alone and
``free`` is local. Every failure of a normal send and receive holds for a use: a receive times
out naming the source (``wait(timeout)`` shorter than the use's own: the use goes on, wait
again, and the flight recorder counts one receive), and fails with PeerLostError when the source
left. Each use is recorded in the flight recorder as a send or a receive (a receive from its
start).

The handles use the core's messages through ``Messages`` (collective.p2p's ``PeerMessages``), so
they live below it, beside the persistent collectives; ``described`` and ``traced``, how a send
or receive is recorded, are here for the same reason (the core's send and recv use them too).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, TypeVar

import numpy as np

from collective.algorithms.ops import Array
from collective.arrays import timeout_seconds
from collective.calls.signature import Signature
from collective.errors import CollectiveTimeout, InvalidArgumentError
from collective.persistent.handle import Watched
from collective.trace import RECORDER, SIGNATURE, caller

__all__ = ["Messages", "PersistentRecv", "PersistentSend", "described", "traced"]

T = TypeVar("T")


class Messages(Protocol):
    """What a persistent send or receive does with its peer's messages (collective.p2p's, for the
    peer it was made by): each checked as the call made anew would be, but for its arguments."""

    def check(self) -> None:
        """Raise RegistrationError (or JobClosedError) unless the peer is still in its job."""
        ...

    def sent_array(self, x: Any) -> Array:
        """``x`` as the array a send copies (InvalidArgumentError if none)."""
        ...

    def deliver(self, array: Array, dst: int, tag: int) -> None:
        """A copy of ``array`` to ``dst`` with ``tag``."""
        ...

    def out_target(self, out: Any) -> Any:
        """The array a receive writes ``out`` through (InvalidArgumentError if none)."""
        ...

    def post(self, src: int, tag: int, receive: Any) -> None:
        """``receive`` started: it takes its message from ``src`` with ``tag`` in the order started."""
        ...

    def unpost(self, src: int, tag: int, receive: Any) -> None:
        """``receive`` ended without a message: it gives its turn up."""
        ...

    def receive(
        self, src: int, tag: int, seconds: float, out: Any, target: Any, deadline: float, posted: Any
    ) -> Any:
        """The message from ``src`` with ``tag`` of ``posted`` (the receive started: its turn), with
        ``out`` filled, through ``target``, by ``deadline`` (its CollectiveTimeout naming ``seconds``)."""
        ...


class _PointHandle:
    """What a persistent send and receive share: uses one at a time, ``start``/``wait``, ``free``."""

    kind = ""

    def __init__(self, peer: int, messages: Messages, seconds: float) -> None:
        self.peer = peer
        self._messages = messages
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
        self._started()

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
        self._messages.check()

    def _begin(self, frame: Any) -> None:
        """What a use does as it starts."""

    def _started(self) -> None:
        """What a use started apart from its wait does, once started (``start()``)."""

    def _end(self, timeout: float | None) -> Any:
        """What a use does as it is waited for (``timeout``: the wait's own bound, or None)."""
        raise NotImplementedError

    def _ended(self, error: BaseException | None = None) -> None:
        """The use is over (``error``: it failed)."""
        self._deadline = None


def _changed(kind: str, peer: int, watched: Watched | None) -> None:
    """Raise InvalidArgumentError if the buffer ``watched`` changed since it was made."""
    change = watched.change() if watched is not None else None
    if change is not None:
        raise InvalidArgumentError(
            f"{kind}: peer {peer}: a buffer of this persistent {kind} changed since it was made: {change}; "
            f"make a new one for the new buffer"
        )


class PersistentSend(_PointHandle):
    """One peer's persistent send (``Runtime.send_init``): each use sends ``x``'s contents then
    (``array``: x as checked when it was made, its array)."""

    kind = "send"

    def __init__(
        self, peer: int, messages: Messages, seconds: float, x: Any, array: Array, dst: int, tag: int
    ) -> None:
        super().__init__(peer, messages, seconds)
        self.dst, self.tag, self._array, self._given = dst, tag, array, x
        # A numpy array is read through the same array every use (its layout watched); anything
        # else is viewed anew (a torch tensor may move, a conjugate view is read as a copy, ...).
        self._watched = Watched(x) if type(x) is np.ndarray else None

    def _begin(self, frame: Any) -> None:
        peer, dst, tag = self.peer, self.dst, self.tag
        if self._watched is None:
            array = self._array = self._messages.sent_array(self._given)
        else:
            _changed(self.kind, peer, self._watched)
            array = self._array
        sent = partial(self._messages.deliver, array, dst, tag)
        traced("send", peer, peer, dst, tag, frame, sent, lambda _: array)

    def _end(self, timeout: float | None) -> None:
        self._ended()


class PersistentRecv(_PointHandle):
    """One peer's persistent receive (``Runtime.recv_init``): each use receives the next message
    from ``src`` with ``tag`` into ``out`` (without one: the array the first use received)."""

    kind = "recv"

    def __init__(
        self, peer: int, messages: Messages, seconds: float, src: int, tag: int, out: Any, target: Any
    ) -> None:
        super().__init__(peer, messages, seconds)
        self.src, self.tag, self._target = src, tag, target
        self._out = out
        self._watched = Watched(out, written=True) if type(out) is np.ndarray else None
        self._entry: list[Any] | None = None  # the flight recorder's entry of the use started
        self._in_line = False  # (started apart from its wait: its turn posted)

    @property
    def out(self) -> Any:
        """Where each use writes its message (None until the first use, where that use makes it)."""
        return self._out

    def _begin(self, frame: Any) -> None:
        if self._watched is not None:
            _changed(self.kind, self.peer, self._watched)
        if RECORDER.enabled:  # (open from the start: a dump shows a receive started, not yet met)
            self._entry = RECORDER.open_p2p(self.peer, self.src, self.peer, self.tag, "recv", frame)

    def _started(self) -> None:
        """Its turn: receives started match messages in the order started (a use started and
        waited for at once takes the next message, as a recv does: its turn is then)."""
        self._messages.post(self.src, self.tag, self)
        self._in_line = True

    def _end(self, timeout: float | None) -> Any:
        assert self._deadline is not None
        deadline, seconds = self._deadline, self._use_seconds
        bounded = timeout is not None and time.monotonic() + timeout < deadline  # (the wait's own bound
        if bounded:  # comes first: when it passes, the use goes on; wait again)
            assert timeout is not None
            deadline, seconds = time.monotonic() + timeout, timeout
        peer, out, messages = self.peer, self._out, self._messages
        try:
            self._check()  # (again: the buffer may have changed since the use started)
            if self._watched is not None:
                _changed(self.kind, peer, self._watched)
                target = self._target
            else:
                target = messages.out_target(out)  # (anything else is viewed anew)
            posted = self if self._in_line else None
            got = messages.receive(self.src, self.tag, seconds, out, target, deadline, posted)
        except CollectiveTimeout as exc:
            if not bounded:
                self._ended(exc)
            raise
        except BaseException as exc:
            self._ended(exc)
            raise
        self._ended()
        if out is None:  # (the first use's array: every later use writes into it)
            self._out, self._target = got, messages.out_target(got)
            self._watched = Watched(got, written=True) if type(got) is np.ndarray else None
        if self._entry is not None:
            self._entry[SIGNATURE] = described(got)
        return got

    def _ended(self, error: BaseException | None = None) -> None:
        self._deadline = None
        if self._in_line:  # (ended without its message: the next receive takes the one it would have)
            self._in_line = False
            if error is not None:
                self._messages.unpost(self.src, self.tag, self)
        entry, self._entry = self._entry, None
        if entry is not None:
            RECORDER.closed(entry, error)


def described(x: Any) -> Signature | None:
    """A point-to-point array's shape and dtype for the flight recorder (numpy dtypes only)."""
    try:
        return Signature("p2p", shape=tuple(x.shape), dtype=np.dtype(x.dtype))
    except (AttributeError, TypeError):
        return None


def traced(
    kind: str,
    peer: int,
    src: int,
    dst: int,
    tag: int,
    frame: Any,
    run: Callable[[], T],
    shown: Callable[[T], Any],
) -> T:
    """``run()``, a send or receive (``kind``) of ``peer``, in the flight recorder when it is on:
    its entry open from now (``src`` -1: from any peer), ended by the error it raises or with the
    shape and dtype of ``shown(result)``."""
    if not RECORDER.enabled:
        return run()
    entry = RECORDER.open_p2p(peer, src, dst, tag, kind, frame)
    try:
        result = run()
    except BaseException as exc:
        RECORDER.closed(entry, exc)
        raise
    entry[SIGNATURE] = described(shown(result))
    RECORDER.closed(entry)
    return result
