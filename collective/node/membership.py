"""The node runtime: this process's membership of a multi-node job.

``NodeJob`` holds the orchestrator client (registration, heartbeats), this node's data service
and the topology, and offers the leaders of a step what the ThreePhase executor
(collective.executors.three_phase) needs: the call exchange, where every node of a group checks every
other node's call before any data moves (so a mismatch anywhere is the same error everywhere),
and a ZeroMQ Link among the group's nodes; and the facts about the job's processes that
collective.executors.choose decides a group's path from (hosts, rings).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import zmq

from collective.calls.fields import check_fields
from collective.calls.layout import Layout
from collective.calls.signature import Signature
from collective.config import CollectiveConfig
from collective.errors import CollectiveError, PeerLostError, describe_peers
from collective.node.call_exchange import CallExchange
from collective.node.messages import Messages
from collective.node.protocol import FINISHED_TAG, P2PMessage
from collective.shm.ring import HostRing
from collective.trace import RECORDER
from collective.transport.inproc import clone_error
from collective.transport.network import NodeNetwork
from collective.transport.orchestrator_client import OrchestratorClient, Topology
from collective.transport.outbox import Outbox
from collective.transport.shm_p2p import P2PSegment
from collective.transport.shm_ring import RingSegment
from collective.transport.wire import ErrorRecord, WireError
from collective.transport.zmq_link import ZmqLink

__all__ = ["Host", "NodeJob"]

Host = tuple[Any, Any]  # a host identity and a user: processes sharing both share /dev/shm

log = logging.getLogger(__name__)

ASK_DOING_WAIT = 0.5  # seconds a timed-out call waits to learn what the peers it waited for do

LEFT_GRACE = 1.0  # a node that left cleanly may still have data in flight: wait this long for it


class NodeJob:
    """This node's membership of ``config.job``: orchestrator client, data service, topology."""

    def __init__(
        self,
        config: CollectiveConfig,
        mailbox: Callable[[], Any] | None = None,
        info: Mapping[str, str | None] | None = None,
    ) -> None:
        """``info``: more of what the other nodes learn of this one at registration (strings)."""
        assert config.global_address is not None and config.data_service_port is not None
        self.config = config
        self._info = dict(info or {})
        self._mailbox = mailbox  # this process's point-to-point mailbox (collective.p2p)
        self._context: zmq.Context[Any] = zmq.Context()
        self._client = OrchestratorClient(
            self._context, config.global_address, config.job, token=config.token
        )
        try:
            self._network = NodeNetwork(
                self._context,
                config.job,
                config.node_host,
                config.data_service_port,
                self._lost,
                token=config.token,
            )
        except CollectiveError:
            self._client.close()
            self._context.destroy(linger=0)
            raise
        self._outbox = Outbox(partial(self._network.send, track=True), self._lost)  # point to point
        shm = os.environ.get("COLLECTIVE_SHM", "1") != "0"  # 0: no shared memory (the Shm executor, p2p)
        self._p2p_segment = P2PSegment.create() if shm else None
        self._messages = Messages(
            self._outbox, self._network, self._accept_p2p, self._p2p_segment, self._abandon_p2p
        )
        self.topology: Topology | None = None
        self.world = 0
        self._node_of: dict[int, int] = {}
        self._join_lock = threading.Lock()
        self._join_error: CollectiveError | None = None
        self._closed = False
        self._agreed: dict[int, int] = {}  # channel -> the last step whose calls every node agreed on
        self._local: frozenset[int] = frozenset()
        self._finished_peers: dict[int, float] = {}  # other nodes' peers that called finish(): when told
        self._ring_segment = RingSegment.create() if shm else None
        self._ring: HostRing | None = None

    # -- membership -----------------------------------------------------------------------------

    def join(self, local_peers: tuple[int, ...], deadline: float) -> None:
        """Register with the orchestrator once (the first local peer to get here does it)."""
        with self._join_lock:
            if self.topology is not None:
                return
            if self._join_error is not None:
                raise clone_error(self._join_error)
            try:
                topology = self._client.register(
                    self.config.num_nodes or 1,
                    self._network.address,
                    list(local_peers),
                    deadline,
                    {
                        **self._network.info,
                        "ring": None if self._ring_segment is None else self._ring_segment.name,
                        "p2p": None if self._p2p_segment is None else self._p2p_segment.name,
                        "uid": str(os.geteuid()),
                        **self._info,
                    },
                )
            except CollectiveError as exc:
                self._join_error = exc
                raise
            self._local = frozenset(local_peers)
            self._network.on_message(self._delivered)
            self._network.connect(topology.index, topology.addresses, topology.infos)
            self._node_of = {peer: node for node, peers in enumerate(topology.peers) for peer in peers}
            self.world = topology.world
            self.topology = topology
            here = [node for node in range(len(topology.infos)) if self.host_of(node) == self.host]
            names = {node: topology.infos[node].get("p2p") for node in here}
            self._messages.connect({n: name for n, name in names.items() if isinstance(name, str)}, len(here))
            log.info(
                "joined job %r as node %d of %d", self.config.job, topology.index, len(topology.addresses)
            )
            self._tell_doing(tuple(local_peers))

    def _tell_doing(self, local_peers: tuple[int, ...]) -> None:
        """What the local peers do goes out with every heartbeat, and what other nodes' peers do
        is asked of the orchestrator when a local call times out waiting for them (the flight
        recorder's accounts: collective.trace)."""
        client = self._client
        client.doing = lambda: [[peer, text] for peer, text in RECORDER.doing(local_peers).items()]
        RECORDER.remote = partial(client.ask_doing, wait=ASK_DOING_WAIT)

    def is_peer(self, peer: Any) -> bool:
        return isinstance(peer, int) and not isinstance(peer, bool) and peer in self._node_of

    def is_local(self, peer: int, local_peers: tuple[int, ...]) -> bool:
        return peer in local_peers

    def finished(self, peer: int) -> None:
        """Local peer ``peer`` called finish() while this node stays: the other nodes are told (after
        what it sent, on the same connections), so their waits for it end at once."""
        topology = self.topology
        assert topology is not None
        with self._join_lock:  # (the last local peer's close() waits: its sockets stay open meanwhile)
            for node, peers in enumerate(topology.peers) if not self._closed else ():
                notice = P2PMessage(peer, peers[0], FINISHED_TAG, (0,), "uint8")  # (to any peer there)
                if node != topology.index:
                    with contextlib.suppress(CollectiveError):  # (a node that is gone needs no notice)
                        self._messages.send(node, notice, np.empty(0, np.uint8), tcp=True)

    def _finished_among(self, peers: list[int], step: int) -> CollectiveError | None:
        """The error for a step whose call from ``peers``' node has not come, when one of them
        called finish(): the node's call never comes (a peer's finish waits for its own calls, and
        its notice travels after what its node sent before)."""
        now = time.monotonic()  # (after LEFT_GRACE, as for a node that left: a cause that ended the
        # peer's job, say the orchestrator's loss, reaches this node meanwhile and is named instead)
        finished = [peer for peer in peers if now - self._finished_peers.get(peer, now) > LEFT_GRACE]
        if not finished:
            return None
        return PeerLostError(
            f"step {step}: {describe_peers(finished)} called finish() (left the job), so the group's "
            f"step cannot complete; finish the remaining peers",
            finished,
        )

    def lost_peer(self, peer: int, orchestrator: bool = True) -> CollectiveError | None:
        """The error to raise for a peer that cannot send any more (its node lost or left), if any.

        ``orchestrator=False``: not the orchestrator's own loss. The Shm executor watches the
        processes of this host directly (pids, segments), so a group of this host goes on without
        an orchestrator, and its members all complete a step or all fail it.
        """
        if peer in self._finished_peers:
            return PeerLostError(f"peer {peer} called finish() (it left the job)", [peer])
        node = self._node_of.get(peer)
        return None if node is None else self._lost(node, orchestrator)

    # -- point to point ---------------------------------------------------------------------------

    def send_p2p(self, src: int, dst: int, tag: int, data: Any) -> None:
        """Send ``data`` (a numpy copy the caller no longer touches) from peer ``src`` to ``dst``:
        through shared memory or over TCP, delivered in the order sent (collective.node.messages)."""
        self._messages.send(self._node_of[dst], P2PMessage.of(src, dst, tag, data), data)

    def pump(self, seconds: float) -> None:
        """Let messages arrive for up to ``seconds`` (a receive that waits outside any collective)."""
        self._messages.pump(seconds)

    def _delivered(self, node: int, header: dict[str, Any], payload: Any) -> None:
        """A point-to-point message arrived from ``node`` over TCP (on the network's thread)."""
        try:
            message = P2PMessage.decode(header)
        except WireError as exc:
            log.warning("refused a point-to-point message from %s: %s", self._describe(node), exc)
            return
        self._messages.arrived(node, message, payload.buffer if payload is not None else b"")

    def _abandon_p2p(self, node: int, message: P2PMessage, chunk: Any) -> None:
        if self._mailbox is not None:
            self._mailbox().abandon(node, message)

    def _accept_p2p(self, node: int, message: P2PMessage, chunk: Any) -> None:
        """A message from ``node``, in its turn: into the mailbox. WireError: it does not fit."""
        if self._node_of.get(message.sender) != node or message.receiver not in self._local:
            raise WireError(f"peer {message.sender} -> {message.receiver} does not match node {node}")
        if message.tag == FINISHED_TAG:
            self._finished_peers[message.sender] = time.monotonic()
            if self._mailbox is not None:
                self._mailbox().wake()  # (a receive from it ends)
            return
        if self._mailbox is not None:
            self._mailbox().arrived(node, message, chunk)

    def close(self) -> None:
        """Leave the job and close every socket (once; later calls do nothing)."""
        with self._join_lock:
            if self._closed:
                return
            self._closed = True
        self._outbox.close(min(self.config.timeout, 60.0))  # what was sent goes out before we leave
        if getattr(RECORDER.remote, "func", None) == self._client.ask_doing:
            RECORDER.remote = None
        self._client.close()
        self._network.close()
        self._context.destroy(linger=0)
        self._messages.close()
        if self._ring is not None:
            self._ring.close()
        elif self._ring_segment is not None:
            self._ring_segment.close()

    @contextmanager
    def giving_up(self, members: tuple[int, ...], layout: Layout, step: int) -> Iterator[None]:
        """Around this node's global phase: if it fails, the other nodes hear of it at once.

        Without this, a leader that raised (say MemoryError) while its process lived on would leave
        the other nodes waiting until their timeout.
        """
        try:
            yield
        except BaseException as exc:
            # A verdict of the call exchange (a mismatch, a timeout) is reached by every node on its
            # own: an abort would only race it. Anything else, or a failure once data moves, is not.
            channel = self.channel(members)
            if self._agreed.get(channel) == step or not isinstance(exc, CollectiveError):
                nodes = list(layout.nodes)
                self._network.abort(step, ErrorRecord.of(exc), nodes, channel)
            raise

    def _lost(self, src: int, orchestrator: bool = True) -> CollectiveError | None:
        error = self._client.lost() if orchestrator else None
        if error is not None:
            return clone_error(error)
        left = self._client.left(src)
        if left is not None and time.monotonic() - left[1] > LEFT_GRACE:
            assert self.topology is not None
            return PeerLostError(f"{self.topology.describe(src)} {left[0]}", self.topology.peers[src])
        if self._network.closed(src):  # (what it sent before was handed over first: it sends no more)
            if orchestrator:  # (just after this process was paused, the orchestrator's verdict says why)
                self._client.settle()
                error = self._client.lost()
                if error is not None:
                    return clone_error(error)
            assert self.topology is not None
            why = "left the job" if left is not None else "its process exited, crashed or was killed"
            return PeerLostError(
                f"{self.topology.describe(src)} closed its connection to this node ({why})",
                self.topology.peers[src],
            )
        return None

    def _describe(self, node: int) -> str:
        assert self.topology is not None
        return self.topology.describe(node)

    # -- one step of a group ----------------------------------------------------------------------

    def channel(self, members: tuple[int, ...]) -> int:
        """The group's channel: 0 for the whole job, else a number all nodes derive from the members."""
        if len(members) == self.world and members[-1] == self.world - 1:
            return 0
        digest = hashlib.blake2b(repr(members).encode(), digest_size=7).digest()
        return 1 + int.from_bytes(digest, "big")

    # -- what choosing an executor needs to know (collective.executors.choose decides) ----------

    @property
    def host(self) -> Host:
        """This process's host: its identity and user (processes that share both share /dev/shm)."""
        assert self.topology is not None
        return self.host_of(self.topology.index)

    def nodes_of(self, members: tuple[int, ...]) -> list[int]:
        """The node of each member."""
        return [self._node_of[peer] for peer in members]

    def me_in(self, members: tuple[int, ...]) -> int:
        """The member that runs in this process (a group of one peer per process)."""
        assert self.topology is not None
        return members[self.nodes_of(members).index(self.topology.index)]

    def hosts_of(self, members: tuple[int, ...]) -> list[Host] | None:
        """Each member's host, when every member is the only one of its process in the group, this
        process among them, and every process has a ring segment; else None."""
        assert self.topology is not None
        nodes = self.nodes_of(members)
        if not self._one_process_each(nodes) or self.topology.index not in nodes:
            return None
        return [self.host_of(node) for node in nodes]

    def layout_of(self, members: tuple[int, ...]) -> Layout:
        """Where the group's ranks live, node by node."""
        assert self.topology is not None
        return Layout.of(members, self._node_of, self.topology.index)

    def _one_process_each(self, nodes: list[int]) -> bool:
        """Whether these nodes are distinct processes that each have a ring segment."""
        assert self.topology is not None
        infos = self.topology.infos
        return (
            self._ring_segment is not None
            and len(set(nodes)) == len(nodes)
            and all(node < len(infos) and isinstance(infos[node].get("ring"), str) for node in nodes)
        )

    def host_of(self, node: int) -> Host:
        """What tells node ``node``'s host: its host identity and user (one /dev/shm to share)."""
        assert self.topology is not None
        info = self.topology.infos[node] if node < len(self.topology.infos) else {}
        return info.get("host"), info.get("uid")

    def ring(self) -> HostRing:
        """This process's shared-memory ring (made when a group first needs it)."""
        assert self.topology is not None and self._ring_segment is not None
        with self._join_lock:
            if self._ring is None:
                infos, mine = self.topology.infos, self.host
                rings = {node: info.get("ring") for node, info in enumerate(infos)}
                here = sum(self.host_of(node) == mine for node in range(len(infos)))
                watched = partial(self.lost_peer, orchestrator=False)
                self._ring = HostRing(self._ring_segment, rings, self._node_of, watched, here)  # type: ignore[arg-type]
        return self._ring

    def link(
        self, members: tuple[int, ...], layout: Layout, step: int, agreed: Signature, deadline: float
    ) -> ZmqLink:
        """This node's end of step ``step`` among the group's nodes (link rank = node position)."""
        nodes = list(layout.nodes)
        return ZmqLink(
            self._network, step, check_fields(agreed), deadline, self._describe, nodes, self.channel(members)
        )

    def agree(
        self,
        members: tuple[int, ...],
        layout: Layout,
        step: int,
        mine: Signature | CollectiveError,
        small: Any,
        deadline: float,
    ) -> tuple[Signature, dict[int, Any]]:
        """Exchange calls with the group's other nodes; every node reaches the same verdict.

        ``mine`` is this node's locally agreed call, or the error its local step ended with.
        Returns the agreed call and the small contributions that came with the calls (by node
        position in the group). See collective.node.call_exchange.
        """
        assert self.topology is not None
        channel = self.channel(members)
        gone = partial(self._finished_among, step=step)
        exchange = CallExchange(self._network, layout, members, channel, gone)
        agreed, payloads = exchange.run(step, mine, small, deadline)
        self._agreed[channel] = step
        return agreed, payloads
