"""The in-process Link: peers are threads of one process and messages are array references.

One ``Exchange`` holds the mailboxes of one collective: ``inbox[dst][src]`` is a FIFO of
messages. Sending appends a reference (no copy) and wakes the receiver; the receiver reads the
sender's memory directly, reducing or copying straight into its own buffer, so a message
costs one pass over the data. Small messages (up to ``COPY_BELOW`` bytes) are copied at send
time instead, so the sender never has to wait for them in ``flush``.

A lent buffer is counted until its receiver has consumed it; ``flush`` waits for that count to
drop to zero. Any failure (a timeout, an error in one peer, ``reset``) aborts the exchange:
every peer blocked in it wakes and raises the same error.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np

from collective.algorithms.ops import Array, ReduceOp, combine, copy_into
from collective.errors import CollectiveError, CollectiveTimeout

__all__ = [
    "COPY_BELOW",
    "Doorbell",
    "Exchange",
    "InProcessLink",
    "claim_armed",
    "clone_error",
    "ring_claimed",
]

COPY_BELOW = 64 * 1024

_T = TypeVar("_T")


def clone_error(error: CollectiveError) -> CollectiveError:
    """A fresh instance of ``error`` for one more thread to raise (tracebacks are per instance)."""
    twin = error.__class__.__new__(error.__class__)
    twin.__dict__.update(error.__dict__)
    twin.args = error.args
    return twin


class Doorbell:
    """Wakes one waiting thread without making it queue for a shared lock on the way out.

    Protocol, with one shared lock guarding the waited-for state:

    * waiter, holding the lock: check the state, then ``arm()``; release the lock; ``wait()``.
    * waker, holding the lock: change the state; ``claim()`` returns True if the waiter is armed;
      after releasing the lock, ``ring()`` the claimed bells.

    Ringing outside the lock matters: a woken thread that finds the lock still held by its waker
    sleeps again at once (a convoy), which with several peers per collective doubled latency.
    """

    def __init__(self) -> None:
        self._bell = threading.Lock()
        self._bell.acquire()
        self._armed = False

    def arm(self) -> None:
        self._armed = True

    def claim(self) -> bool:
        if self._armed:
            self._armed = False
            return True
        return False

    def ring(self) -> None:
        self._bell.release()

    def wait(self, timeout: float, shared_lock: threading.Lock) -> None:
        """Sleep until rung or ``timeout`` seconds passed; leaves the bell ready for the next arm."""
        if self._bell.acquire(timeout=max(0.0, timeout)):
            return
        with shared_lock:
            claimed = not self._armed
            self._armed = False
        if claimed:  # a waker claimed us just as the wait timed out: take its ring back
            self._bell.acquire()


def claim_armed(bells: Iterable[Doorbell]) -> list[Doorbell]:
    """Claim every armed bell of ``bells`` (shared lock held); ring them with ``ring_claimed``."""
    claimed = [bell for bell in bells if bell._armed]  # (one frame for all: this runs every step)
    for bell in claimed:
        bell._armed = False
    return claimed


def ring_claimed(bells: list[Doorbell]) -> None:
    """Ring the bells claimed under the shared lock (call after releasing it)."""
    for bell in bells:
        bell._bell.release()


class Exchange:
    """The mailboxes of one collective among ``len(peer_ids)`` threads; index i is peer ``peer_ids[i]``."""

    def __init__(self, peer_ids: tuple[int, ...], label: str) -> None:
        self.peer_ids = peer_ids
        self.label = label
        size = len(peer_ids)
        self._lock = threading.Lock()
        self._bells = [Doorbell() for _ in range(size)]
        self._inbox: list[list[deque[tuple[Array, bool]]]] = [
            [deque() for _ in range(size)] for _ in range(size)
        ]
        self._lent = [0] * size
        self._error: CollectiveError | None = None
        self._announcement: Any = None
        self._at_barrier = 0

    @property
    def size(self) -> int:
        return len(self.peer_ids)

    @property
    def waiting(self) -> tuple[int, ...]:
        """The indices of the peers asleep in this exchange now (waiting for a message, the barrier,
        an announcement or their receivers), for tests and diagnostics."""
        with self._lock:
            return tuple(index for index, bell in enumerate(self._bells) if bell._armed)

    def barrier(self, index: int, deadline: float) -> None:
        """Wait until every peer of this collective has called ``barrier`` (once per collective)."""
        with self._lock:
            self._at_barrier += 1
            claimed = claim_armed(self._bells) if self._at_barrier == self.size else []
        ring_claimed(claimed)
        self._wait_for(
            index,
            deadline,
            lambda: True if self._at_barrier >= self.size else None,
            "the other peers' part",
            (),
        )

    def announce(self, value: Any) -> None:
        """Publish ``value`` (not None) to every peer of this collective (see ``announcement``)."""
        with self._lock:
            self._announcement = value
            claimed = claim_armed(self._bells)
        ring_claimed(claimed)

    def announcement(self, index: int, deadline: float, waiting_for: str) -> Any:
        """Wait for ``announce`` (e.g. a leader publishing what the other nodes agreed on)."""
        return self._wait_for(index, deadline, lambda: self._announcement, waiting_for, ())

    def abort(self, error: CollectiveError) -> None:
        """Fail the collective for every peer; the first error wins."""
        with self._lock:
            claimed = self._abort_locked(error)
        ring_claimed(claimed)

    def _abort_locked(self, error: CollectiveError) -> list[Doorbell]:
        if self._error is not None:
            return []
        self._error = error
        return claim_armed(self._bells)

    def _wait_for(
        self,
        index: int,
        deadline: float,
        ready: Callable[[], _T | None],
        waiting_for: str,
        missing: tuple[int, ...],
    ) -> _T:
        """Sleep until ``ready()`` (called with the lock held) returns a value; raise on abort or timeout."""
        bell = self._bells[index]
        while True:
            claimed: list[Doorbell] = []
            with self._lock:
                value = ready()
                if value is not None:
                    return value
                error = self._error
                remaining = deadline - time.monotonic()
                if error is None and remaining <= 0:
                    me = self.peer_ids[index]
                    error = CollectiveTimeout(
                        f"{self.label}: peer {me} timed out waiting for {waiting_for}", missing
                    )
                    claimed = self._abort_locked(error)
                if error is None:
                    bell.arm()
            if error is not None:
                ring_claimed(claimed)
                raise clone_error(error)
            bell.wait(remaining, self._lock)

    def post(self, src: int, dst: int, data: Array) -> None:
        lent = data.nbytes > COPY_BELOW
        message = data if lent else data.copy()
        with self._lock:
            if self._error is not None:
                raise clone_error(self._error)
            if lent:
                self._lent[src] += 1
            self._inbox[dst][src].append((message, lent))
            claimed = self._bells[dst].claim()
        if claimed:
            self._bells[dst].ring()

    def take(self, src: int, dst: int, deadline: float) -> tuple[Array, bool]:
        box = self._inbox[dst][src]
        peer = self.peer_ids[src]
        return self._wait_for(
            dst, deadline, lambda: box.popleft() if box else None, f"a message from peer {peer}", (peer,)
        )

    def consumed(self, src: int) -> None:
        """The receiver is done with a lent buffer of ``src``."""
        with self._lock:
            self._lent[src] -= 1
            claimed = self._lent[src] == 0 and self._bells[src].claim()
        if claimed:
            self._bells[src].ring()

    def flush(self, index: int, deadline: float) -> None:
        self._wait_for(
            index,
            deadline,
            lambda: True if self._lent[index] == 0 else None,
            "its receivers to read its data",
            (),
        )


class InProcessLink:
    """Peer ``rank``'s end of an Exchange; every wait ends by ``deadline`` (time.monotonic())."""

    def __init__(self, exchange: Exchange, rank: int, deadline: float) -> None:
        self._exchange = exchange
        self._rank = rank
        self._deadline = deadline

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._exchange.size

    def send(self, dst: int, data: Array) -> None:
        self._exchange.post(self._rank, dst, data)

    def recv_into(self, src: int, out: Array) -> None:
        message, lent = self._exchange.take(src, self._rank, self._deadline)
        try:
            copy_into(out, on_device_of(out, message))
        finally:
            if lent:
                self._exchange.consumed(src)

    def recv_reduce(self, src: int, operand: Array, out: Array, op: ReduceOp) -> None:
        message, lent = self._exchange.take(src, self._rank, self._deadline)
        try:
            combine(op, on_device_of(out, message), operand, out)
        finally:
            if lent:
                self._exchange.consumed(src)

    def flush(self) -> None:
        self._exchange.flush(self._rank, self._deadline)


def on_device_of(target: Array, array: Array) -> Any:
    """``array`` itself where ``target``'s kernels can read it, else a copy on ``target``'s device.

    Peers of one process may sit on different devices (CPU, or CUDA devices through CuPy).
    """
    if isinstance(target, np.ndarray):
        return array if isinstance(array, np.ndarray) else array.get()
    import cupy

    with target.device:
        if isinstance(array, np.ndarray) or array.device != target.device:
            return cupy.asarray(array if isinstance(array, np.ndarray) else array.get())
        return array
