"""This node's point-to-point messages to and from the other nodes, delivered in the order sent.

A message to a process of this host goes through shared memory when it fits that process's queue
(transport.shm_p2p: a receiver that waits sees it while it spins, without ZeroMQ's threads or the
kernel between); any other goes over TCP, in parts of PART_BYTES. The two paths can overtake each
other, so every message carries its number among those from this node to that one, and the
receiving side hands them to the mailbox in that order: one that comes ahead of its turn waits
for the ones before it. (One that comes over TCP first drains the shared memory, where the
messages sent before it already are.) A receiver that blocks says so in its segment, and a
sender that finds it so rings it with a small TCP message (BELL_TAG) after posting.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from collective.errors import CollectiveError
from collective.node.protocol import BELL_TAG, PART_BYTES, SKIP_TAG, P2PMessage
from collective.transport.network import NodeNetwork
from collective.transport.outbox import Outbox
from collective.transport.shm_p2p import ORDERED_STORES, P2PSegment, Queues
from collective.transport.wire import WireError, decode_header, encode_header

__all__ = ["Messages"]

log = logging.getLogger(__name__)

Deliver = Callable[[int, P2PMessage, Any], None]

SPIN_SECONDS = 200e-6  # a receiver looks at shared memory this long before it blocks (a CPU each)
CROWDED_SPIN_SECONDS = 10e-6  # (more of the host's processes than CPUs: the sender needs this CPU)


class Messages:
    """Sends numbered per destination node; delivers each source node's messages in their order."""

    def __init__(
        self,
        outbox: Outbox,
        network: NodeNetwork,
        deliver: Deliver,
        segment: P2PSegment | None,
        abandon: Deliver = lambda node, message, chunk: None,
    ) -> None:
        self._outbox = outbox
        self._network = network
        self._deliver = deliver  # (node, message, payload): one message, in its turn
        self._abandon = abandon  # (node, SKIP message, b""): the parts of a message never to be whole
        self._segment = segment
        self._queues: Queues | None = None
        self._sending = threading.Lock()  # (a number and its post, or its parts, go together)
        self._next: dict[int, int] = {}  # destination node -> the number of its next message
        self._ids = 0  # tells apart the messages this process sends in parts
        self._ordering = threading.RLock()
        self._expected: dict[int, int] = {}  # source node -> the number of the message it delivers next
        self._held: dict[int, dict[int, list[tuple[P2PMessage, Any]]]] = {}  # node -> number -> parts
        self._waiting = threading.Lock()
        self._spin = SPIN_SECONDS

    def connect(self, segments: dict[int, str], processes_here: int) -> None:
        """This host's nodes and their p2p segments' names: their queues attached now (while their
        processes surely run), so what one posts before it exits is still read after."""
        if self._segment is not None and ORDERED_STORES:
            self._queues = Queues(self._segment, self._network.index, segments)
            if self._queues.sources():
                self._network.on_idle(self._take_all)  # (what nobody receives yet: into the mailbox)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._spin = CROWDED_SPIN_SECONDS if processes_here > cpus else SPIN_SECONDS

    # -- sending ------------------------------------------------------------------------------------

    def send(self, node: int, message: P2PMessage, data: np.ndarray, tcp: bool = False) -> None:
        """Send ``message`` with ``data`` (numpy; the caller no longer touches it) to ``node``; over
        TCP (``tcp``) for what every node must see though none of its peers receives (a finish
        notice: the network's background drain delivers it, shared memory waits for a receiver)."""
        payload = data.reshape(-1).view(np.uint8)
        fields = (message.sender, message.receiver, message.tag, message.shape, message.dtype)
        with self._sending:
            order = self._next.get(node, 0)
            queues = None if tcp else self._queues
            if queues is not None and queues.post(
                node, self._header(P2PMessage(*fields, order=order)), payload
            ):
                self._next[node] = order + 1
                if queues.wants_bell(node):
                    bell = P2PMessage(message.sender, message.receiver, BELL_TAG, (0,), "uint8")
                    with contextlib.suppress(CollectiveError):  # (it is posted: a receiver finds it)
                        self._network.send(node, bell.encode(), np.empty(0, np.uint8))
                return
            parts = max(1, -(-payload.nbytes // PART_BYTES))
            ident, self._ids = self._ids, self._ids + 1
            for part in range(parts):
                header = P2PMessage(*fields, ident, part, parts, order).encode()
                try:
                    self._outbox.send(node, header, payload[part * PART_BYTES : (part + 1) * PART_BYTES])
                except BaseException:
                    if part:  # its number is spent: the receiver skips it, and the parts it has
                        skip = P2PMessage(
                            message.sender, message.receiver, SKIP_TAG, (0,), "uint8", ident, 0, 1, order
                        )
                        with contextlib.suppress(BaseException):
                            self._network.send(node, skip.encode(), np.empty(0, np.uint8))
                        self._next[node] = order + 1
                    raise
            self._next[node] = order + 1

    def _header(self, message: P2PMessage) -> bytes:
        return encode_header({**message.encode(), "job": self._network.job, "src": self._network.index})

    # -- receiving ----------------------------------------------------------------------------------

    def arrived(self, node: int, message: P2PMessage, chunk: Any) -> None:
        """A message (or part of one) from ``node`` over TCP, checked: delivered in its turn."""
        if message.tag == BELL_TAG:
            self._take(node)
            return
        self._in_turn(node, message, chunk)

    def _in_turn(self, node: int, message: P2PMessage, chunk: Any) -> None:
        with self._ordering:
            expected = self._expected.get(node, 0)
            if message.order < 0:  # (unnumbered)
                self._hand(node, message, chunk)
                return
            if message.order > expected:
                self._take(node)  # the ones before it, if they went through shared memory
                expected = self._expected.get(node, 0)
            if message.order != expected:
                if message.order > expected:  # (an earlier one is still on its way)
                    self._held.setdefault(node, {}).setdefault(message.order, []).append((message, chunk))
                else:
                    log.warning("dropped message %d from node %d: delivered before", message.order, node)
                return
            self._hand(node, message, chunk)
            if message.part + 1 < message.parts:
                return  # (its next parts follow on the same connection)
            expected += 1
            held = self._held.get(node, {})
            while expected in held:
                parts = held.pop(expected)
                for waiting, waiting_chunk in parts:
                    self._hand(node, waiting, waiting_chunk)
                last = parts[-1][0]
                if last.part + 1 < last.parts:  # its remaining parts come later, in their turn
                    self._expected[node] = expected
                    return
                expected += 1
            self._expected[node] = expected

    def _hand(self, node: int, message: P2PMessage, chunk: Any) -> None:
        """One message (or part) in its turn: to the mailbox; a skip drops what came of its message."""
        try:
            if message.tag == SKIP_TAG:  # (its sender failed in the middle of it)
                self._abandon(node, message, b"")
                return
            self._deliver(node, message, chunk)
        except WireError as exc:
            log.warning("refused a point-to-point message from node %d: %s", node, exc)

    def _take(self, node: int) -> bool:
        """Deliver what ``node`` posted for this process in shared memory; whether there was any."""
        queues = self._queues
        if queues is None:
            return False
        try:
            taken = queues.take(node)
        except WireError as exc:
            log.warning("refused node %d's shared-memory messages: %s", node, exc)
            return False
        for header, payload in taken:
            try:
                fields = decode_header(header)
                if fields["job"] != self._network.job or fields["src"] != node or fields["t"] != "p2p":
                    raise WireError(f"a message of job {fields['job']!r}, node {fields['src']}")
                message = P2PMessage.decode(fields)
            except WireError as exc:
                log.warning("refused a shared-memory message from node %d: %s", node, exc)
                continue
            self._in_turn(node, message, payload)
        return bool(taken)

    def _take_all(self) -> bool:
        queues = self._queues
        if queues is None:
            return False
        found = False
        for node in queues.posted():
            found = self._take(node) or found
        return found

    def pump(self, seconds: float) -> None:
        """Let messages arrive for up to ``seconds`` (a receive waiting): from shared memory, looked
        at while spinning and then between waits, and over TCP."""
        if self._queues is None or not self._queues.sources():
            self._network.pump(seconds)
            return
        if self._take_all():
            return
        stop = time.monotonic() + min(seconds, self._spin)
        while time.monotonic() < stop:
            os.sched_yield()
            if self._take_all():
                return
        mine = self._queues.mine
        with self._waiting:
            mine.waiting[0] += 1  # (a sender that sees it rings: the TCP wait below ends)
        try:
            if not self._take_all():
                self._network.pump(seconds)
        finally:
            with self._waiting:
                mine.waiting[0] -= 1
        self._take_all()

    def close(self) -> None:
        if self._queues is not None:
            self._queues.close()
        if self._segment is not None:
            self._segment.close()
