"""Point-to-point messages between the processes of one host through shared memory.

Over loopback TCP a small message costs two trips through ZeroMQ's I/O threads and the kernel
(about 100 us each way from Python); here it costs a copy into shared memory and, when the
receiver is waiting, nothing else: it sees the message while it spins. Every process that may
send has a *p2p segment* in /dev/shm (a transport.shm_segment Segment) holding, per destination
process, a single-producer single-consumer byte queue it alone writes; the destination maps it
read-only and reads it. A segment's header page holds::

    waiting   int64: this process blocks in a receive and wants a bell (written by it)
    queues    QUEUES int64: the destination node (+1) each queue of this segment was given to
    readers   QUEUES int64: the source node (+1) each counter below was given to
    consumed  QUEUES int64: the bytes of that source's queue for this process read so far

and then QUEUES queues, each a ``head`` (int64: the bytes written so far) and QUEUE_BYTES of
records. A record is its length (int64, a multiple of 8, WRAP to go on at the queue's start),
its header's and its payload's lengths (int64 each), the header, then the payload. The producer
writes a record, then raises ``head``; the consumer reads records up to ``head``, then raises its
``consumed`` counter in its own segment, which the producer reads to know the free space. No word
has two writers.

A message that does not fit (over MESSAGE_BYTES, or the queue full because the receiver has not
read) is refused here (``post`` returns False) and travels over TCP instead; the caller orders
the two paths (collective.node.messages numbers each pair's messages). Relies on x86-64 store
ordering, as transport.shm_ring does: a reader that sees ``head`` sees the record before it (so
it is used on x86-64 only: ORDERED_STORES). A malformed record (a queue written by something else)
is a WireError, and the queue is read no more.
"""

from __future__ import annotations

import os
import platform
import struct
import threading
from typing import Any

import numpy as np

from collective.transport.shm_segment import HEADER, Segment
from collective.transport.wire import WireError

__all__ = ["MESSAGE_BYTES", "ORDERED_STORES", "QUEUES", "QUEUE_BYTES", "P2PSegment", "Queues"]

ORDERED_STORES = platform.machine() in ("x86_64", "AMD64")  # (elsewhere: messages travel over TCP)

QUEUES = 8  # destination processes of this host a process sends to through shared memory
QUEUE_BYTES = 2 << 20
MESSAGE_BYTES = 1 << 20  # the largest payload sent this way (larger ones: TCP, bandwidth-bound)
WRAP = -1  # a record length: the queue goes on at its start
_PAGE = 4096
_WAITING = HEADER
_KEYS = 64  # the queues' destinations
_READERS = _KEYS + 8 * QUEUES  # the counters' sources
_CONSUMED = _READERS + 8 * QUEUES
_QUEUE = 64 + QUEUE_BYTES  # a queue: its head (in a 64-byte line of its own), then its bytes
_RECORD = struct.Struct("<qqq")  # length, header length, payload length


class P2PSegment(Segment):
    """A process's p2p queues: its own (``create``, writable) or another's (``attach``, read-only)."""

    MAGIC = b"COLP2P01"
    SIZE = _PAGE + QUEUES * _QUEUE
    KIND = "p2p"

    def __init__(self, path: str, memory: Any, owner: bool) -> None:
        super().__init__(path, memory, owner)
        words = np.frombuffer(memory, np.int64, _PAGE // 8)
        self.waiting = words[_WAITING // 8 : _WAITING // 8 + 1]
        self.keys = words[_KEYS // 8 : _KEYS // 8 + QUEUES]
        self.readers = words[_READERS // 8 : _READERS // 8 + QUEUES]
        self.consumed = words[_CONSUMED // 8 : _CONSUMED // 8 + QUEUES]
        self.heads = [np.frombuffer(memory, np.int64, 1, _PAGE + i * _QUEUE) for i in range(QUEUES)]
        self.data = [
            np.frombuffer(memory, np.uint8, QUEUE_BYTES, _PAGE + i * _QUEUE + 64) for i in range(QUEUES)
        ]

    @staticmethod
    def _index(keys: np.ndarray, node: int, assign: bool) -> int | None:
        """The entry of ``keys`` for ``node``; with ``assign``, the first free one is given to it."""
        for index in range(QUEUES):
            if keys[index] == node + 1:
                return index
        if assign:
            for index in range(QUEUES):
                if keys[index] == 0:
                    keys[index] = node + 1
                    return index
        return None


class Queues:
    """This process's ends of the host's p2p queues: ``post`` to a destination node, ``take`` from a
    source node. ``segments`` maps each node of this host to its segment's name (from the job's
    topology); the others' segments are attached at once (None where one cannot be: then TCP)."""

    def __init__(self, mine: P2PSegment, node: int, segments: dict[int, str]) -> None:
        self.mine = mine
        self.node = node
        self._names = {other: name for other, name in segments.items() if other != node}
        self._theirs: dict[int, P2PSegment | None] = {}
        self._lock = threading.Lock()  # (attaching)
        self._reading = threading.Lock()  # (each queue has one reader)
        self._broken: set[int] = set()  # sources whose queue held a malformed record
        self._watched: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # source -> (its queue's
        # bytes, its head, our counter of what we read of it)
        self._routes: dict[int, tuple[int, np.ndarray]] = {}  # destination -> (our queue, its consumed)
        for other in sorted(self._names):  # attached now, while their processes surely run: what one
            if self._segment(other) is not None:  # posts before it exits is still read after; then a
                P2PSegment._index(mine.readers, other, assign=True)  # counter: it may post here

    def _segment(self, node: int) -> P2PSegment | None:
        with self._lock:
            if node not in self._theirs:
                name = self._names.get(node)
                try:
                    self._theirs[node] = P2PSegment.attach(name) if name else None
                except (OSError, ValueError):
                    self._theirs[node] = None  # (its messages travel over TCP)
            return self._theirs[node]

    def post(self, node: int, header: bytes, payload: np.ndarray) -> bool:
        """Write one message for ``node`` (callers serialise their posts); False if it does not fit
        now (too large, the queue full, no queue left, no segment): send it another way."""
        nbytes = payload.nbytes
        route = self._routes.get(node) or self._route(node)
        if route is None or nbytes > MESSAGE_BYTES or os.getpid() != self.mine.pid:  # (a forked child)
            return False
        queue, consumed_word = route
        consumed = int(consumed_word[0])
        head = int(self.mine.heads[queue][0])
        length = _RECORD.size + len(header) + nbytes
        length += -length % 8
        at = head % QUEUE_BYTES
        skip = QUEUE_BYTES - at if at + length > QUEUE_BYTES else 0
        if head + skip + length - consumed > QUEUE_BYTES:
            return False  # full: the receiver has not read enough yet
        data = self.mine.data[queue]
        if skip:
            data[at : at + 8].view(np.int64)[0] = WRAP
            at = 0
        _RECORD.pack_into(data.data, at, length, len(header), nbytes)
        start = at + _RECORD.size
        data[start : start + len(header)] = np.frombuffer(header, np.uint8)
        start += len(header)
        data[start : start + nbytes] = payload.reshape(-1).view(np.uint8)
        self.mine.heads[queue][0] = head + skip + length  # last: the record is complete
        return True

    def _route(self, node: int) -> tuple[int, np.ndarray] | None:
        """(our queue for ``node``, its counter of what it read of it), found once ``node`` keeps a
        counter for us (it joined; not too many processes): None until then."""
        theirs = self._segment(node)
        counter = P2PSegment._index(theirs.readers, self.node, assign=False) if theirs is not None else None
        if theirs is None or counter is None:
            return None  # it reads no queue of ours (yet)
        queue = P2PSegment._index(self.mine.keys, node, assign=True)
        if queue is None:
            return None
        self._routes[node] = (queue, theirs.consumed[counter : counter + 1])
        return self._routes[node]

    def wants_bell(self, node: int) -> bool:
        """Whether ``node`` blocks in a receive (so a message posted for it needs a bell over TCP)."""
        theirs = self._theirs.get(node)
        return theirs is not None and bool(theirs.waiting[0])

    def posted(self) -> list[int]:
        """The sources that posted something not yet taken (a look at two words each, no lock: what
        a waiting receiver spins on)."""
        found = []
        for node, (_, head, consumed) in list(self._watched.items()):  # (other threads may add to it)
            if head[0] != consumed[0]:
                found.append(node)
        if len(self._watched) < len(self._names):  # (a source's queue is found once it posted)
            found += [node for node in self._names if node not in self._watched and self._watch(node)]
        return found

    def _watch(self, node: int) -> bool:
        """Start watching ``node``'s queue for this process, if it has one yet (found once: the
        queue and our counter of it never move)."""
        theirs = self._segment(node) if node in self._names and node not in self._broken else None
        queue = P2PSegment._index(theirs.keys, self.node, assign=False) if theirs is not None else None
        counter = P2PSegment._index(self.mine.readers, node, assign=False)
        if theirs is None or queue is None or counter is None:
            return False  # (no counter: more sources than counters, so its sender posts nothing)
        self._watched[node] = (
            theirs.data[queue],
            theirs.heads[queue],
            self.mine.consumed[counter : counter + 1],
        )
        return True

    def take(self, node: int) -> list[tuple[bytes, np.ndarray]]:
        """Every message ``node`` posted for this process since the last take: (header, payload copy)."""
        if node not in self._watched and not self._watch(node):
            return []
        with self._reading:
            watched = self._watched.get(node)
            if watched is None:  # (its queue was found malformed meanwhile)
                return []
            data, head_word, consumed_word = watched
            head, consumed = int(head_word[0]), int(consumed_word[0])
            taken: list[tuple[bytes, np.ndarray]] = []
            while consumed < head:
                at = consumed % QUEUE_BYTES
                length = int(data[at : at + 8].view(np.int64)[0])
                if length == WRAP:
                    consumed += QUEUE_BYTES - at
                    continue
                length, header_length, nbytes = _RECORD.unpack_from(data.data, at)
                if not (
                    header_length >= 0
                    and nbytes >= 0
                    and _RECORD.size + header_length + nbytes <= length
                    and length % 8 == 0
                    and at + length <= QUEUE_BYTES
                    and consumed + length <= head
                ):
                    self._broken.add(node)
                    self._watched.pop(node, None)
                    raise WireError(
                        f"node {node}'s shared-memory queue holds a malformed record: read no more"
                    )
                start = at + _RECORD.size + header_length
                header = bytes(data[start - header_length : start])
                payload = data[start : start + nbytes].copy()
                taken.append((header, payload))
                consumed += length
            consumed_word[0] = consumed
            return taken

    def sources(self) -> list[int]:
        """The other nodes of this host that may post to this process."""
        return list(self._names)

    def close(self) -> None:
        with self._lock:
            for segment in self._theirs.values():
                if segment is not None:
                    segment.close()
            self._theirs.clear()
            self._watched.clear()
            self._routes.clear()
