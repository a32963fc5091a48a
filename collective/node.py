"""The node runtime: this process's part of a multi-node job.

A collective runs in three phases (as burn-collective does):

1. the node's local peers reduce onto a local leader over the in-process link (all_reduce,
   reduce); the leader is the root when the root is on this node, else the lowest local peer;
2. the leaders run the global collective over ZeroMQ with the global strategy;
3. the leader broadcasts the result (or, for reduce, the all-clear) to its local peers.

Before phase 2 moves any data, the leaders exchange their calls all-to-all and each runs the
same ``agree()`` over them, so a mismatch anywhere is the same error on every node. Arrays of at
most ``SMALL_BYTES`` travel with that exchange and are combined in node order right away: a small
collective costs one round between nodes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from collective import errors
from collective.algorithms import strategies
from collective.algorithms.ops import Array, ReduceOp, array_module
from collective.arrays import Device, flat, new_result
from collective.calls import CallSpec, agree
from collective.config import CollectiveConfig
from collective.errors import CollectiveError, MismatchError, PeerLostError
from collective.fastpath import reduce_all
from collective.transport.inproc import InProcessLink, clone_error
from collective.transport.network import NodeNetwork
from collective.transport.orchestrator_client import OrchestratorClient, Topology
from collective.transport.wire import SMALL_BYTES, WireError, spec_from_header, spec_to_header
from collective.transport.zmq_link import ZmqLink

if TYPE_CHECKING:
    from collective.server import LocalJob, Plan

__all__ = ["SMALL_BYTES", "NodeJob", "PeerCall", "run_three_phases"]

log = logging.getLogger(__name__)

LEFT_GRACE = 1.0  # a node that left cleanly may still have data in flight: wait this long for it
VERDICT_GRACE = 1.0  # a node whose local step failed reports it just as its own deadline passes


class NodeJob:
    """This node's membership of ``config.job``: orchestrator client, data service, topology."""

    def __init__(self, config: CollectiveConfig) -> None:
        assert config.global_address is not None and config.data_service_port is not None
        self.config = config
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
        self.topology: Topology | None = None
        self.world = 0
        self._node_of: dict[int, int] = {}
        self._join_lock = threading.Lock()
        self._join_error: CollectiveError | None = None
        self._closed = False
        self._agreed_step = -1  # the last step whose calls every node agreed on

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
                    self._network.info,
                )
            except CollectiveError as exc:
                self._join_error = exc
                raise
            self._network.connect(topology.index, topology.addresses, topology.infos)
            self._node_of = {peer: node for node, peers in enumerate(topology.peers) for peer in peers}
            self.world = topology.world
            self.topology = topology
            log.info(
                "joined job %r as node %d of %d", self.config.job, topology.index, len(topology.addresses)
            )

    def is_peer(self, peer: Any) -> bool:
        return isinstance(peer, int) and not isinstance(peer, bool) and peer in self._node_of

    def close(self) -> None:
        """Leave the job and close every socket (once; later calls do nothing)."""
        with self._join_lock:
            if self._closed:
                return
            self._closed = True
        self._client.close()
        self._network.close()
        self._context.destroy(linger=0)

    @contextmanager
    def giving_up(self, step: int) -> Iterator[None]:
        """Around this node's global phase: if it fails, the other nodes hear of it at once.

        Without this, a leader that raised (say MemoryError) while its process lived on would leave
        the other nodes waiting until their timeout.
        """
        try:
            yield
        except BaseException as exc:
            # A verdict of the call exchange (a mismatch, a timeout) is reached by every node on its
            # own: an abort would only race it. Anything else, or a failure once data moves, is not.
            if self._agreed_step == step or not isinstance(exc, CollectiveError):
                self._network.abort(step, f"{type(exc).__name__}: {exc}")
            raise

    def _lost(self, src: int) -> CollectiveError | None:
        error = self._client.lost()
        if error is not None:
            return clone_error(error)
        left = self._client.left(src)
        if left is not None and time.monotonic() - left[1] > LEFT_GRACE:
            assert self.topology is not None
            return PeerLostError(f"{self.topology.describe(src)} {left[0]}", self.topology.peers[src])
        return None

    def _describe(self, node: int) -> str:
        assert self.topology is not None
        return self.topology.describe(node)

    def _who(self, nodes: list[int]) -> str:
        return ", ".join(self._describe(node) for node in nodes)

    # -- one collective -------------------------------------------------------------------------

    def agree(
        self, step: int, mine: CallSpec | CollectiveError, small: Array | None, deadline: float
    ) -> tuple[CallSpec, dict[int, Array | None]]:
        """Exchange calls with every other node; every node reaches the same verdict.

        ``mine`` is this node's locally agreed call, or the error its local step ended with.
        Returns the agreed call and the small arrays that came with the calls (by node).
        """
        network = self._network
        me = network.index
        header: dict[str, Any] = {"t": "call", "seq": step}
        if isinstance(mine, CollectiveError):
            header["verdict"] = {"class": type(mine).__name__, "message": str(mine)}
        else:
            header.update(spec_to_header(mine))
            if small is not None:
                header["small"] = small.tobytes()
        for other in range(network.size):
            if other != me:
                network.send(other, header)
        calls: dict[int, CallSpec] = {}
        payloads: dict[int, Array | None] = {me: small}
        verdicts: list[tuple[int, dict[str, Any]]] = [(me, header["verdict"])] if "verdict" in header else []
        for other in range(network.size):
            if other == me:
                continue
            theirs, _ = network.receive(
                other, step, deadline + VERDICT_GRACE, f"the call of {self._describe(other)}"
            )
            if theirs["seq"] != step or theirs["t"] != "call":
                raise MismatchError(
                    f"step {step}: {self._describe(other)} sent a {theirs['t']} message of step "
                    f"{theirs['seq']}: the nodes called different numbers of collectives"
                )
            if isinstance(theirs.get("verdict"), dict):
                verdicts.append((other, theirs["verdict"]))
                continue
            try:
                calls[other] = spec_from_header(theirs)
            except WireError as exc:
                raise MismatchError(
                    f"step {step}: {self._describe(other)} sent an unusable call: {exc}"
                ) from None
            small_bytes = theirs.get("small")
            payloads[other] = small_bytes if isinstance(small_bytes, bytes) else None
        if verdicts:
            raise _verdict_error(step, verdicts, self._describe)
        assert not isinstance(mine, CollectiveError)
        calls[me] = mine
        agreed = agree(calls, f"#{step}", who=self._who)
        self._agreed_step = step
        return agreed, payloads

    def move(
        self, step: int, agreed: CallSpec, acc: Array, payloads: dict[int, Array | None], deadline: float
    ) -> None:
        """Phase 2 after ``agree``: combine or move the node's flat array ``acc`` in place.

        ``acc`` holds the node's locally reduced array (all_reduce, reduce), the root's array or
        the receive buffer (broadcast). Small arrays already came with the calls.
        """
        me = self._network.index
        root_node = self._node_of[agreed.root] if agreed.root is not None else 0
        if agreed.kind == "broadcast":
            if payloads.get(root_node) is not None:
                if me != root_node:
                    _copy_payload(acc, payloads[root_node])
                return
        elif payloads.get(me) is not None:  # every node sent its array with its call
            if agreed.kind == "all_reduce" or me == root_node:
                self._combine_small(agreed, acc, payloads)
            return
        config = self.config
        op = agreed.op or ReduceOp.SUM
        link = ZmqLink(self._network, step, agreed, deadline, self._describe)
        if agreed.kind == "all_reduce":
            strategies.all_reduce(config.global_all_reduce_strategy, link, acc, acc, op)
        elif agreed.kind == "reduce":
            strategies.reduce(
                config.global_reduce_strategy, link, root_node, acc, acc if me == root_node else None, op
            )
        else:
            strategies.broadcast(config.global_broadcast_strategy, link, root_node, acc)
        link.flush()

    def _combine_small(self, agreed: CallSpec, acc: Array, payloads: dict[int, Array | None]) -> None:
        """Combine every node's array in node order, so every node computes the same bits."""
        me = self._network.index
        op = agreed.op or ReduceOp.SUM
        host = acc if isinstance(acc, np.ndarray) else acc.get()
        arrays = [host if node == me else _view(payloads[node], host) for node in range(self._network.size)]
        _copy_payload(acc, reduce_all(op, arrays))


def _view(payload: Any, like: Array) -> np.ndarray:
    """A small array (bytes from a call header) as ``like``'s dtype and size, its length checked first."""
    dtype = np.dtype(like.dtype)
    data = memoryview(payload).cast("B")
    if len(data) != like.size * dtype.itemsize:
        raise MismatchError(f"a small array of {len(data)} bytes arrived for {like.size} elements of {dtype}")
    return np.frombuffer(data, dtype) if like.size else np.empty(0, dtype)


def _copy_payload(acc: Array, payload: Any) -> None:
    view = payload if isinstance(payload, np.ndarray) else _view(payload, acc)
    if isinstance(acc, np.ndarray):
        np.copyto(acc, view)
    else:
        acc.set(view)


def _verdict_error(step: int, verdicts: list[tuple[int, dict[str, Any]]], describe: Any) -> CollectiveError:
    """The error of a step that failed locally on some node: its class, every node's message."""
    cls = getattr(errors, str(verdicts[0][1].get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, CollectiveError)):
        cls = CollectiveError
    text = "; ".join(f"{describe(node)}: {verdict.get('message')}" for node, verdict in verdicts)
    return cls(f"step {step} failed: {text}")


@dataclass(frozen=True)
class PeerCall:
    """One local peer's side of one multi-node collective, as the runtime prepared it."""

    peer: int
    plan: Plan
    src: Array | None  # flat input (None for a broadcast receiver)
    device: Device
    shape: tuple[int, ...] | None  # of the input (None for broadcast: the agreed call says)
    dtype: Any
    out: Array | None
    deadline: float


def run_three_phases(node: NodeJob, job: LocalJob, mine: PeerCall) -> Array | None:
    """This peer's part of one multi-node collective: the result (None off a reduce's root)."""
    peer, plan, src, device, out, deadline = (
        mine.peer,
        mine.plan,
        mine.src,
        mine.device,
        mine.out,
        mine.deadline,
    )
    shape, dtype = mine.shape, mine.dtype
    step, call = plan.step, plan.call
    if plan.error is not None:  # this peer reports the step's local failure to the other nodes
        node.agree(step, plan.error, None, deadline)
        raise plan.error  # not reached: agree() raises the shared verdict
    if plan.exchange is None:  # the only local peer: no local phases
        return _alone(node, mine)
    exchange = plan.exchange
    local = InProcessLink(exchange, job.index[peer], deadline)
    leader = call.root if call.root in job.index else job.peer_ids[0]
    lead, leading = job.index[leader], peer == leader
    config = job.config
    try:
        if call.kind == "broadcast":
            if leading:
                with node.giving_up(step):
                    small = src if src is not None and src.nbytes <= SMALL_BYTES else None
                    agreed, payloads = node.agree(step, call, small, deadline)
                    exchange.announce(agreed)
                    assert agreed.shape is not None  # the global agreement found the root's array
                    result = new_result(device, agreed.shape, agreed.dtype, out)
                    node.move(step, agreed, src if src is not None else flat(result), payloads, deadline)
                if src is not None:
                    flat(result)[...] = src
            else:
                agreed = exchange.announcement(job.index[peer], deadline, f"the leader of {plan.label}")
                assert agreed.shape is not None
                result = new_result(device, agreed.shape, agreed.dtype, out)
            strategies.broadcast(config.local_broadcast_strategy, local, lead, flat(result))
            local.flush()
            return result
        assert src is not None and shape is not None and call.op is not None
        wanted = call.kind == "all_reduce" or peer == call.root
        result = new_result(device, shape, dtype, out) if wanted else None
        acc = None
        if leading:
            acc = flat(result) if result is not None else array_module(src).empty_like(src)
        strategies.reduce(config.local_reduce_strategy, local, lead, src, acc, call.op)  # phase 1
        if leading:
            assert acc is not None
            with node.giving_up(step):  # phase 2
                agreed, payloads = node.agree(
                    step, call, acc if acc.nbytes <= SMALL_BYTES else None, deadline
                )
                node.move(step, agreed, acc, payloads, deadline)
        done = flat(result) if call.kind == "all_reduce" else np.empty(0, np.uint8)
        strategies.broadcast(config.local_broadcast_strategy, local, lead, done)  # phase 3
        local.flush()
        return result
    except CollectiveError as exc:
        exchange.abort(exc)
        raise


def _alone(node: NodeJob, mine: PeerCall) -> Array | None:
    """Phase 2 only, for a node with one peer (phases 1 and 3 would only copy)."""
    with node.giving_up(mine.plan.step):
        return _global_only(node, mine)


def _global_only(node: NodeJob, mine: PeerCall) -> Array | None:
    src, device, out, deadline = mine.src, mine.device, mine.out, mine.deadline
    step, call = mine.plan.step, mine.plan.call
    if call.kind == "broadcast":
        small = src if src is not None and src.nbytes <= SMALL_BYTES else None
        agreed, payloads = node.agree(step, call, small, deadline)
        assert agreed.shape is not None
        result = new_result(device, agreed.shape, agreed.dtype, out)
        node.move(step, agreed, src if src is not None else flat(result), payloads, deadline)
        if src is not None:
            flat(result)[...] = src
        return result
    assert src is not None
    wanted = call.kind == "all_reduce" or call.root == mine.peer
    assert mine.shape is not None
    result = new_result(device, mine.shape, mine.dtype, out) if wanted else None
    acc = src  # a node that is not the root only reads its input
    if result is not None:
        acc = flat(result)
        acc[...] = src
    agreed, payloads = node.agree(step, call, acc if acc.nbytes <= SMALL_BYTES else None, deadline)
    node.move(step, agreed, acc, payloads, deadline)
    return result
