"""A node's sockets to the other nodes of its job: the peer-to-peer tensor data service.

Each node binds one ROUTER socket (its data service) and, once the topology is known, connects
one DEALER to every other node's data service. Node i sends to node j over its DEALER for j and
receives everything on its ROUTER, where messages are queued per sending node (ZeroMQ keeps the
order of one connection). Connections are made once per job and reused by every collective.

Incoming messages are validated before they are queued: a ROUTER identity this node assigned,
a well-formed header (transport.wire) of this job, at most one payload frame; anything else is
dropped with a log line and the service keeps serving. ``ZMQ_MAXMSGSIZE`` bounds every message
before ZeroMQ allocates it.

Sockets are used by one thread at a time (whichever local peer leads the current collective);
``lost`` is polled while waiting so a node or orchestrator failure noticed by the heartbeat
thread ends every wait within ``POLL_SLICE`` seconds.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from collective.errors import CollectiveError, CollectiveTimeout, PeerLostError, RegistrationError
from collective.transport.auth import watch_refusals
from collective.transport.shm import PeerSegment, SendSegment, host_identity
from collective.transport.sockets import make_socket
from collective.transport.wire import (
    MAX_HEADER_BYTES,
    MAX_MESSAGE_BYTES,
    WireError,
    decode_header,
    encode_header,
)

__all__ = ["POLL_SLICE", "NodeNetwork", "Received"]

log = logging.getLogger(__name__)

POLL_SLICE = 0.05
RECEIVE_HWM = 16  # messages (of at most MAX_MESSAGE_BYTES) queued by ZeroMQ per connection
Received = tuple[dict[str, Any], Any]  # (header, payload zmq.Frame or None)


def _identity(index: int) -> bytes:
    return f"node-{index}".encode()


class NodeNetwork:
    """Node ``index``'s data service for job ``job``; ``lost()`` returns an error once the job is broken."""

    def __init__(
        self,
        context: zmq.Context[Any],
        job: str,
        host: str,
        port: int,
        lost: Callable[[int], CollectiveError | None],
        token: str | None = None,
    ) -> None:
        self.job = job
        self._context = context
        self._lost = lost
        self._token = token
        self._router = make_socket(
            context, zmq.ROUTER, token=token, server=True, max_message=MAX_MESSAGE_BYTES,
            receive_hwm=RECEIVE_HWM, send_hwm=1,
        )  # fmt: skip
        try:
            if port == 0:
                self.port = self._router.bind_to_random_port(f"tcp://{host}")
            else:
                self._router.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError as exc:
            self._router.close(0)
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else str(exc)
            raise RegistrationError(f"the data service cannot listen on {host}:{port}: {reason}") from exc
        self.address = f"{host}:{self.port}"
        self._watch = watch_refusals(self._router, f"data service {self.address}") if token else None
        self.index = -1
        self._segment = SendSegment.create()
        self.info = {"host": host_identity(), "shm": self._segment.path if self._segment else None}
        self._peer_segments: dict[int, PeerSegment] = {}
        self._dealers: dict[int, zmq.Socket[Any]] = {}
        self._sources: dict[bytes, int] = {}
        self._queues: dict[int, deque[Received]] = {}
        self._aborted: dict[int, tuple[int, str]] = {}  # step -> (node, why) for steps another node gave up
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)

    def connect(self, index: int, addresses: list[str], infos: list[dict[str, Any]] | None = None) -> None:
        """Join the mesh as node ``index`` of ``addresses`` (the data services of all nodes, by index).

        ``infos`` (each node's ``info``) tells which nodes share this host: their send segments are
        mapped so their large chunks are read from shared memory.
        """
        self.index = index
        for other, address in enumerate(addresses):
            if other == index:
                continue
            info = (infos or [{}] * len(addresses))[other]
            if info.get("host") == self.info["host"] and isinstance(info.get("shm"), str) and self._segment:
                try:
                    self._peer_segments[other] = PeerSegment(info["shm"])
                except (OSError, ValueError) as exc:
                    log.info("node %d's shared memory is not usable here (%s): using TCP", other, exc)
            dealer = make_socket(
                self._context, zmq.DEALER, token=self._token, server=False, max_message=MAX_HEADER_BYTES,
                receive_hwm=1, send_hwm=0, routing_id=_identity(index),
            )  # fmt: skip
            dealer.connect(f"tcp://{address}")
            self._dealers[other] = dealer
            self._sources[_identity(other)] = other
            self._queues[other] = deque()

    @property
    def size(self) -> int:
        return len(self._dealers) + 1

    def send(self, dst: int, header: dict[str, Any], payload: Any = None) -> zmq.MessageTracker | None:
        """Queue one message for node ``dst``; a large payload is sent without copying and tracked."""
        header = {**header, "job": self.job, "src": self.index}
        frames: list[Any] = [encode_header(header)]
        if payload is None:
            self._dealers[dst].send_multipart(frames, copy=True)
            return None
        frames.append(payload)
        if payload.nbytes <= zmq.COPY_THRESHOLD:
            self._dealers[dst].send_multipart(frames, copy=True)
            return None
        tracker: zmq.MessageTracker | None = self._dealers[dst].send_multipart(frames, copy=False, track=True)
        return tracker

    def stage(self, dst: int, data: Any) -> int | None:
        """Put a chunk for same-host node ``dst`` into shared memory: its slot, or None (use TCP)."""
        if self._segment is None or dst not in self._peer_segments:  # dst maps ours iff we map its
            return None
        return self._segment.stage(dst, data)

    def shared_view(self, src: int, slot: Any, nbytes: int, dtype: Any) -> Any:
        """A chunk node ``src`` staged in ``slot`` (None if it cannot be one)."""
        segment = self._peer_segments.get(src)
        return None if segment is None else segment.view(slot, nbytes, dtype)

    def abort(self, seq: int, why: str) -> None:
        """Tell every other node that this node gave up step ``seq`` (their waits in it fail at once)."""
        for other in self._dealers:
            self.send(other, {"t": "abort", "seq": seq, "why": why[:1000]})

    def release(self, src: int, seq: int, slot: int) -> None:
        """Tell node ``src`` its ``slot`` has been read."""
        self.send(src, {"t": "ack", "seq": seq, "slot": slot})

    def receive(self, src: int, seq: int, deadline: float, waiting_for: str) -> Received:
        """The next message of step ``seq`` from node ``src`` (older steps' leftovers are dropped)."""
        queue = self._queues[src]
        while True:
            while queue:
                header = queue[0][0]
                if header["seq"] >= seq:
                    return queue.popleft()
                queue.popleft()  # from a step that failed before this message was read
                log.debug("dropped a stale message of step %d from node %d", header["seq"], src)
            error = self._lost(src)
            if error is not None:
                raise error
            if seq in self._aborted:
                node, why = self._aborted[seq]
                raise PeerLostError(f"node {node} gave up step {seq}: {why}", ())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveTimeout(f"node {self.index} timed out waiting for {waiting_for}", ())
            if self._poller.poll(int(1000 * min(remaining, POLL_SLICE))):
                self._drain()

    def _drain(self) -> None:
        """Move every message waiting on the ROUTER into the per-node queues."""
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._accept(frames)

    def _accept(self, frames: list[Any]) -> None:
        identity = bytes(frames[0].buffer)
        source = self._sources.get(identity)
        try:
            if source is None:
                raise WireError(f"unknown sender {identity[:32]!r}")
            if len(frames) not in (2, 3):
                raise WireError(f"{len(frames) - 1} frames (expected a header and at most one payload)")
            header = decode_header(frames[1].buffer)
            if header["job"] != self.job or header["src"] != source:
                raise WireError(f"job {header['job']!r} / source {header['src']} does not match")
        except WireError as exc:
            log.warning("data service %s refused a message: %s", self.address, exc)
            return
        if header["t"] == "abort":  # handled here, never queued: every wait in that step fails
            self._aborted[header["seq"]] = (source, str(header.get("why")))
            return
        if header["t"] == "ack":  # a slot of our send segment was read: handled here, never queued
            if self._segment is None or not self._segment.release(source, header.get("slot")):
                log.warning(
                    "data service %s: node %d acknowledged slot %r it was not lent",
                    self.address,
                    source,
                    header.get("slot"),
                )
            return
        self._queues[source].append((header, frames[2] if len(frames) == 3 else None))

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        for segment in self._peer_segments.values():
            segment.close()
        if self._segment is not None:
            self._segment.close()
        for dealer in self._dealers.values():
            dealer.close(0)
        self._router.close(0)
