"""One conformance suite for the Link protocol, run against every Link implementation.

The in-process link, the recording link of the algorithm tests (so the simulation behaves like
the real thing) and the ZeroMQ link between data services (over TCP, and through shared memory
for large chunks between nodes of one host) all pass the same checks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from collective.algorithms.ops import ReduceOp
from collective.errors import CollectiveTimeout, PeerLostError
from collective.transport.inproc import COPY_BELOW, Exchange, InProcessLink
from collective.transport.network import NodeNetwork
from collective.transport.zmq_link import ZmqLink
from tests.recording import Network, run_links


def inproc_links(n: int, timeout: float = 10.0) -> list[Any]:
    exchange = Exchange(tuple(range(n)), "test #0")
    deadline = time.monotonic() + timeout
    return [InProcessLink(exchange, rank, deadline) for rank in range(n)]


class ZmqMesh:
    """``n`` data services on 127.0.0.1 connected in a mesh, one ZmqLink each (closed by ``close``).

    With ``shared`` the nodes know they share a host, so large chunks go through shared memory.
    A node is lost to the others once ``lost`` holds an error for it.
    """

    def __init__(self, n: int, shared: bool, timeout: float = 10.0) -> None:
        self.context: Any = zmq.Context()
        self.lost: dict[int, PeerLostError] = {}
        self.networks = [
            NodeNetwork(self.context, "conformance", "127.0.0.1", 0, self.lost.get) for _ in range(n)
        ]
        addresses = [network.address for network in self.networks]
        infos = [network.info for network in self.networks] if shared else None
        for index, network in enumerate(self.networks):
            network.connect(index, addresses, infos)
        deadline = time.monotonic() + timeout
        signature = {"kind": "all_reduce", "op": "sum", "root": None, "shape": [1], "dtype": "float64"}
        self.links = [ZmqLink(network, 0, signature, deadline) for network in self.networks]

    def close(self) -> None:
        for network in self.networks:
            network.close()
        self.context.destroy(linger=0)


LINKS: dict[str, Callable[[int], Any]] = {
    "inproc": inproc_links,
    "recording": lambda n: Network(n).links(),
    "zmq": lambda n: ZmqMesh(n, shared=False),
    "zmq-shm": lambda n: ZmqMesh(n, shared=True),
}


@pytest.fixture(params=list(LINKS))
def make_links(request: pytest.FixtureRequest) -> Callable[[int], list[Any]]:
    def make(n: int) -> list[Any]:
        made = LINKS[request.param](n)
        if isinstance(made, ZmqMesh):
            request.addfinalizer(made.close)
            return made.links
        return list(made)

    return make


@pytest.mark.parametrize("length", [0, 1, 5, COPY_BELOW // 8 + 1])  # empty, small (copied), large (lent)
def test_messages_between_a_pair_arrive_in_order(make_links: Any, length: int) -> None:
    sent = [np.arange(length, dtype=np.float64) + 1000 * k for k in range(3)]

    def body(link: Any) -> list[np.ndarray]:
        if link.rank == 0:
            for array in sent:
                link.send(1, array)
            return []
        received = []
        for _ in sent:
            out = np.empty(length)
            link.recv_into(0, out)
            received.append(out)
        return received

    received = run_links(make_links(2), body)[1]
    for got, want in zip(received, sent, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", list(ReduceOp))
def test_recv_reduce_combines_message_and_operand(make_links: Any, op: ReduceOp) -> None:
    a, b = np.array([1.0, -2.0, 3.0]), np.array([4.0, 5.0, -6.0])
    if op.ufunc_name.startswith("bitwise"):  # integers only
        a, b = a.astype(np.int64), b.astype(np.int64)
    ufunc = getattr(np, op.ufunc_name)

    def body(link: Any) -> Any:
        if link.rank == 0:
            link.send(1, a)
            return None
        out = np.empty(3, b.dtype)
        link.recv_reduce(0, b, out, op)
        in_place = b.copy()
        link.recv_reduce(0, in_place, in_place, op)
        return out, in_place

    def twice(link: Any) -> Any:
        if link.rank == 0:
            link.send(1, a)
        return body(link)

    out, in_place = run_links(make_links(2), twice)[1]
    np.testing.assert_array_equal(out, ufunc(a, b))
    np.testing.assert_array_equal(in_place, ufunc(a, b))


def test_every_peer_sends_and_receives_in_the_same_step(make_links: Any) -> None:
    """The ring pattern: send right, receive left, with large (lent) buffers, without deadlock."""
    n, length = 5, COPY_BELOW // 4

    def body(link: Any) -> np.ndarray:
        mine = np.full(length, link.rank, np.float32)
        out = np.empty(length, np.float32)
        link.send((link.rank + 1) % n, mine)
        link.recv_into((link.rank - 1) % n, out)
        return out

    for rank, out in enumerate(run_links(make_links(n), body)):
        assert (out == (rank - 1) % n).all()


def test_after_flush_the_sender_may_reuse_its_buffer(make_links: Any) -> None:
    """The Link contract: once ``flush`` returns, writing the sent buffer cannot change what the
    receiver gets (in process: the receiver has consumed it; over ZeroMQ: it has left the buffer)."""
    sent = np.arange(COPY_BELOW, dtype=np.float64)  # lent, not copied, by the in-process link

    def body(link: Any) -> Any:
        if link.rank == 0:
            buffer = sent.copy()
            link.send(1, buffer)
            link.flush()
            buffer[...] = -1  # reused at once
            return None
        time.sleep(0.2)  # receive late: the sender's flush had to wait, or the data had left
        out = np.empty(COPY_BELOW)
        link.recv_into(0, out)
        return out

    np.testing.assert_array_equal(run_links(make_links(2), body)[1], sent)


# -- the real transports only ------------------------------------------------------------------


def test_a_zmq_receive_that_never_completes_times_out() -> None:
    mesh = ZmqMesh(2, shared=False, timeout=0.3)
    try:
        started = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="timed out waiting for data from 1"):
            mesh.links[0].recv_into(1, np.empty(1))
        assert time.monotonic() - started < 2
    finally:
        mesh.close()


def test_a_flush_toward_a_lost_node_is_a_peer_lost_error_at_once() -> None:
    """It waited for the deadline, then raised a CollectiveTimeout naming nobody (1 run in 15 of a
    killed node's 64 MiB all_reduce across hosts)."""
    mesh = ZmqMesh(2, shared=False, timeout=30)
    try:
        mesh.networks[1].close()  # node 1 is gone: what is sent to it is never let go
        mesh.links[0].send(1, np.zeros(4 << 20))  # 32 MiB: tracked chunks
        mesh.lost[1] = PeerLostError("node 1 (peer 1) stopped sending heartbeats (2s)", [1])
        started = time.monotonic()
        with pytest.raises(PeerLostError, match="stopped sending heartbeats"):
            mesh.links[0].flush()
        assert time.monotonic() - started < 2
    finally:
        mesh.close()


def test_a_zmq_abort_fails_the_other_nodes_waits_at_once() -> None:
    mesh = ZmqMesh(3, shared=False)
    try:
        mesh.networks[1].abort(0, "MemoryError: simulated")
        started = time.monotonic()
        for waiting in (0, 2):
            with pytest.raises(PeerLostError, match="node 1 gave up step 0: MemoryError: simulated"):
                mesh.links[waiting].recv_into(1, np.empty(1))
        assert time.monotonic() - started < 2
    finally:
        mesh.close()


def test_an_abort_wins_over_what_the_aborting_node_sent_for_its_next_step() -> None:
    """Node 1 gives up step 0 and goes on to step 1 at once: a node still waiting in step 0 gets
    the abort, not node 1's next message taken for its step-0 data."""
    mesh = ZmqMesh(2, shared=False)
    try:
        mesh.networks[1].abort(0, "MemoryError: simulated")
        mesh.networks[1].send(0, {"t": "data", "ch": 0, "seq": 1, "off": 0, "n": 0})
        time.sleep(0.2)  # both have arrived before node 0 looks
        with pytest.raises(PeerLostError, match="node 1 gave up step 0"):
            mesh.links[0].recv_into(1, np.empty(1))
    finally:
        mesh.close()


def test_a_receive_that_never_completes_times_out_and_aborts_every_peer() -> None:
    links = inproc_links(3, timeout=0.3)
    outcomes: list[Any] = [None] * 3

    def target(link: Any) -> None:
        try:
            link.recv_into((link.rank + 1) % 3 if link.rank == 0 else 0, np.empty(1))
        except Exception as exc:
            outcomes[link.rank] = exc

    threads = [threading.Thread(target=target, args=(link,)) for link in links]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert time.monotonic() - started < 2
    assert all(isinstance(o, CollectiveTimeout) for o in outcomes), outcomes
    assert "test #0: peer" in str(outcomes[0]) and "timed out waiting for a message from peer" in str(
        outcomes[0]
    )


def test_abort_wakes_blocked_peers_with_the_error() -> None:
    links = inproc_links(2)
    exchange = links[0]._exchange
    caught: list[BaseException] = []

    def wait_for_peer_1() -> None:
        try:
            links[0].recv_into(1, np.empty(1))
        except PeerLostError as exc:
            caught.append(exc)

    waiter = threading.Thread(target=wait_for_peer_1)
    waiter.start()
    time.sleep(0.05)
    exchange.abort(PeerLostError("peer 1 failed", [1]))
    waiter.join(5)
    assert not waiter.is_alive() and caught and caught[0].peers == (1,)
    with pytest.raises(PeerLostError):
        links[1].send(0, np.ones(1))  # and nothing new enters an aborted exchange
