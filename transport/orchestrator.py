"""The orchestrator daemon and its client: job membership, topology, heartbeats. No tensor data.

Protocol (one msgpack map per message, over a ROUTER socket; every message has ``t`` and ``job``):

node -> orchestrator                       orchestrator -> node
  register {num_nodes, address, peers}       topology {index, nodes: [{address, peers}], world}
                                             refused  {message}             (a RegistrationError)
  heartbeat                                  pong
  leave                                      lost     {node, peers, reason} (to the other nodes)

A job forms when ``num_nodes`` nodes registered with the same ``num_nodes``, disjoint peer ids
that together are 0..world-1, and distinct addresses. Node indices follow the nodes' lowest peer
id, so the same nodes get the same indices whatever order they arrive in. A node that sends
nothing for ``lost_after`` seconds is declared lost and the other nodes of its job are told; a
node that stops hearing pongs declares the orchestrator lost the same way. Jobs are told apart by
name; one orchestrator serves many, at the same time and one after another.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from collective.calls import describe_peers
from collective.errors import CollectiveError, CollectiveTimeout, PeerLostError, RegistrationError
from transport.auth import HANDSHAKE_FAILED, handshake_failure, secure, watch_refusals

__all__ = ["HEARTBEAT_INTERVAL", "LOST_AFTER", "Orchestrator", "OrchestratorClient", "Topology"]

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 0.25
LOST_AFTER = 2.0
_MAX_MESSAGE = 1 << 20


def _pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)  # type: ignore[no-any-return]


def _unpack(frame: bytes) -> dict[str, Any] | None:
    """A bounded msgpack map with a string ``t`` and ``job``, or None for anything else."""
    if len(frame) > _MAX_MESSAGE:
        return None
    try:
        message = msgpack.unpackb(
            frame, raw=False, max_str_len=4096, max_bin_len=0, max_array_len=1 << 16, max_map_len=64
        )
    except Exception:
        return None
    if (
        not isinstance(message, dict)
        or not isinstance(message.get("t"), str)
        or not isinstance(message.get("job"), str)
    ):
        return None
    return message


def _is_peer_list(value: Any) -> TypeGuard[list[int]]:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in value)
    )


@dataclass
class _Node:
    identity: bytes
    address: str
    peers: list[int]
    last_seen: float
    info: dict[str, Any] = field(default_factory=dict)
    index: int = -1
    gone: str | None = None  # why it left or was lost


@dataclass
class _Job:
    name: str
    num_nodes: int
    nodes: dict[bytes, _Node] = field(default_factory=dict)
    formed: bool = False


class Orchestrator:
    """Serves jobs on ``tcp://host:port`` (port 0: a free port, see ``port``) until ``stop()``."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, lost_after: float = LOST_AFTER, token: str | None = None
    ) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE)
        secure(self._socket, token, server=True)
        try:
            self.port = self._socket.bind_to_random_port(f"tcp://{host}") if port == 0 else port
            if port:
                self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._socket.close(0)
            self._context.destroy(linger=0)
            raise RegistrationError(f"the orchestrator cannot listen on {host}:{port}: {exc}") from exc
        self.address = f"{host}:{self.port}"
        self._stop_watching = watch_refusals(self._socket, f"orchestrator {self.address}") if token else None
        self._lost_after = lost_after
        self._jobs: dict[str, _Job] = {}
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def serve(self) -> None:
        """Run until stop(); then close the socket."""
        log.info("orchestrator listening on %s", self.address)
        try:
            while not self._stopping.is_set():
                if self._socket.poll(50):
                    while True:
                        try:
                            identity, *frames = self._socket.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(identity, frames)
                self._check_heartbeats()
        finally:
            if self._stop_watching is not None:
                self._stop_watching()
            self._socket.close(0)
            self._context.destroy(linger=0)
            log.info("orchestrator on %s stopped", self.address)

    def _send(self, identity: bytes, message: dict[str, Any]) -> None:
        try:
            self._socket.send_multipart([identity, _pack(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("could not answer %r: %s", identity, exc)

    def _handle(self, identity: bytes, frames: list[bytes]) -> None:
        message = _unpack(frames[0]) if len(frames) == 1 else None
        if message is None:
            log.warning("orchestrator %s refused a malformed message from %r", self.address, identity[:32])
            return
        job = self._jobs.get(message["job"])
        node = job.nodes.get(identity) if job else None
        if node is not None:
            node.last_seen = time.monotonic()
        kind = message["t"]
        if kind == "register":
            self._register(identity, message)
        elif kind == "heartbeat" and node is not None:
            self._send(identity, {"t": "pong", "job": message["job"]})
        elif kind == "leave" and job is not None and node is not None:
            self._gone(job, node, "left the job")
        else:
            log.warning("orchestrator %s ignored a %r message from %r", self.address, kind, identity[:32])

    def _refuse(self, identity: bytes, job: str, text: str) -> None:
        log.warning("orchestrator refused a node of job %r: %s", job, text)
        self._send(identity, {"t": "refused", "job": job, "message": text})

    def _register(self, identity: bytes, message: dict[str, Any]) -> None:
        name, num_nodes, address, peers = (
            message["job"],
            message.get("num_nodes"),
            message.get("address"),
            message.get("peers"),
        )
        if (
            not isinstance(num_nodes, int)
            or num_nodes < 1
            or not isinstance(address, str)
            or not _is_peer_list(peers)
        ):
            self._refuse(identity, name, "malformed registration")
            return
        job = self._jobs.get(name)
        if (
            job is not None
            and (job.formed or all(n.gone for n in job.nodes.values()))
            and identity not in job.nodes
        ):
            if job.formed and any(n.gone is None for n in job.nodes.values()):
                self._refuse(identity, name, f"job {name!r} already has its {job.num_nodes} nodes")
                return
            job = None  # every node of the old job is gone: start it afresh
        if job is None:
            job = self._jobs[name] = _Job(name, num_nodes)
        if num_nodes != job.num_nodes:
            first = next(iter(job.nodes.values()))
            self._refuse(
                identity,
                name,
                f"node at {address} says num_nodes={num_nodes} "
                f"but node at {first.address} said {job.num_nodes}",
            )
            return
        for other in job.nodes.values():
            if other.identity == identity:
                continue
            if other.address == address:
                self._refuse(
                    identity, name, f"address {address} is already registered by another node of job {name!r}"
                )
                return
            shared = sorted(set(other.peers) & set(peers))
            if shared:
                self._refuse(
                    identity,
                    name,
                    f"node at {address} and node at {other.address} both claim {describe_peers(shared)}",
                )
                return
        info = message.get("info")
        info = (
            {k: v for k, v in info.items() if isinstance(k, str) and (v is None or isinstance(v, str))}
            if isinstance(info, dict)
            else {}
        )
        job.nodes[identity] = _Node(identity, address, sorted(peers), time.monotonic(), info)
        log.info("job %r: node at %s registered (%d of %d)", name, address, len(job.nodes), num_nodes)
        if len(job.nodes) == num_nodes:
            self._form(job)

    def _form(self, job: _Job) -> None:
        nodes = sorted(job.nodes.values(), key=lambda n: n.peers[0])
        every = sorted(p for n in nodes for p in n.peers)
        if every != list(range(len(every))):
            for node in nodes:
                self._refuse(
                    node.identity,
                    job.name,
                    f"the peer ids of job {job.name!r} must be 0..{len(every) - 1}, got {every}",
                )
            del self._jobs[job.name]
            return
        layout = [{"address": n.address, "peers": n.peers, "info": n.info} for n in nodes]
        for index, node in enumerate(nodes):
            node.index = index
            self._send(
                node.identity,
                {"t": "topology", "job": job.name, "index": index, "nodes": layout, "world": len(every)},
            )
        job.formed = True
        log.info("job %r formed: %d nodes, %d peers", job.name, len(nodes), len(every))

    def _gone(self, job: _Job, node: _Node, reason: str) -> None:
        if node.gone is not None:
            return
        node.gone = reason
        log.info("job %r: node at %s %s", job.name, node.address, reason)
        for other in job.nodes.values():
            if other is not node and other.gone is None:
                self._send(
                    other.identity,
                    {"t": "lost", "job": job.name, "node": node.index, "peers": node.peers, "reason": reason},
                )
        if all(n.gone is not None for n in job.nodes.values()):
            del self._jobs[job.name]

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for job in list(self._jobs.values()):
            for node in list(job.nodes.values()):
                if node.gone is None and now - node.last_seen > self._lost_after:
                    self._gone(job, node, f"stopped sending heartbeats ({self._lost_after:g}s)")
                    if job.name not in self._jobs:
                        break


@dataclass(frozen=True)
class Topology:
    index: int
    addresses: list[str]
    peers: list[list[int]]
    world: int
    infos: list[dict[str, Any]] = field(default_factory=list)  # per node: host identity, shared memory

    def describe(self, node: int) -> str:
        return f"node {node} ({describe_peers(self.peers[node])})"


class OrchestratorClient:
    """A node's connection to the orchestrator: register, then heartbeats on a background thread."""

    def __init__(
        self,
        context: zmq.Context[Any],
        address: str,
        job: str,
        lost_after: float = LOST_AFTER,
        token: str | None = None,
    ) -> None:
        self.address = address
        self.job = job
        self._lost_after = lost_after
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 500)
        self._socket.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE)
        secure(self._socket, token, server=False)
        self._monitor: zmq.Socket[Any] | None = self._socket.get_monitor_socket(HANDSHAKE_FAILED)
        self._socket.connect(f"tcp://{address}")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: CollectiveError | None = None
        self._left: dict[int, tuple[str, float]] = {}  # node index -> (reason, when)
        self.topology: Topology | None = None

    def register(
        self,
        num_nodes: int,
        address: str,
        peers: list[int],
        deadline: float,
        info: dict[str, Any] | None = None,
    ) -> Topology:
        """Register this node and wait for the topology (CollectiveTimeout, RegistrationError)."""
        self._socket.send(
            _pack(
                {
                    "t": "register",
                    "job": self.job,
                    "num_nodes": num_nodes,
                    "address": address,
                    "peers": peers,
                    "info": info or {},
                }
            )
        )
        try:
            return self._await_topology(num_nodes, deadline)
        finally:
            self._stop_monitor()

    def _stop_monitor(self) -> None:
        if self._monitor is not None:
            self._socket.disable_monitor()
            self._monitor.close(0)
            self._monitor = None

    def _await_topology(self, num_nodes: int, deadline: float) -> Topology:
        assert self._monitor is not None
        monitor = self._monitor
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._socket.send(_pack({"t": "leave", "job": self.job}))
                raise CollectiveTimeout(
                    f"register: no topology from the orchestrator at {self.address} for job {self.job!r}: "
                    f"it is not running, or not all {num_nodes} nodes registered"
                )
            ready = dict(poller.poll(int(1000 * min(remaining, 0.1))))
            if monitor in ready and handshake_failure(recv_monitor_message(monitor)):
                raise RegistrationError(
                    f"the orchestrator at {self.address} refused this node: the connection handshake failed "
                    f"(the job token is wrong or missing on one side)"
                )
            if self._socket not in ready:
                continue
            message = _unpack(self._socket.recv())
            if message is None or message["job"] != self.job:
                continue
            if message["t"] == "refused":
                raise RegistrationError(
                    f"the orchestrator at {self.address} refused this node: {message.get('message')}"
                )
            if message["t"] == "topology":
                nodes = message["nodes"]
                self.topology = Topology(
                    message["index"],
                    [n["address"] for n in nodes],
                    [n["peers"] for n in nodes],
                    message["world"],
                    [n.get("info") or {} for n in nodes],
                )
                self._thread = threading.Thread(
                    target=self._heartbeat, name="collective-heartbeat", daemon=True
                )
                self._thread.start()
                return self.topology

    def lost(self) -> CollectiveError | None:
        """The error that broke the job (a node or the orchestrator lost), if any."""
        return self._lost

    def left(self, node: int) -> tuple[str, float] | None:
        """(reason, when) if ``node`` left the job or was lost."""
        return self._left.get(node)

    def _heartbeat(self) -> None:
        last_heard = time.monotonic()
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._socket.send(_pack({"t": "heartbeat", "job": self.job}))
                next_beat = now + HEARTBEAT_INTERVAL
            if self._socket.poll(int(1000 * HEARTBEAT_INTERVAL / 2)):
                message = _unpack(self._socket.recv())
                if message is not None and message["job"] == self.job:
                    last_heard = time.monotonic()
                    if message["t"] == "lost":
                        self._node_gone(message)
            elif time.monotonic() - last_heard > self._lost_after and self._lost is None:
                self._lost = PeerLostError(
                    f"the orchestrator at {self.address} stopped answering ({self._lost_after:g}s)"
                )
                log.error("%s", self._lost)
        self._socket.send(_pack({"t": "leave", "job": self.job}))
        self._socket.close()

    def _node_gone(self, message: dict[str, Any]) -> None:
        node, raw_peers, reason = message.get("node"), message.get("peers"), message.get("reason")
        if not isinstance(node, int) or not _is_peer_list(raw_peers):
            return
        peers = raw_peers
        self._left[node] = (str(reason), time.monotonic())
        if "left" not in str(reason) and self._lost is None:
            self._lost = PeerLostError(f"node {node} ({describe_peers(peers)}) {reason}", peers)
            log.error("%s", self._lost)

    def close(self) -> None:
        """Leave the job (tell the orchestrator) and stop the heartbeats."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        else:
            self._stop_monitor()
            self._socket.close(0)
