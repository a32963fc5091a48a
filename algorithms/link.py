"""The Link protocol: how an algorithm moves arrays between the peers of a group.

Every algorithm in this package is a function of (link, array, ...) that calls only these
methods, so the same code runs over in-process threads (transport.inproc), over ZeroMQ
between nodes, and over the recording link of the tests.

Buffer ownership
----------------
``send`` never waits for the receiver: the buffer is *lent* to the link. The sender must not
write to it until either

* ``flush()`` has returned, or
* it has received a message from the destination that the destination sent after receiving
  this one (the destination consumes a message completely before its ``recv_*`` returns).

Algorithms rely on the second rule (a tree node reuses the buffer it sent up once the result
comes down); the tests check every algorithm against it with a link that verifies, when a
message is consumed, that its buffer still holds what was sent.

Messages between one ordered pair of peers arrive in the order they were sent. Every wait is
bounded by the collective's deadline; an implementation raises CollectiveTimeout,
PeerLostError or the error another peer aborted the collective with.

Conformance
-----------
``collective.algorithms.conformance.check_link(make_links)`` checks an implementation against
this contract (order per pair, matching by source, recv_reduce in place, both ownership rules,
empty messages, timeouts, aborts); every transport's tests run it (tests/test_link_conformance.py)
and a new transport runs it from its own.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from collective.algorithms.ops import Array, ReduceOp, array_module, combine, copy_into

__all__ = ["Link", "reduce_received", "send_signal", "wait_signal"]


class Link(Protocol):
    """One peer's end of a group of ``size`` peers; this peer has index ``rank``."""

    @property
    def rank(self) -> int:
        """This peer's index in the group, 0 .. size-1."""
        ...

    @property
    def size(self) -> int:
        """Number of peers in the group."""
        ...

    def send(self, dst: int, data: Array) -> None:
        """Queue the flat array ``data`` for peer ``dst`` and return at once (the buffer is lent)."""
        ...

    def recv_into(self, src: int, out: Array) -> None:
        """Wait for the next message from ``src`` and copy it into ``out`` (same length and dtype)."""
        ...

    def recv_reduce(self, src: int, operand: Array, out: Array, op: ReduceOp) -> None:
        """Wait for the next message from ``src``; ``out = op(message, operand)``.

        ``operand`` may be ``out`` itself (accumulate in place).
        """
        ...

    def flush(self) -> None:
        """Wait until no buffer lent by ``send`` is still needed by a receiver."""
        ...


_SIGNAL = np.empty(0, np.uint8)
_SIGNAL.flags.writeable = False  # lent to every barrier message at once, so it must never change


def send_signal(link: Link, dst: int) -> None:
    """Send an empty message (a barrier's "I am here") to ``dst``."""
    link.send(dst, _SIGNAL)


def wait_signal(link: Link, src: int) -> None:
    """Wait for the next (empty) message from ``src``."""
    link.recv_into(src, np.empty(0, np.uint8))


def reduce_received(link: Link, own: Array, dst: Array, op: ReduceOp) -> None:
    """``dst`` = ``op`` over one message from every other peer and ``own`` (this peer's part), in
    peer order ((x0 op x1) op x2 ...: the same bits as every other path that combines in rank
    order), whatever this peer's rank. ``dst`` may be ``own`` (in place)."""
    if link.rank > 0 and array_module(dst).may_share_memory(dst, own):
        own = own.copy()  # in place: peer 0's message lands in dst before own is combined
    reduced: Array | None = None  # what was combined so far (``own``, or ``dst``)
    for peer in range(link.size):
        if peer == link.rank:
            if reduced is not None:
                combine(op, reduced, own, dst)
            reduced = dst if reduced is not None else own
        elif reduced is None:
            link.recv_into(peer, dst)
            reduced = dst
        else:
            link.recv_reduce(peer, reduced, dst, op)
            reduced = dst
    if reduced is own:  # a group of one
        copy_into(dst, own)
