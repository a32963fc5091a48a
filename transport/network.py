"""A node's sockets to the other nodes of its job: the peer-to-peer tensor data service.

Each node binds one ROUTER socket (its data service) and, once the topology is known, connects
one DEALER to every other node's data service. Node i sends to node j over its DEALER for j and
receives everything on its ROUTER, where messages are queued per sending node (ZeroMQ keeps the
order of one connection). Connections are made once per job and reused by every collective.

Incoming messages are validated before they are queued: a ROUTER identity this node assigned,
a well-formed header (transport.wire) of this job, at most one payload frame; anything else is
dropped with a (rate-limited) log line and the service keeps serving. ``ZMQ_MAXMSGSIZE`` bounds
every message before ZeroMQ allocates it.

Every queue is bounded. ZeroMQ queues at most ``RECEIVE_HWM`` messages per connection (then TCP
flow control slows the sender; senders never block, so two nodes sending to each other cannot
deadlock). Once the node knows its job, a background drain empties the ROUTER even while no
collective runs, so what strangers send is dropped at once rather than piling up. The
per-node queues hold messages of the steps this node can still need, ``[step, step + STEPS_AHEAD]``
(a node cannot get further ahead: every step starts with a call from every node), and at most
``budget`` bytes per node and step: twice the largest array a call of that step declared (no
schedule sends one node more than that; 64 MiB before the calls are known). A node that sends
more fails that step with MismatchError on this node instead of growing its memory.

Steps are counted per channel: every group of peers has its own (``ch`` in the header, 0 for the
whole job), so the steps of different groups never mix. Point-to-point messages (``t`` = "p2p")
belong to no step: they are handed to the ``on_message`` callback as they arrive.

A node whose connection to this data service closes (its process exited, crashed or was killed:
the kernel closes its sockets; a socket monitor tells) is ``closed``: whoever waits for it learns
at once, once every message it sent before has been sorted.

The ROUTER, the queues and the slots of the send segment are used under one lock: by whichever
local peer leads the current collective, or by the drain in between. ``lost`` is polled while
waiting so a node or orchestrator failure noticed by the heartbeat thread ends every wait within
``POLL_SLICE`` seconds.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from collective.errors import (
    CollectiveError,
    CollectiveTimeout,
    MismatchError,
    PeerLostError,
    RegistrationError,
)
from collective.transport.logs import Throttle
from collective.transport.shm import SendSegment, host_identity
from collective.transport.sockets import connection_of, make_socket, watch_connections
from collective.transport.wire import (
    MAX_HEADER_BYTES,
    MAX_MESSAGE_BYTES,
    ErrorRecord,
    WireError,
    declared_bytes,
    decode_header,
    encode_header,
)

__all__ = ["BUDGET_FLOOR", "POLL_SLICE", "RECEIVE_HWM", "STEPS_AHEAD", "NodeNetwork", "Received"]

log = logging.getLogger(__name__)

POLL_SLICE = 0.05
RECEIVE_HWM = 16  # messages (of at most MAX_MESSAGE_BYTES) queued by ZeroMQ per connection
STEPS_AHEAD = 2  # messages of steps further ahead of this node's than this are refused
BUDGET_FLOOR = 64 << 20  # bytes one node may have queued for one step before its size is known
DRAIN_EVERY = 0.05  # seconds between background drains
DRAIN_TURN = 256  # messages moved per turn at most, so a flood cannot keep the lock
MAX_CHANNELS = 4096  # groups a node may use at once (each has its own steps)
Received = tuple[dict[str, Any], Any]  # (header, payload zmq.Frame or None)
Step = tuple[int, int]  # (channel, step): every group has its own channel and counts its own steps


def _gave_up(seq: int, node: int, why: ErrorRecord) -> CollectiveError:
    """The error of a wait that node ``node`` ended by giving up step ``seq``: a timeout where the
    step timed out there (slow data is no lost peer), else a lost peer: the peers node ``node``
    lost, when it gave the step up for one (what those peers were doing is then looked up for
    this error too, as for a peer this node lost itself)."""
    text = f"node {node} gave up step {seq}: {why}"
    if why.name == CollectiveTimeout.__name__:
        return CollectiveTimeout(text, why.peers)
    return PeerLostError(text, why.peers if why.name == PeerLostError.__name__ else ())


def _identity(index: int) -> bytes:
    return f"node-{index}".encode()


class NodeNetwork:
    """Node ``index``'s data service for job ``job``; ``lost(node)``: an error once ``node`` is gone."""

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
        self.lost = lost
        self._token = token
        self._router = make_socket(
            context,
            zmq.ROUTER,
            token=token,
            server=True,
            max_message=MAX_MESSAGE_BYTES,
            receive_hwm=RECEIVE_HWM,
            send_hwm=1,
        )
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
        self._fds: dict[int, int] = {}  # connection (its descriptor) -> the node that sends on it
        self._placed: set[int] = set()  # nodes whose connection is in _fds
        self._closed: dict[int, float] = {}  # node -> when its connection closed
        self._emptied = 0.0  # when the ROUTER was last found empty (everything before was sorted)
        self._watch = watch_connections(
            self._router, f"data service {self.address}", token is not None, self._connection_closed
        )
        self.index = -1
        self._segment = SendSegment.create()
        self.info = {"host": host_identity(), "shm": self._segment.path if self._segment else None}
        self._peer_segments: dict[int, SendSegment] = {}
        self._dealers: dict[int, zmq.Socket[Any]] = {}
        self._addresses: dict[int, str] = {}
        self._sources: dict[bytes, int] = {}
        # (node, channel) -> its messages, in order: (header, payload, bytes)
        self._queues: dict[tuple[int, int], deque[tuple[dict[str, Any], Any, int]]] = {}
        self._aborted: dict[Step, tuple[int, ErrorRecord]] = {}  # steps another node gave up: (node, why)
        self._lock = threading.Lock()
        self._sending = threading.Lock()  # a socket is not thread-safe: one multipart send at a time
        self._step: dict[int, int] = {}  # channel -> the step this node is at (earlier ones are over)
        self._budgets: dict[Step, int] = {}  # bytes one node may have queued for a step
        self._queued: dict[tuple[int, int, int], int] = {}  # (node, channel, step) -> bytes queued
        self._overflowed: dict[tuple[int, int, int], str] = {}  # why a node's messages were dropped
        self._deliver: Callable[[int, dict[str, Any], Any], None] | None = None  # p2p messages
        self._idle: Callable[[], Any] | None = None  # called by the background drain, every DRAIN_EVERY
        self._refused = Throttle(log)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._closing = threading.Event()
        self._drainer: threading.Thread | None = None

    def connect(self, index: int, addresses: list[str], infos: list[dict[str, Any]] | None = None) -> None:
        """Join the mesh as node ``index`` of ``addresses`` (the data services of all nodes, by index).

        ``infos`` (each node's ``info``) tells which nodes share this host: their send segments are
        mapped so their large chunks are read from shared memory."""
        self.index = index
        for other, address in enumerate(addresses):
            if other == index:
                continue
            info = (infos or [{}] * len(addresses))[other]
            if info.get("host") == self.info["host"] and isinstance(info.get("shm"), str) and self._segment:
                try:
                    self._peer_segments[other] = SendSegment.attach(info["shm"])
                except (OSError, ValueError) as exc:
                    log.info("node %d's shared memory is not usable here (%s): using TCP", other, exc)
            dealer = make_socket(
                self._context,
                zmq.DEALER,
                token=self._token,
                server=False,
                max_message=MAX_HEADER_BYTES,
                receive_hwm=1,
                send_hwm=0,
                routing_id=_identity(index),
            )
            dealer.connect(f"tcp://{address}")
            self._dealers[other] = dealer
            self._addresses[other] = address
            self._sources[_identity(other)] = other
        self._drainer = threading.Thread(target=self._drain_between, name="collective-drain", daemon=True)
        self._drainer.start()

    @property
    def size(self) -> int:
        return len(self._dealers) + 1

    @property
    def free_slots(self) -> list[int] | None:
        """The slots of this node's send segment not lent to a node now, sorted; None without a
        segment (for tests: every slot comes back once its receiver acknowledged it)."""
        if self._segment is None:
            return None
        with self._lock:
            return self._segment.free_slots

    def _enter_step(self, channel: int, seq: int) -> None:
        """This node works on step ``seq`` of ``channel`` now: forget what earlier steps left (lock held)."""
        if seq <= self._step.get(channel, 0):
            return
        self._step[channel] = seq
        for table in (self._budgets, self._aborted):
            for old in [key for key in table if key[0] == channel and key[1] < seq]:
                del table[old]
        for key in [k for k in self._overflowed if k[1] == channel and k[2] < seq]:
            del self._overflowed[key]
        for (src, ch), queue in self._queues.items():
            while ch == channel and queue and queue[0][0]["seq"] < seq:  # left after a step that failed
                self._pop(src, queue)

    def _allow(self, step: Step, header: dict[str, Any]) -> None:
        """A call of ``step`` declares its array: a node may send up to twice that (lock held)."""
        declared = 2 * declared_bytes(header) + 2 * MAX_MESSAGE_BYTES
        self._budgets[step] = max(self._budgets.get(step, BUDGET_FLOOR), declared)

    def on_message(self, deliver: Callable[[int, dict[str, Any], Any], None]) -> None:
        """Hand messages that belong to no step (``t`` = "p2p") to ``deliver(node, header, payload)``."""
        self._deliver = deliver

    def send(
        self, dst: int, header: dict[str, Any], payload: Any = None, track: bool = False
    ) -> zmq.MessageTracker | None:
        """Queue one message for node ``dst``; a large payload (any with ``track``) goes uncopied, tracked."""
        header = {**header, "job": self.job, "src": self.index}
        if header["t"] != "p2p":
            with self._lock:
                channel = header.get("ch", 0)
                self._enter_step(channel, header["seq"])
                if header["t"] == "call":
                    self._allow((channel, header["seq"]), header)
        frames: list[Any] = [encode_header(header)]
        if payload is not None:
            frames.append(payload)
        large = payload is not None and (track or payload.nbytes > zmq.COPY_THRESHOLD)
        try:  # never blocks: SNDHWM=0 queues everything while a connection exists or is being made
            with self._sending:  # (groups run from several threads: their frames must not interleave)
                tracker: zmq.MessageTracker | None = self._dealers[dst].send_multipart(
                    frames, zmq.NOBLOCK, copy=not large, track=large
                )
        except zmq.Again:  # ZeroMQ dropped the connection for good: its handshake was refused
            raise PeerLostError(
                f"node {self.index} cannot send to node {dst}: its data service at {self._addresses[dst]} "
                f"refused the connection (the job token differs?)",
                (),
            ) from None
        return tracker if large else None

    def stage(self, dst: int, data: Any) -> int | None:
        """Put a chunk for same-host node ``dst`` into shared memory: its slot, or None (use TCP)."""
        if self._segment is None or dst not in self._peer_segments:  # dst maps ours iff we map its
            return None
        with self._lock:
            return self._segment.stage(dst, data)

    def shared_view(self, src: int, slot: Any, nbytes: int, dtype: Any) -> Any:
        """A chunk node ``src`` staged in ``slot`` (None if it cannot be one)."""
        segment = self._peer_segments.get(src)
        return None if segment is None else segment.view(slot, nbytes, dtype)

    def abort(self, seq: int, why: ErrorRecord, nodes: list[int] | None = None, channel: int = 0) -> None:
        """Tell ``nodes`` (every other node) that this node gave up step ``seq`` of ``channel``, and why."""
        for other in self._dealers if nodes is None else [n for n in nodes if n != self.index]:
            with contextlib.suppress(PeerLostError):  # tell every node that can still be told
                self.send(other, {"t": "abort", "ch": channel, "seq": seq, **why.fields()})

    def release(self, src: int, seq: int, slot: int, channel: int = 0) -> None:
        """Tell node ``src`` its ``slot`` has been read."""
        self.send(src, {"t": "ack", "ch": channel, "seq": seq, "slot": slot})

    def receive(
        self,
        src: int,
        seq: int,
        deadline: float,
        waiting_for: str,
        channel: int = 0,
        gone: Callable[[], CollectiveError | None] | None = None,
    ) -> Received:
        """The next message of step ``seq`` of ``channel`` from node ``src`` (older leftovers dropped).

        ``gone`` is polled like ``lost``: an error once ``src`` will send nothing more for this step.
        It is read before the queue, so a notice that follows the awaited message on ``src``'s
        connection (messages are sorted in the order they came) cannot hide it."""
        with self._lock:
            queue = self._queues.setdefault((src, channel), deque())
        while True:
            dead = gone() if gone is not None else None
            with self._lock:
                self._enter_step(channel, seq)
                aborted = self._aborted.get((channel, seq))  # (before what that node sent next)
                if queue and aborted is None:
                    header, payload = self._pop(src, queue)
                    return header, payload
                overflow = self._overflowed.get((src, channel, seq))
            if aborted is not None:
                raise _gave_up(seq, *aborted)
            if overflow is not None:
                raise MismatchError(overflow)
            error = self.lost(src) or dead
            if error is not None:
                raise error
            aborted = self._aborted.get((channel, seq))  # written by the drain thread too
            if aborted is not None:
                raise _gave_up(seq, *aborted)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveTimeout(f"node {self.index} timed out waiting for {waiting_for}", ())
            with self._lock:
                self._sort(int(1000 * min(remaining, POLL_SLICE)))

    def pump(self, seconds: float) -> None:
        """Wait up to ``seconds`` for messages and sort them (for a receive outside any collective;
        when a collective is receiving, it sorts them itself: this only waits a little then)."""
        if not self._lock.acquire(timeout=seconds):
            return
        try:
            self._sort(int(1000 * seconds))
        finally:
            self._lock.release()

    def queued(
        self, sources: list[int], seq: int, kind: str, channel: int = 0, drain: bool = True
    ) -> list[tuple[int, dict[str, Any]]]:
        """The messages of type ``kind`` for step ``seq`` that these nodes already sent and that
        are here now, without waiting (e.g. a verdict behind a call): (node, header) each. Without
        ``drain``, only those already sorted (the background drain sorts them every 50 ms)."""
        with self._lock:
            if drain:
                self._sort(0)
            return [
                (src, header)
                for src in sources
                for header, _, _ in self._queues.get((src, channel), ())
                if header["seq"] == seq and header["t"] == kind
            ]

    def _pop(self, src: int, queue: deque[tuple[dict[str, Any], Any, int]]) -> Received:
        header, payload, size = queue.popleft()
        key = (src, header.get("ch", 0), header["seq"])
        left = self._queued.get(key, 0) - size
        if left > 0:
            self._queued[key] = left
        else:
            self._queued.pop(key, None)
        return header, payload

    def on_idle(self, call: Callable[[], Any]) -> None:
        """``call()`` every DRAIN_EVERY on the background drain's thread (outside the network's lock):
        point to point's other path (shared memory) drained too while nobody receives."""
        self._idle = call

    def _drain_between(self) -> None:
        """Background: empty the ROUTER while no collective does (what strangers send is dropped)."""
        while not self._closing.wait(DRAIN_EVERY):
            if self._idle is not None:
                try:
                    self._idle()
                except Exception:  # (the drain goes on: a failure here must not end it)
                    log.exception("data service %s: the idle call failed", self.address)
            if not self._lock.acquire(blocking=False):  # a collective is receiving: it drains
                continue
            try:
                self._sort(0)
            finally:
                self._lock.release()
            self._refused.flush()

    def _sort(self, wait_ms: int) -> None:
        """Wait up to ``wait_ms`` for messages, then sort what came (lock held)."""
        if self._poller.poll(wait_ms):
            self._drain()
        else:
            self._emptied = time.monotonic()

    def _drain(self) -> None:
        """Move the messages waiting on the ROUTER (DRAIN_TURN at most) into the per-node queues."""
        for _ in range(DRAIN_TURN):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._emptied = time.monotonic()
                return
            self._accept(frames)

    def _connection_closed(self, fd: int) -> None:
        """(The watch's thread) the connection ``fd`` closed: its node sends nothing more."""
        node = self._fds.get(fd)
        if node is not None:
            self._closed.setdefault(node, time.monotonic())

    def closed(self, node: int) -> bool:
        """Whether ``node``'s connection to this data service closed (it sends nothing more) and
        everything that was waiting since has been sorted: a waiter that is told so has looked at
        all its node sent before the close."""
        when = self._closed.get(node)
        return when is not None and self._emptied > when

    def _accept(self, frames: list[Any]) -> None:
        identity = bytes(frames[0].buffer)
        source = self._sources.get(identity)
        if source is not None and source not in self._placed:  # (each node connects once)
            self._placed.add(source)
            fd = connection_of(frames[0])
            if fd is not None:
                self._fds[fd] = source
        try:
            if source is None:
                raise WireError(f"unknown sender {identity[:32]!r}")
            if len(frames) not in (2, 3):
                raise WireError(f"{len(frames) - 1} frames (expected a header and at most one payload)")
            header = decode_header(frames[1].buffer)
            if header["job"] != self.job or header["src"] != source:
                raise WireError(f"job {header['job']!r} / source {header['src']} does not match")
            channel, seq = header.get("ch", 0), header["seq"]
            if not isinstance(channel, int) or isinstance(channel, bool) or channel < 0:
                raise WireError(f"invalid channel {channel!r}")
            if header["t"] != "p2p" and channel not in self._step and len(self._step) >= MAX_CHANNELS:
                raise WireError(f"node {source} opened more than {MAX_CHANNELS} channels (groups)")
            at = self._step.get(channel, 0)
            if seq > at + STEPS_AHEAD:
                raise WireError(f"node {source} sent a message of step {seq} while this node is at {at}")
            record = ErrorRecord.from_fields(header) if header["t"] == "abort" else None
        except WireError as exc:
            reason = str(exc)
            kind = " ".join(reason.split()[:2])  # "unknown sender", "undecodable header:", ...
            self._refused.warning("data service %s refused a message: %s", self.address, reason, key=kind)
            return
        kind = header["t"]
        if kind == "p2p":  # no step: handed on at once (the receiver bounds what it keeps)
            if self._deliver is not None:
                self._deliver(source, header, frames[2] if len(frames) == 3 else None)
            return
        if record is not None:  # an abort, handled here, never queued: every wait in that step fails
            if seq >= at:
                self._aborted[(channel, seq)] = (source, record)
            return
        if kind == "ack":  # a slot of our send segment was read: handled here, never queued
            if self._segment is None or not self._segment.release(source, header.get("slot")):
                self._refused.warning(
                    "data service %s: node %d acknowledged slot %r it was not lent",
                    self.address,
                    source,
                    header.get("slot"),
                )
            return
        if seq < at:
            return  # of a step that failed before this message was read
        self._step.setdefault(channel, 0)
        if kind == "call":
            self._allow((channel, seq), header)
        size = sum(len(frame) for frame in frames[1:])
        key = (source, channel, seq)
        budget = self._budgets.get((channel, seq), BUDGET_FLOOR)
        if self._queued.get(key, 0) + size > budget:
            why = (
                f"node {source} sent more than {budget >> 20} MiB for step {seq} before this node read it "
                f"(twice the largest array of the step's calls): its messages were dropped"
            )
            if key not in self._overflowed:
                log.warning("data service %s: %s", self.address, why)
            self._overflowed[key] = why
            return
        self._queued[key] = self._queued.get(key, 0) + size
        queue = self._queues.setdefault((source, channel), deque())
        queue.append((header, frames[2] if len(frames) == 3 else None, size))

    def close(self) -> None:
        self._closing.set()
        if self._drainer is not None:
            self._drainer.join(5)
        self._watch.stop()
        for segment in self._peer_segments.values():
            segment.close()
        if self._segment is not None:
            self._segment.close()
        for dealer in self._dealers.values():
            dealer.close(0)
        self._router.close(0)
