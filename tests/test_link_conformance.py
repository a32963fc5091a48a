"""The Link conformance checks shipped in collective.algorithms.conformance, run against every Link.

This file only says how to build each transport's links (a factory per transport) and runs every
shipped check against each, one test id per (transport, check): the in-process link, the
recording link of the algorithm tests (so the simulation behaves like the real thing) and the
ZeroMQ link between data services (over TCP, and through shared memory for large chunks between
nodes of one host). A new transport adds its factory here or runs ``check_link`` from its own
tests. The tests after the checks pin what is particular to one transport (its error messages,
its ways to fail).
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import numpy as np
import pytest
import zmq

from collective.algorithms import conformance
from collective.algorithms.conformance import CHECKS, LinkGroup, MakeLinks, check_link
from collective.algorithms.ops import ReduceOp, combine
from collective.errors import CollectiveTimeout, PeerLostError
from collective.transport.inproc import COPY_BELOW, Exchange, InProcessLink
from collective.transport.network import NodeNetwork
from collective.transport.wire import ErrorRecord
from collective.transport.zmq_link import ZmqLink
from tests.conftest import wait_until
from tests.recording import Network


def _record(reason: str) -> ErrorRecord:
    """A give-up reason as the data service carries it."""
    return ErrorRecord("PeerLostError", (), reason)


def inproc_exchange(n: int, timeout: float = 10.0) -> tuple[Exchange, list[Any]]:
    """An Exchange of ``n`` peers and their links, whose waits end ``timeout`` seconds from now."""
    exchange = Exchange(tuple(range(n)), "test #0")
    deadline = time.monotonic() + timeout
    return exchange, [InProcessLink(exchange, rank, deadline) for rank in range(n)]


def inproc_links(n: int, timeout: float = 10.0) -> list[Any]:
    return inproc_exchange(n, timeout)[1]


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


# -- a factory per transport: n peers whose waits end ``timeout`` seconds from now ---------------


def inproc_group(n: int, timeout: float) -> LinkGroup:
    exchange, links = inproc_exchange(n, timeout)

    def abort(peer: int, reason: str) -> None:
        exchange.abort(PeerLostError(f"peer {peer} gave up: {reason}", [peer]))

    return LinkGroup(links, abort=abort)


def recording_group(n: int, timeout: float) -> LinkGroup:
    network = Network(n, timeout=timeout)
    return LinkGroup(network.links(), abort=network.abort)


def zmq_group(n: int, timeout: float, shared: bool) -> LinkGroup:
    mesh = ZmqMesh(n, shared=shared, timeout=timeout)
    return LinkGroup(
        mesh.links, abort=lambda peer, reason: mesh.networks[peer].abort(0, _record(reason)), close=mesh.close
    )


TRANSPORTS: dict[str, MakeLinks] = {
    "inproc": inproc_group,
    "recording": recording_group,
    "zmq": functools.partial(zmq_group, shared=False),
    "zmq-shm": functools.partial(zmq_group, shared=True),
}


@pytest.mark.parametrize("check", CHECKS, ids=str)
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_link_conforms(transport: str, check: conformance.Check) -> None:
    check(TRANSPORTS[transport])


def test_check_link_runs_every_check() -> None:
    made: list[tuple[int, float]] = []

    def counting(n: int, timeout: float) -> LinkGroup:
        made.append((n, timeout))
        return inproc_group(n, timeout)

    check_link(counting)
    every = list(made)
    made.clear()
    check_link(counting, timeouts=False, aborts=False)
    assert len(made) == len(every) - 2  # all but the groups of the timeout and the abort checks
    assert any(timeout < 1 for _, timeout in every) and all(timeout >= 1 for _, timeout in made)


# -- the checks catch broken links -------------------------------------------------------------


class Wrapped:
    """A Link passing every call to another (subclasses break one method)."""

    def __init__(self, link: Any) -> None:
        self.link = link
        self.rank, self.size = link.rank, link.size

    def send(self, dst: int, data: Any) -> None:
        self.link.send(dst, data)

    def recv_into(self, src: int, out: Any) -> None:
        self.link.recv_into(src, out)

    def recv_reduce(self, src: int, operand: Any, out: Any, op: ReduceOp) -> None:
        self.link.recv_reduce(src, operand, out, op)

    def flush(self) -> None:
        self.link.flush()


class ReceivesBeforeReducing(Wrapped):
    """Receives the message into ``out`` and then combines: wrong when ``operand`` is ``out``."""

    def recv_reduce(self, src: int, operand: Any, out: Any, op: ReduceOp) -> None:
        self.link.recv_into(src, out)
        combine(op, out, operand, out)


class FlushesAtOnce(Wrapped):
    """Returns from ``flush`` while a lent buffer is still to be read."""

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(
    ("broken", "check", "message"),
    [
        (ReceivesBeforeReducing, "recv_reduce", "in place"),
        (FlushesAtOnce, "reuse_after_flush", "written after flush"),
    ],
)
def test_the_checks_catch_a_broken_link(broken: type[Wrapped], check: str, message: str) -> None:
    def make(n: int, timeout: float) -> list[Any]:
        return [broken(link) for link in inproc_links(n, timeout)]

    (chosen,) = [c for c in CHECKS if c.name == check]
    with pytest.raises(AssertionError, match=message):
        chosen(make, large_bytes=COPY_BELOW + 8)  # lent by the in-process link, not copied


def test_a_factory_with_the_wrong_ranks_is_refused() -> None:
    with pytest.raises(AssertionError, match=r"ranks 0 \.\. 1 in a group of 2; got ranks \[1, 0\]"):
        check_link(lambda n, timeout: list(reversed(inproc_links(n, timeout))))


# -- what is particular to one transport ---------------------------------------------------------


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
        mesh.networks[1].abort(0, ErrorRecord("MemoryError", (), "simulated"))
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
        mesh.networks[1].abort(0, ErrorRecord("MemoryError", (), "simulated"))
        mesh.networks[1].send(0, {"t": "data", "ch": 0, "seq": 1, "off": 0, "n": 0})
        wait_until(  # both have arrived before node 0 looks (in order: the abort, then the data)
            lambda: mesh.networks[0].queued([1], 1, "data"), 5, "node 1's step-1 data at node 0"
        )
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
    exchange, links = inproc_exchange(2)
    caught: list[BaseException] = []

    def wait_for_peer_1() -> None:
        try:
            links[0].recv_into(1, np.empty(1))
        except PeerLostError as exc:
            caught.append(exc)

    waiter = threading.Thread(target=wait_for_peer_1)
    waiter.start()
    wait_until(lambda: exchange.waiting == (0,), 5, "peer 0 asleep waiting for peer 1")
    exchange.abort(PeerLostError("peer 1 failed", [1]))
    waiter.join(5)
    assert not waiter.is_alive() and caught and caught[0].peers == (1,)
    with pytest.raises(PeerLostError):
        links[1].send(0, np.ones(1))  # and nothing new enters an aborted exchange
