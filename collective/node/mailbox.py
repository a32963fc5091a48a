"""The messages waiting for this process's peers: a ``Mailbox`` per process (the Runtime's).

Sends of this process's peers put their copies here; messages from other processes' peers come
in through the node (``arrived``, a large one in parts, reassembled here, with at most ``limit``
bytes kept unreceived per source). Receives ``take`` them: by (source, destination, tag) in the
order they came, or from any source the earliest. Receives started before they are waited for
(persistent ones) ``post`` their turn: they take their messages in the order they were started.
collective.p2p's send and recv are the calls over it.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from collective.algorithms.ops import Array
from collective.errors import CollectiveError, CollectiveTimeout, InvalidArgumentError, MismatchError
from collective.node.protocol import PART_BYTES, P2PMessage
from collective.transport.wire import WireError

__all__ = ["DEFAULT_LIMIT", "MESSAGE_COST", "Mailbox"]

Key = tuple[int, int, int]  # (src, dst, tag)
DEFAULT_LIMIT = 1 << 30  # unreceived bytes kept per source process
MESSAGE_COST = 1 << 10  # bytes a message counts beyond its data (what keeping it costs, about)
MAX_DROPPED_KEYS = 1024  # (dst, tag) pairs of dropped messages remembered for any-source receives
PUMP_SLICE = 0.005  # a receive waiting for another process lets its messages in this often


class Mailbox:
    """The messages waiting for this process's peers."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._cv = threading.Condition()
        self._boxes: dict[Key, deque[tuple[Array, bool, int]]] = {}  # (array, from another process, order)
        self._order = itertools.count()  # of arrival: a receive from any source takes the earliest
        self._closed: CollectiveError | None = None
        self._limit = limit
        self._pending: dict[int, int] = {}  # src -> bytes counted from another process, not yet received
        self._cut_off: dict[int, str] = {}  # src -> why its messages are dropped (it passed the limit)
        self._dropped: dict[tuple[int, int], int] = {}  # (dst, tag) of a dropped message -> its src
        self._assembling: dict[tuple[int, int], tuple[np.ndarray, int]] = {}  # (node, id): (bytes, next part)
        # the receives started and not yet matched, by key, in the order started (``post``)
        self._posted: dict[Key, list[weakref.ref[Any]]] = {}

    def put(self, src: int, dst: int, tag: int, data: Array, remote: bool = False) -> None:
        """Keep ``data`` for ``dst``. From another process (``remote``), at most ``limit`` unreceived
        bytes per source are kept (see ``_reserve``)."""
        with self._cv:
            if not remote or self._reserve(src, dst, tag, data.nbytes):
                self._keep(src, dst, tag, data, remote)

    def arrived(self, origin: int, message: P2PMessage, chunk: Any) -> None:
        """A message from another process (``origin``: its node), or part ``message.part`` of one that
        comes in ``message.parts`` parts of PART_BYTES (in order: one connection carries them); a
        message in parts is kept once its last part is in. WireError: the bytes do not fit it."""
        dtype = np.dtype(message.dtype)
        nbytes = math.prod(message.shape) * dtype.itemsize
        if message.parts == 1:  # kept as it came, without a copy
            if len(chunk) != nbytes:
                raise WireError(f"{nbytes} bytes declared, {len(chunk)} sent")
            data = np.frombuffer(chunk, dtype) if nbytes else np.empty(0, dtype)
            self.put(message.sender, message.receiver, message.tag, data.reshape(message.shape), remote=True)
            return
        start = message.part * PART_BYTES
        key = (origin, message.ident)
        with self._cv:
            if message.part == 0:
                self._assembling.pop(key, None)
                if not self._reserve(message.sender, message.receiver, message.tag, nbytes):
                    return  # (its later parts find no assembly and are dropped too)
                self._assembling[key] = (np.empty(nbytes, np.uint8), 0)
            found = self._assembling.get(key)
            if found is None:
                return
            buffer, expected = found
            if message.part != expected or len(chunk) != min(PART_BYTES, nbytes - start) or start >= nbytes:
                del self._assembling[key]
                self._pending[message.sender] -= nbytes + MESSAGE_COST
                raise WireError(f"part {message.part} of {message.parts} ({len(chunk)} bytes) does not fit")
            buffer[start : start + len(chunk)] = np.frombuffer(chunk, np.uint8)
            if message.part + 1 < message.parts:
                self._assembling[key] = (buffer, expected + 1)
                return
            del self._assembling[key]
            self._keep(
                message.sender, message.receiver, message.tag, buffer.view(dtype).reshape(message.shape), True
            )

    def abandon(self, origin: int, message: P2PMessage) -> None:
        """The message ``message.ident`` of node ``origin`` will never be whole (its sender failed
        while sending its parts): what came of it is dropped, and no longer counted."""
        with self._cv:
            found = self._assembling.pop((origin, message.ident), None)
            if found is not None:
                self._pending[message.sender] -= found[0].nbytes + MESSAGE_COST

    def _keep(self, src: int, dst: int, tag: int, data: Array, remote: bool) -> None:
        """Queue ``data`` (its bytes already counted if ``remote``) and wake receivers (lock held)."""
        self._boxes.setdefault((src, dst, tag), deque()).append((data, remote, next(self._order)))
        self._cv.notify_all()

    def _reserve(self, src: int, dst: int, tag: int, nbytes: int) -> bool:
        """Count a message of ``nbytes`` from another process's ``src`` (lock held). A message alone
        is kept, whatever its size. One that would pass the limit while others of ``src`` wait is
        dropped (False), and ``src`` is cut off: its later messages are dropped too, so none is ever
        taken in place of a dropped one, and every receive from it fails once the messages it sent
        before are taken (at no cost per dropped message)."""
        before = self._pending.get(src, 0)
        if src not in self._cut_off and not (before and before + nbytes + MESSAGE_COST > self._limit):
            self._pending[src] = before + nbytes + MESSAGE_COST
            return True
        if len(self._dropped) < MAX_DROPPED_KEYS:  # (for receives from any source)
            self._dropped.setdefault((dst, tag), src)
        self._cut_off.setdefault(
            src,
            f"recv: peer {src} sent more than this process kept for it ({self._limit >> 20} MiB not yet "
            f"received; a message of {nbytes} bytes to peer {dst}, tag {tag}, was the first dropped): "
            f"its later messages are dropped too; receive sooner or send less ahead",
        )
        self._cv.notify_all()
        return False

    def post(self, src: int, dst: int, tag: int, receive: Any) -> None:
        """``receive`` (held weakly: one let go gives its turn up) started: it takes its message in
        the order started among the receives from ``src`` to ``dst`` with ``tag`` (MPI's order):
        the n-th of those not yet matched takes the n-th message, whichever is waited for first,
        and a receive made after it takes the next one. ``take(..., posted=receive)`` takes it."""
        with self._cv:
            self._posted.setdefault((src, dst, tag), []).append(weakref.ref(receive))

    def unpost(self, src: int, dst: int, tag: int, receive: Any) -> None:
        """``receive`` gives its turn up (its use ended without a message)."""
        with self._cv:
            self._ahead((src, dst, tag), receive, True)

    def _ahead(self, key: Key, receive: Any = None, remove: bool = False) -> int:
        """How many receives started before ``receive`` (None: all of them) still wait for a message
        of ``key`` (lock held); ``remove``: ``receive`` leaves the line."""
        posted = self._posted.get(key)
        if not posted:
            return 0
        if receive is not None and posted[0]() is receive:  # (first in line: the common case)
            if remove:
                del posted[0]
                if not posted:
                    del self._posted[key]
            return 0
        live = [ref for ref in posted if ref() is not None]  # (a receive let go: its turn is given up)
        found = next((i for i, ref in enumerate(live) if ref() is receive), len(live))
        if remove and found < len(live):
            del live[found]
        if live:
            self._posted[key] = live
        else:
            del self._posted[key]
        return found

    def take(
        self,
        src: int | None,
        dst: int,
        tag: int,
        deadline: float,
        timeout: float,
        gone: Callable[[int | None], CollectiveError | None],
        pump: Callable[[float], None] | None = None,
        refuse: Callable[[Array], str | None] | None = None,
        posted: Any = None,
    ) -> tuple[int, Array]:
        """(the source, the next message from ``src`` to ``dst`` with ``tag``); raises at the deadline
        or on loss (``gone(src)``). With ``src`` None, from any source: the earliest to arrive.
        The messages of receives started before (``post``) are theirs: this takes the one after;
        ``posted``: the receive started, which takes its own in its turn (and leaves the line).

        ``pump(seconds)`` lets messages from other processes arrive while this waits. A message
        that ``refuse`` finds a problem with stays where it is (InvalidArgumentError).
        """
        looked_last = False  # (a source is gone: what it sent before may still be on its way in)
        while True:
            with self._cv:
                if src is None:
                    key, index = self._earliest(dst, tag)
                else:
                    key = (src, dst, tag)
                    index = self._ahead(key, posted) if self._posted else 0
                box = self._boxes.get(key) if key is not None else None
                if key is not None and box is not None and len(box) > index:
                    problem = refuse(box[index][0]) if refuse is not None else None
                    if problem is not None:
                        raise InvalidArgumentError(problem)
                    data, remote, _ = box[index]
                    del box[index]
                    if not box:
                        del self._boxes[key]
                    if posted is not None:
                        self._ahead(key, posted, True)
                    if remote:
                        self._pending[key[0]] -= data.nbytes + MESSAGE_COST
                    return key[0], data
                if self._closed is not None:
                    raise self._closed
                if src in self._cut_off:
                    raise MismatchError(self._cut_off[src])
                dropped = self._dropped.get((dst, tag)) if src is None else None  # (one for it was)
                if dropped is not None:
                    raise MismatchError(self._cut_off[dropped])
                lost = gone(src)
                if lost is not None and (pump is None or looked_last):
                    raise lost
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    sender = f"peer {src}" if src is not None else "any peer"
                    raise CollectiveTimeout(
                        f"recv: peer {dst} waited {timeout:g}s for a message from {sender} with tag {tag}; "
                        f"check that {sender} calls send(..., dst={dst}, tag={tag})",
                        [src] if src is not None else [],
                    )
                if pump is None:
                    self._cv.wait(min(remaining, 0.05))
            if pump is not None:
                looked_last = lost is not None
                pump(0 if looked_last else min(remaining, PUMP_SLICE))

    def _earliest(self, dst: int, tag: int) -> tuple[Key | None, int]:
        """The key of the earliest message for ``dst`` with ``tag`` from any source that no receive
        started before waits for, and its place in its box (lock held)."""
        found = []
        for key, box in self._boxes.items():
            if key[1:] == (dst, tag):
                index = self._ahead(key) if self._posted else 0
                if len(box) > index:
                    found.append((box[index][2], key, index))
        if not found:
            return None, 0
        _, key, index = min(found)
        return key, index

    def wake(self) -> None:
        """Let waiting receivers look again (a peer left, a node was lost)."""
        with self._cv:
            self._cv.notify_all()

    def close(self, error: CollectiveError) -> None:
        with self._cv:
            self._closed = error
            self._cv.notify_all()
