"""A node's connection to the orchestrator: registration, then heartbeats on a background thread.

See transport.orchestrator for the protocol. The client turns a refusal into RegistrationError,
a failed handshake (wrong or missing job token) into RegistrationError at once, no topology by
the deadline into CollectiveTimeout naming who registered, who is missing and which registrations
were refused and why, and a lost node or orchestrator into the PeerLostError that every wait of
the node's collectives then raises.

Heartbeats start at registration: while the job forms, each is answered with the registration
state, which the node logs every ``WAITING_LOG_EVERY`` seconds. Once the job formed, the heartbeat
thread watches its own loop too: a gap longer than the loss threshold means this process did not
run (SIGSTOP, a debugger, a starved machine), not that the orchestrator stopped answering. It
then checks with the orchestrator: if the orchestrator declared this node lost meanwhile, the
error says this node was suspended; if not, the job goes on.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from collective.errors import (
    CollectiveError,
    CollectiveTimeout,
    PeerLostError,
    RegistrationError,
    describe_peers,
)
from collective.transport.auth import HANDSHAKE_FAILED, handshake_failure
from collective.transport.orchestrator import (
    DOING_TEXT,
    HEARTBEAT_INTERVAL,
    LOST_AFTER,
    MAX_MESSAGE,
    is_doing,
    is_peer_list,
    pack,
    unpack,
)
from collective.transport.sockets import make_socket

__all__ = ["WAITING_LOG_EVERY", "OrchestratorClient", "Topology", "describe_waiting"]

log = logging.getLogger(__name__)

CLIENT_HWM = 64  # control messages queued each way
WAITING_LOG_EVERY = 3.0  # seconds between "still waiting for ..." lines while the job forms
ASKED_POLL = 0.01  # the heartbeat thread's poll (seconds) while a question waits for its answer
PAUSED = 0.5  # a heartbeat loop turn this much longer than it should take: this process did not run
SETTLE = 1.0  # seconds ``settle`` gives the heartbeat thread to come back from a pause and hear why


@dataclass(frozen=True)
class Topology:
    index: int
    addresses: list[str]
    peers: list[list[int]]
    world: int
    infos: list[dict[str, Any]] = field(default_factory=list)  # per node: host identity, shared memory

    def describe(self, node: int, among: Collection[int] | None = None) -> str:
        """'node 1 (peers 2-3)': the node's peers, or those of them ``among`` a group's members."""
        peers = self.peers[node] if among is None else [p for p in self.peers[node] if p in among]
        return f"node {node} ({describe_peers(peers)})"


def _texts(value: Any) -> list[str]:
    return [str(v)[:1000] for v in value[:16]] if isinstance(value, list) else []


def describe_waiting(state: dict[str, Any], num_nodes: int) -> tuple[str, tuple[int, ...]]:
    """What a ``waiting`` message says, in words, and the peer ids known (or assumed) to be missing.

    Peer ids are missing for sure where they are gaps below the highest one claimed; beyond it they
    are assumed from the registered nodes' size when every registered node has the same number of
    peers (the text says so).
    """
    nodes = [
        (str(n.get("address"))[:100], n["peers"])
        for n in state.get("nodes", [])
        if isinstance(n, dict) and is_peer_list(n.get("peers"))
    ]
    claimed = {p for _, peers in nodes for p in peers}
    parts = [f"{len(nodes)} of {num_nodes} nodes registered"]
    if nodes:
        parts[0] += ": " + ", ".join(f"node at {a} ({describe_peers(p)})" for a, p in nodes)
    missing: list[int] = []
    absent = num_nodes - len(nodes)
    if absent > 0:
        top = max(claimed) + 1 if claimed else 0
        missing = [p for p in range(top) if p not in claimed]
        sizes = {len(peers) for _, peers in nodes}
        assumed = ""
        if len(sizes) == 1:
            (size,) = sizes
            missing += list(range(top, num_nodes * size)) if num_nodes * size > top else []
            assumed = f" if every node has {size} peer{'s' if size > 1 else ''}"
        text = f"missing: {absent} node{'s' if absent > 1 else ''}"
        if missing:
            text += f" ({describe_peers(missing)}{assumed})"
        parts.append(text)
    refused = _texts(state.get("refused"))
    if refused:
        parts.append("refused: " + "; ".join(refused))
    silent = _texts(state.get("silent"))
    if silent:
        parts.append("gone: " + "; ".join(silent))
    bad = state.get("bad_token")
    if isinstance(bad, dict) and isinstance(bad.get("count"), int):
        parts.append(
            f"the orchestrator refused {bad['count']} connection(s) with a wrong or missing job token "
            f"(the latest from {str(bad.get('latest'))[:100]})"
        )
    return "; ".join(parts), tuple(missing)


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
        # A routing id of its own: a reconnection (a network blip) keeps this node's identity.
        self._socket = make_socket(
            context,
            zmq.DEALER,
            token=token,
            server=False,
            max_message=MAX_MESSAGE,
            receive_hwm=CLIENT_HWM,
            send_hwm=CLIENT_HWM,
            linger=0.5,
            routing_id=b"node:" + uuid.uuid4().bytes,
        )
        self._monitor: zmq.Socket[Any] | None = self._socket.get_monitor_socket(HANDSHAKE_FAILED)
        self._socket.connect(f"tcp://{address}")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: CollectiveError | None = None
        # The heartbeat loop's last turn, and whether it is asking the orchestrator about a pause of
        # this process (``settle`` waits for both: the Condition is notified every turn).
        self._turns = threading.Condition()
        self._turned = time.monotonic()
        self._checking = False
        self._left: dict[int, tuple[str, float]] = {}  # node index -> (reason, when)
        self.topology: Topology | None = None
        # What this node's peers do, sent with every heartbeat once the job formed ([peer, text]
        # pairs; the node sets it: its flight recorder's account); and the questions of what
        # other peers do, asked by any thread, sent and answered on the heartbeat thread.
        self.doing: Callable[[], list[list[Any]]] | None = None
        self._asks: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._answers: dict[int, tuple[threading.Event, list[Any]]] = {}
        self._asked = itertools.count()

    def _post(self, message: dict[str, Any]) -> None:
        """Send without ever blocking: a full queue means the orchestrator is not reading anyway."""
        with contextlib.suppress(zmq.Again):
            self._socket.send(pack({**message, "job": self.job}), zmq.NOBLOCK)

    def register(
        self,
        num_nodes: int,
        address: str,
        peers: list[int],
        deadline: float,
        info: dict[str, Any] | None = None,
    ) -> Topology:
        """Register this node and wait for the topology (CollectiveTimeout, RegistrationError)."""
        registration = {
            "t": "register",
            "num_nodes": num_nodes,
            "address": address,
            "peers": peers,
            "info": info or {},
        }
        self._post(registration)
        try:
            return self._await_topology(registration, deadline)
        finally:
            self._stop_monitor()

    def _stop_monitor(self) -> None:
        if self._monitor is not None:
            self._socket.disable_monitor()
            self._monitor.close(0)
            self._monitor = None

    def _await_topology(self, registration: dict[str, Any], deadline: float) -> Topology:
        assert self._monitor is not None
        monitor = self._monitor
        num_nodes = registration["num_nodes"]
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        started = time.monotonic()
        next_beat = started + HEARTBEAT_INTERVAL
        next_log = started + WAITING_LOG_EVERY
        state: dict[str, Any] | None = None  # the latest registration state the orchestrator sent
        heard: float | None = None  # when it last answered (a heartbeat, say); None: not yet
        looked = started
        while True:
            now = time.monotonic()
            if heard is not None and now - looked > self._lost_after:  # this process was suspended:
                heard = now  # that gap is no silence of the orchestrator's
            looked = now
            if now >= deadline:
                self._post({"t": "leave"})
                raise self._timeout(state, num_nodes, now - started)
            if heard is not None and now - heard > self._lost_after:  # it answers every heartbeat
                raise PeerLostError(
                    f"the orchestrator at {self.address} stopped answering ({self._lost_after:g}s) while "
                    f"this node waited for the others to register (under init(), rank 0's process hosts "
                    f"it: did it die?)",
                    (),
                )
            if now >= next_beat:
                self._post({"t": "heartbeat"})
                next_beat = now + HEARTBEAT_INTERVAL
            if state is not None and now >= next_log:
                log.warning(
                    "job %r: waiting %.0fs for the other nodes: %s",
                    self.job,
                    now - started,
                    describe_waiting(state, num_nodes)[0],
                )
                next_log = now + WAITING_LOG_EVERY
            ready = dict(poller.poll(int(1000 * max(0.0, min(deadline, next_beat) - now))))
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
            heard = time.monotonic()
            if message["t"] == "refused":
                raise RegistrationError(
                    f"the orchestrator at {self.address} refused this node: {message.get('message')}"
                )
            if message["t"] == "waiting":
                state = message
            elif message["t"] == "evicted":  # it went silent here (suspended?) and was removed: again
                log.warning("job %r: registering again (%s)", self.job, message.get("reason"))
                self._post(registration)
            elif message["t"] == "topology":
                return self._formed(message)

    def _timeout(self, state: dict[str, Any] | None, num_nodes: int, waited: float) -> CollectiveTimeout:
        if state is None:
            return CollectiveTimeout(
                f"register: no topology from the orchestrator at {self.address} for job {self.job!r} "
                f"after {waited:.0f}s: it never answered (is it running at that address?)"
            )
        text, missing = describe_waiting(state, num_nodes)
        return CollectiveTimeout(
            f"register: no topology from the orchestrator at {self.address} for job {self.job!r} "
            f"after {waited:.0f}s: not all {num_nodes} nodes registered: {text}",
            missing,
        )

    def _formed(self, message: dict[str, Any]) -> Topology:
        nodes = message["nodes"]
        self.topology = Topology(
            message["index"],
            [n["address"] for n in nodes],
            [n["peers"] for n in nodes],
            message["world"],
            [n.get("info") or {} for n in nodes],
        )
        self._thread = threading.Thread(target=self._heartbeat, name="collective-heartbeat", daemon=True)
        self._thread.start()
        return self.topology

    def lost(self) -> CollectiveError | None:
        """The error that broke the job (a node or the orchestrator lost), if any."""
        return self._lost

    def settle(self, wait: float = SETTLE) -> None:
        """Give the heartbeat thread, when it has not run for a while (this process was stopped, or
        starved), the time to run and, when it found this process paused past the loss threshold,
        to hear the orchestrator's answer: at most ``wait`` seconds. A failure found just after a
        pause (another node's connection closed meanwhile) is then named by ``lost()`` for what it
        was: this node declared lost while it did not run."""
        deadline = time.monotonic() + wait
        with self._turns:
            while self._checking or time.monotonic() - self._turned > PAUSED:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._thread is None or not self._thread.is_alive():
                    return
                self._turns.wait(remaining)

    def left(self, node: int) -> tuple[str, float] | None:
        """(reason, when) if ``node`` left the job or was lost."""
        return self._left.get(node)

    def _heartbeat(self) -> None:
        poll = HEARTBEAT_INTERVAL / 2
        last_heard = previous = time.monotonic()
        next_beat = 0.0
        suspended = 0.0  # the last gap longer than lost_after in this thread's own loop (seconds)
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._post(self._beat())
                next_beat = now + HEARTBEAT_INTERVAL
            while not self._asks.empty():
                self._post(self._asks.get())
            ready = self._socket.poll(int(1000 * (ASKED_POLL if self._answers else poll)))
            now = time.monotonic()
            gap, previous = now - previous - poll, now
            if gap > PAUSED:  # this process did not run (SIGSTOP, a debugger, a starved machine)
                last_heard += gap  # time it did not run does not count against the orchestrator
                if gap > self._lost_after:
                    suspended, next_beat = gap + poll, 0.0
                    self._checking = True  # (until the answer to the next heartbeat)
                    log.warning(
                        "this node did not run for %.1f s (suspended?): checking with the orchestrator",
                        suspended,
                    )
            if ready:
                message = unpack(self._socket.recv())
                if message is not None and message["job"] == self.job:
                    last_heard = time.monotonic()
                    if message["t"] == "lost":
                        self._node_gone(message)
                    elif message["t"] == "doing":
                        self._answered(message)
                    elif message["t"] == "evicted":
                        self._evicted(message, suspended)
                    if message["t"] in ("pong", "evicted"):  # a heartbeat's answer
                        self._checking = False
            elif now - last_heard > self._lost_after:
                self._fail(
                    PeerLostError(
                        f"the orchestrator at {self.address} stopped answering ({self._lost_after:g}s)"
                    )
                )
            with self._turns:
                self._turned = now
                self._turns.notify_all()
        self._post({"t": "leave"})
        self._socket.close()

    def _beat(self) -> dict[str, Any]:
        """A heartbeat, with what this node's peers do (a failure to say is no reason to skip it)."""
        beat: dict[str, Any] = {"t": "heartbeat"}
        if self.doing is not None:
            with contextlib.suppress(Exception):
                beat["doing"] = [[peer, text[:DOING_TEXT]] for peer, text in self.doing()]
        return beat

    def ask_doing(self, peers: list[int], wait: float) -> dict[int, str]:
        """What ``peers`` (of other nodes) were doing at their node's last heartbeat, as far as the
        orchestrator answers within ``wait`` seconds (any thread)."""
        number = next(self._asked)
        done, found = threading.Event(), list[list[Any]]()
        self._answers[number] = (done, found)
        try:
            self._asks.put({"t": "doing", "id": number, "peers": peers, "job": self.job})
            done.wait(wait)
        finally:
            self._answers.pop(number, None)
        return {peer: text for peer, text in found if peer in peers}

    def _answered(self, message: dict[str, Any]) -> None:
        waiting = self._answers.get(message.get("id"))  # type: ignore[arg-type]
        if waiting is not None and is_doing(message.get("doing")):
            waiting[1].extend(message["doing"])
            waiting[0].set()

    def _fail(self, error: PeerLostError) -> None:
        if self._lost is None:
            self._lost = error
            log.error("%s", error)

    def _evicted(self, message: dict[str, Any], suspended: float) -> None:
        """The orchestrator no longer counts this node in the job (it declared it lost)."""
        reason = str(message.get("reason"))[:300]
        assert self.topology is not None
        peers = self.topology.peers[self.topology.index]
        if suspended:
            text = (
                f"this node was suspended for {suspended:.1f} s; the orchestrator declared it lost ({reason})"
            )
        else:
            text = f"the orchestrator at {self.address} declared this node lost ({reason})"
        self._fail(PeerLostError(text, peers))

    def _node_gone(self, message: dict[str, Any]) -> None:
        node, raw_peers, reason = message.get("node"), message.get("peers"), message.get("reason")
        if not isinstance(node, int) or not is_peer_list(raw_peers):
            return
        peers = raw_peers
        self._left[node] = (str(reason), time.monotonic())
        if message.get("gone") != "left":  # lost: it died or went silent
            doing = message.get("doing")
            said = (
                "".join(f"; peer {p} {text} (at its last heartbeat)" for p, text in doing)
                if is_doing(doing)
                else ""
            )
            self._fail(PeerLostError(f"node {node} ({describe_peers(peers)}) {reason}{said}", peers))

    def close(self) -> None:
        """Leave the job (tell the orchestrator) and stop the heartbeats."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        else:
            self._stop_monitor()
            self._socket.close(0)
