"""The orchestrator daemon and its client: job membership, topology, heartbeats. No tensor data.

Protocol (one msgpack map per message, over a ROUTER socket; every message has ``t`` and ``job``):

node -> orchestrator                       orchestrator -> node
  register {num_nodes, address, peers,       topology {index, nodes: [{address, peers, info}], world}
            info}                            refused  {message}             (a RegistrationError)
  heartbeat {doing?} (from registration on)  pong                           (the job has formed)
                                             waiting  {num_nodes, nodes: [{address, peers}], refused,
                                                       silent, bad_token?}  (it has not formed yet)
                                             evicted  {reason}              (not, or no longer, a member)
  leave                                      lost     {node, peers, reason, gone: "left" | "lost",
                                                       doing}               (to the other nodes)
  doing {id, peers}                          doing    {id, doing}          (what those peers do)
  kv {id, op, ...}                           kv       {id, value(s) | error} (a key-value store)

The node side (registration, heartbeats) is transport.orchestrator_client.

A job forms when ``num_nodes`` nodes registered with the same ``num_nodes``, disjoint peer ids
that together are 0..world-1, and distinct addresses. Node indices follow the nodes' lowest peer
id, so the same nodes get the same indices whatever order they arrive in. Nodes send heartbeats
from the moment they register, so the nodes of a job may start minutes apart (until their
registration timeout); until the job forms, each heartbeat is answered with the registration
state (who registered, which registrations were refused and why, who went silent), which the
waiting nodes log and put in their timeout error. A node that sends nothing for ``lost_after``
seconds is declared lost and the other nodes of its job are told (before the job forms it is
just removed); a node that stops hearing answers declares the orchestrator lost the same way.
A node whose connection closes without a ``leave`` (its process exited, crashed or was killed:
the kernel closes its sockets) is declared lost at once (a socket monitor reports the close), not
after ``lost_after``; a partitioned or stopped node closes nothing and is found by its silence.
Jobs are told apart by name; one orchestrator serves many, at the same time and one after another.

``kv`` messages use key-value stores, named by their ``job`` and apart from the jobs
(transport.kv.store): torchrun's agents meet through one (collective.torch.rendezvous).

``doing`` is what a node's peers were doing at its last heartbeat, as [peer, text] pairs (each
process's flight recorder: the call it is in, or its last one, and the caller's line): a node
that times out waiting for peers asks for theirs, and a lost node's travels with the news.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import msgpack
import zmq

from collective.errors import RegistrationError, describe_peers
from collective.transport.kv.store import Stores
from collective.transport.logs import Throttle
from collective.transport.sockets import UNKNOWN_ADDRESS, connection_of, make_socket, watch_connections
from collective.transport.wire import WireError, decode_map

__all__ = [
    "DOING_TEXT",
    "HEARTBEAT_INTERVAL",
    "LOST_AFTER",
    "MAX_MESSAGE",
    "Orchestrator",
    "is_doing",
    "is_peer_list",
    "pack",
    "unpack",
]

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 0.25
DOING_TEXT = 1000  # the longest account of what a peer does that a heartbeat carries
LOST_AFTER = 2.0
MAX_MESSAGE = 1 << 20
RECEIVE_HWM = 64  # messages queued per connection (the loop drains them continuously)
SEND_HWM = 1000
REMEMBERED = 8  # refusals and silent nodes remembered per job that has not formed
MAX_LISTED = 64  # registered nodes listed in a waiting message
REMEMBERED_NODES = 4096  # nodes that left or were lost, remembered to tell them why if they come back


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(frame: bytes) -> dict[str, Any] | None:
    """A bounded msgpack map with a string ``t`` and ``job``, or None for anything else (binary
    values: a key-value store's)."""
    try:
        message = decode_map(
            frame, MAX_MESSAGE, "message", strings=4096, binary=MAX_MESSAGE, arrays=1 << 16, entries=64
        )
    except WireError:
        return None
    if not isinstance(message.get("t"), str) or not isinstance(message.get("job"), str):
        return None
    return message


def _peer_address(frame: zmq.Frame) -> str:
    """The IP address a message came from (ZeroMQ's message metadata), or "an unknown address"."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, UnicodeDecodeError):
        return UNKNOWN_ADDRESS


def is_doing(value: Any) -> TypeGuard[list[list[Any]]]:
    """[peer, text] pairs (what a node's peers do), each text at most DOING_TEXT characters."""
    return isinstance(value, list) and all(
        isinstance(pair, list)
        and len(pair) == 2
        and isinstance(pair[0], int)
        and isinstance(pair[1], str)
        and len(pair[1]) <= DOING_TEXT
        for pair in value
    )


def is_peer_list(value: Any) -> TypeGuard[list[int]]:
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
    doing: list[list[Any]] = field(default_factory=list)  # [peer, what it does] at its last heartbeat


@dataclass
class _Job:
    name: str
    num_nodes: int
    nodes: dict[bytes, _Node] = field(default_factory=dict)
    formed: bool = False
    # Until it forms, what went wrong (told to the waiting nodes): refused registrations and nodes
    # that registered and then went silent (they are removed: their peer ids and address are free).
    refused: deque[str] = field(default_factory=lambda: deque(maxlen=REMEMBERED))
    silent: deque[str] = field(default_factory=lambda: deque(maxlen=REMEMBERED))
    since: float = field(default_factory=time.monotonic)  # its first registration (refusals before: not its)

    def waiting(self) -> dict[str, Any]:
        """The registration state a waiting node is told (in answer to its heartbeats)."""
        nodes = sorted(self.nodes.values(), key=lambda n: n.peers[0])[:MAX_LISTED]
        return {
            "t": "waiting",
            "job": self.name,
            "num_nodes": self.num_nodes,
            "nodes": [{"address": n.address, "peers": n.peers} for n in nodes],
            "refused": list(self.refused),
            "silent": list(self.silent),
        }


class Orchestrator:
    """Serves jobs on ``tcp://host:port`` (port 0: a free port, see ``port``) until ``stop()``, or,
    ``until_done``, until the jobs it formed are over (every node left or was lost): rank 0's
    embedded one serves its own job only."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        lost_after: float = LOST_AFTER,
        token: str | None = None,
        until_done: bool = False,
    ) -> None:
        self._until_done = until_done
        self._formed_any = False
        self._context = zmq.Context()
        self._socket = make_socket(
            self._context,
            zmq.ROUTER,
            token=token,
            server=True,
            max_message=MAX_MESSAGE,
            receive_hwm=RECEIVE_HWM,
            send_hwm=SEND_HWM,
        )
        try:
            self.port = self._socket.bind_to_random_port(f"tcp://{host}") if port == 0 else port
            if port:
                self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._socket.close(0)
            self._context.destroy(linger=0)
            raise RegistrationError(f"the orchestrator cannot listen on {host}:{port}: {exc}") from exc
        self.address = f"{host}:{self.port}"
        self._fds: dict[int, bytes] = {}  # connection (its descriptor) -> the routing id it sent from
        self._closed: deque[int] = deque()  # connections that closed, from the watch's thread
        self._reused: dict[int, int] = {}  # closes already handled: their descriptor came back first
        self._watch = watch_connections(
            self._socket, f"orchestrator {self.address}", token is not None, self._closed.append
        )
        self._lost_after = lost_after
        self._jobs: dict[str, _Job] = {}
        self._stores = Stores()
        self._departed: OrderedDict[bytes, str] = OrderedDict()  # routing id -> why it left (latest last)
        self._stopping = threading.Event()
        # Random bytes parse as many ZMTP/1.0 messages: one line each would flood the log.
        self._malformed, self._ignored, self._refusals = Throttle(log), Throttle(log), Throttle(log)

    def stop(self) -> None:
        self._stopping.set()

    def stop_with_parent(self, parent: int) -> None:
        """Stop once the parent process ``parent`` has ended (this process is reparented):
        ``collective launch`` started it, and a launch killed outright (SIGKILL, the OOM killer)
        cannot stop it (it served nobody, forever)."""

        def watch() -> None:
            while not self._stopping.wait(0.5) and os.getppid() == parent:
                pass
            self.stop()

        threading.Thread(target=watch, name="collective-orchestrator-parent", daemon=True).start()

    def running_besides(self, peer: int) -> int:
        """Nodes of the jobs served here that neither left nor were lost, but the one of ``peer``."""
        nodes = [node for job in list(self._jobs.values()) for node in list(job.nodes.values())]
        return sum(1 for node in nodes if node.gone is None and peer not in node.peers)

    def serve(self) -> None:
        """Run until stop(); then close the socket."""
        log.info("orchestrator listening on %s", self.address)
        try:
            while not self._stopping.is_set():
                if self._socket.poll(50):
                    self._receive()
                if self._closed:
                    self._receive()  # (what a node sent before its connection closed comes first)
                    self._check_closed()
                self._check_heartbeats()
                for identity, answer in self._stores.expire():
                    self._send(identity, answer)
                for throttle in (self._malformed, self._ignored, self._refusals):
                    throttle.flush()
                if self._until_done and self._formed_any and not self._jobs:
                    break  # its job is over: nobody will register here again
        finally:
            for throttle in (self._malformed, self._ignored, self._refusals):
                throttle.flush(force=True)
            self._watch.stop()
            self._socket.close(0)
            self._context.destroy(linger=0)
            log.info("orchestrator on %s stopped", self.address)

    def _receive(self) -> None:
        """Handle every message waiting now."""
        while True:
            try:
                identity, *frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            fd = connection_of(identity)
            if fd is not None and self._fds.get(fd) != identity.bytes:
                held = self._fds.get(fd)
                if held is not None:  # a new connection has its descriptor: the old one closed (its
                    self._reused[fd] = self._reused.get(fd, 0) + 1  # report is still on the way)
                    self._disconnected(held)
                self._fds[fd] = identity.bytes
            self._handle(identity, frames)

    def _send(self, identity: bytes, message: dict[str, Any]) -> None:
        try:
            self._socket.send_multipart([identity, pack(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("could not answer %r: %s", identity, exc)

    def _handle(self, frame: zmq.Frame, frames: list[zmq.Frame]) -> None:
        identity = frame.bytes
        message = unpack(frames[0].bytes) if len(frames) == 1 else None
        if message is None:
            self._malformed.warning(
                "orchestrator %s refused a malformed message from %s (routing id %r)",
                self.address,
                _peer_address(frame),
                identity[:32],
            )
            return
        job = self._jobs.get(message["job"])
        node = job.nodes.get(identity) if job else None
        if node is not None:
            node.last_seen = time.monotonic()
        kind = message["t"]
        if kind == "register":
            self._register(identity, message)
        elif kind == "heartbeat":
            if node is not None and is_doing(message.get("doing")):
                node.doing = message["doing"]
            self._answer_heartbeat(identity, message["job"], job, node)
        elif kind == "doing" and job is not None and node is not None:
            asked = message.get("peers")
            wanted = set(asked) if is_peer_list(asked) else set()
            doing = [pair for other in job.nodes.values() for pair in other.doing if pair[0] in wanted]
            self._send(identity, {"t": "doing", "job": job.name, "id": message.get("id"), "doing": doing})
        elif kind == "kv":
            for recipient, answer in self._stores.handle(identity, message):
                self._send(recipient, answer)
        elif kind == "leave" and job is not None and node is not None:
            if job.formed:
                self._gone(job, node, "left the job", "left")
            else:  # gave up waiting: its peer ids and address are free again
                del job.nodes[identity]
                if not job.nodes:
                    del self._jobs[job.name]
        else:
            self._ignored.warning(
                "orchestrator %s ignored a %r message from %s (routing id %r)",
                self.address,
                kind[:32],
                _peer_address(frame),
                identity[:32],
            )

    def _answer_heartbeat(self, identity: bytes, name: str, job: _Job | None, node: _Node | None) -> None:
        """pong; the registration state while the job forms; or ``evicted`` to a node that is no member."""
        reply: dict[str, Any]
        if job is not None and node is not None and node.gone is None:
            reply = {"t": "pong", "job": name} if job.formed else job.waiting()
            if not job.formed:
                _, recent = self._watch.refused()  # (those before this job's first registration: not its)
                recent = [(when, peer) for when, peer in recent if when >= job.since]
                if recent:  # (the latest whose address was read: a refused connection may be gone first)
                    known = [peer for _, peer in recent if peer != UNKNOWN_ADDRESS] or [recent[-1][1]]
                    reply["bad_token"] = {"count": len(recent), "latest": known[-1]}
        elif node is not None:
            reply = {"t": "evicted", "job": name, "reason": f"it {node.gone}"}
        else:
            why = self._departed.get(identity, f"is not a node of job {name[:200]!r}")
            reply = {"t": "evicted", "job": name, "reason": f"it {why}"}
        self._send(identity, reply)

    def _refuse(self, identity: bytes, job: str, text: str) -> None:
        self._refusals.warning("orchestrator refused a node of job %r: %s", job[:200], text, key=job)
        waiting = self._jobs.get(job)
        if waiting is not None and not waiting.formed:
            waiting.refused.append(text)
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
            or not is_peer_list(peers)
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
        self._formed_any = True
        log.info("job %r formed: %d nodes, %d peers", job.name, len(nodes), len(every))

    def _gone(self, job: _Job, node: _Node, reason: str, how: str = "lost") -> None:
        """``node`` is out of ``job``: it ``left`` (finished cleanly) or was ``lost``; tell the others."""
        if node.gone is not None:
            return
        node.gone = reason
        self._departed[node.identity] = reason  # a node that comes back is told why it is out
        while len(self._departed) > REMEMBERED_NODES:
            self._departed.popitem(last=False)
        log.info("job %r: node at %s %s", job.name, node.address, reason)
        for other in job.nodes.values():
            if other is not node and other.gone is None:
                self._send(
                    other.identity,
                    {
                        "t": "lost",
                        "job": job.name,
                        "node": node.index,
                        "peers": node.peers,
                        "reason": reason,
                        "gone": how,
                        "doing": node.doing,
                    },
                )
        if all(n.gone is not None for n in job.nodes.values()):
            del self._jobs[job.name]

    def _check_closed(self) -> None:
        """Nodes whose connection closed since the last turn (what they sent before is handled)."""
        while self._closed:
            fd = self._closed.popleft()
            if self._reused.get(fd):  # (that close was handled when its descriptor came back)
                self._reused[fd] -= 1
                continue
            identity = self._fds.pop(fd, None)
            if identity is not None:
                self._disconnected(identity)

    def _disconnected(self, identity: bytes) -> None:
        """The node of ``identity`` closed its connection: lost, unless it left first."""
        self._stores.forget(identity)
        for job in list(self._jobs.values()):
            node = job.nodes.get(identity)
            if node is not None and node.gone is None:
                self._out(job, node, "closed its connection (its process exited, crashed or was killed)")

    def _out(self, job: _Job, node: _Node, why: str) -> None:
        """``node`` went away without leaving (``why``): lost (formed job), or removed from the
        waiting list, its peer ids and address free again, the others told it went silent."""
        if job.formed:
            self._gone(job, node, why)
            return
        text = f"node at {node.address} ({describe_peers(node.peers)}) registered, then {why}"
        log.warning("job %r: %s", job.name, text)
        job.silent.append(text)
        del job.nodes[node.identity]
        if not job.nodes:
            del self._jobs[job.name]

    def _check_heartbeats(self) -> None:
        """Nodes silent for ``lost_after``: lost (formed job) or removed from the waiting list (not formed).

        Waiting nodes send heartbeats too, so nodes of one job may start minutes apart; one that
        dies while it waits frees its peer ids and address, and the others are told it went silent.
        """
        now = time.monotonic()
        for job in list(self._jobs.values()):
            for node in list(job.nodes.values()):
                if node.gone is not None or now - node.last_seen <= self._lost_after:
                    continue
                self._out(job, node, f"stopped sending heartbeats ({self._lost_after:g}s)")
                if job.name not in self._jobs:
                    break
