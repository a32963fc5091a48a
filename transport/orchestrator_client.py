"""A node's connection to the orchestrator: registration, then heartbeats on a background thread.

See transport.orchestrator for the protocol. The client turns a refusal into RegistrationError,
a failed handshake (wrong or missing job token) into RegistrationError at once, no answer into
CollectiveTimeout at the deadline, and a lost node or orchestrator into the PeerLostError that
every wait of the node's collectives then raises.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from collective.calls import describe_peers
from collective.errors import CollectiveError, CollectiveTimeout, PeerLostError, RegistrationError
from collective.transport.auth import HANDSHAKE_FAILED, handshake_failure
from collective.transport.orchestrator import (
    HEARTBEAT_INTERVAL,
    LOST_AFTER,
    MAX_MESSAGE,
    is_peer_list,
    pack,
    unpack,
)
from collective.transport.sockets import make_socket

__all__ = ["OrchestratorClient", "Topology"]

log = logging.getLogger(__name__)

CLIENT_HWM = 64  # control messages queued each way


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
        self._socket = make_socket(
            context, zmq.DEALER, token=token, server=False, max_message=MAX_MESSAGE,
            receive_hwm=CLIENT_HWM, send_hwm=CLIENT_HWM, linger=0.5,
        )  # fmt: skip
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
            pack(
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
                self._socket.send(pack({"t": "leave", "job": self.job}))
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
            message = unpack(self._socket.recv())
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
                with contextlib.suppress(zmq.Again):  # a full queue: the orchestrator is not reading
                    self._socket.send(pack({"t": "heartbeat", "job": self.job}), zmq.NOBLOCK)
                next_beat = now + HEARTBEAT_INTERVAL
            if self._socket.poll(int(1000 * HEARTBEAT_INTERVAL / 2)):
                message = unpack(self._socket.recv())
                if message is not None and message["job"] == self.job:
                    last_heard = time.monotonic()
                    if message["t"] == "lost":
                        self._node_gone(message)
            elif time.monotonic() - last_heard > self._lost_after and self._lost is None:
                self._lost = PeerLostError(
                    f"the orchestrator at {self.address} stopped answering ({self._lost_after:g}s)"
                )
                log.error("%s", self._lost)
        self._socket.send(pack({"t": "leave", "job": self.job}))
        self._socket.close()

    def _node_gone(self, message: dict[str, Any]) -> None:
        node, raw_peers, reason = message.get("node"), message.get("peers"), message.get("reason")
        if not isinstance(node, int) or not is_peer_list(raw_peers):
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
