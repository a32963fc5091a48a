"""The orchestrator and the data service on real sockets: validation, determinism, hostile input."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from collective.errors import CollectiveTimeout, MismatchError, PeerLostError, RegistrationError
from collective.transport.network import BUDGET_FLOOR, RECEIVE_HWM, STEPS_AHEAD, NodeNetwork
from collective.transport.orchestrator import Orchestrator
from collective.transport.orchestrator_client import OrchestratorClient
from collective.transport.shm import SLOT_BYTES, SLOTS
from collective.transport.wire import CHUNK_BYTES, MAX_MESSAGE_BYTES, ErrorRecord, encode_header
from collective.transport.zmq_link import ZmqLink
from tests.conftest import orchestrator_log, registered, wait_until

_jobs = itertools.count()


@pytest.fixture
def orchestrator() -> Iterator[Orchestrator]:
    orch = Orchestrator("127.0.0.1", 0)
    thread = threading.Thread(target=orch.serve, daemon=True)
    thread.start()
    yield orch
    orch.stop()
    thread.join(5)
    assert not thread.is_alive()


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def register_all(
    orch: Orchestrator,
    context: zmq.Context[Any],
    job: str,
    nodes: list[tuple[str, list[int]]],
    num_nodes: int | None = None,
) -> list[Any]:
    """Register each (address, peers) from its own thread; results (Topology or exception) in order."""
    clients = [OrchestratorClient(context, orch.address, job) for _ in nodes]
    results: list[Any] = [None] * len(nodes)

    def run(i: int) -> None:
        address, peers = nodes[i]
        try:
            results[i] = clients[i].register(num_nodes or len(nodes), address, peers, time.monotonic() + 5)
        except Exception as exc:
            results[i] = exc

    threads = []
    with orchestrator_log() as lines:
        for i in range(len(nodes)):
            thread = threading.Thread(target=run, args=(i,))
            thread.start()
            threads.append(thread)
            if i < len(nodes) - 1:  # arrive in the given order
                wait_until(lambda i=i: registered(lines, job) > i, 5, f"node {i} of {job} registered")
    for thread in threads:
        thread.join(10)
    for client in clients:
        client.close()
    return results


def test_node_indices_follow_peer_ids_whatever_the_arrival_order(
    orchestrator: Orchestrator, context: Any
) -> None:
    layout = [("127.0.0.1:7003", [4, 5]), ("127.0.0.1:7001", [0, 1]), ("127.0.0.1:7002", [2, 3])]
    for order in (layout, layout[::-1]):
        topologies = register_all(orchestrator, context, f"ids-{next(_jobs)}", order)
        by_address = {order[i][0]: t.index for i, t in enumerate(topologies)}
        assert by_address == {"127.0.0.1:7001": 0, "127.0.0.1:7002": 1, "127.0.0.1:7003": 2}
        assert topologies[0].addresses == ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]
        assert topologies[0].world == 6


@pytest.mark.parametrize(
    ("nodes", "num_nodes", "expected"),
    [
        (
            [("127.0.0.1:7001", [0]), ("127.0.0.1:7002", [1])],
            [2, 3],
            "node at 127.0.0.1:7002 says num_nodes=3 but node at 127.0.0.1:7001 said 2",
        ),
        (
            [("127.0.0.1:7001", [0, 1]), ("127.0.0.1:7002", [1, 2])],
            None,
            "node at 127.0.0.1:7002 and node at 127.0.0.1:7001 both claim peer 1",
        ),
        (
            [("127.0.0.1:7001", [0]), ("127.0.0.1:7001", [1])],
            None,
            "address 127.0.0.1:7001 is already registered",
        ),
        ([("127.0.0.1:7001", [0]), ("127.0.0.1:7002", [2])], None, "the peer ids of job"),
    ],
    ids=["num_nodes", "peer-ids", "address", "not-0..world-1"],
)
def test_registrations_that_cannot_form_a_job_are_refused(
    orchestrator: Orchestrator, context: Any, nodes: Any, num_nodes: Any, expected: str
) -> None:
    job = f"bad-{next(_jobs)}"
    clients = [OrchestratorClient(context, orchestrator.address, job) for _ in nodes]
    errors: list[Any] = [None] * len(nodes)

    def run(i: int) -> None:
        try:
            count = num_nodes[i] if isinstance(num_nodes, list) else 2
            clients[i].register(count, nodes[i][0], nodes[i][1], time.monotonic() + 2)
        except Exception as exc:
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(nodes))]
    with orchestrator_log() as lines:
        threads[0].start()
        wait_until(lambda: registered(lines, job) == 1, 5, f"the first node of {job} registered")
        threads[1].start()
    for thread in threads:
        thread.join(10)
    for client in clients:
        client.close()
    refused = [e for e in errors if isinstance(e, RegistrationError)]
    assert refused and all(expected in str(e) for e in refused), errors


def test_a_job_that_already_formed_refuses_more_nodes(orchestrator: Orchestrator, context: Any) -> None:
    job = f"full-{next(_jobs)}"
    first = OrchestratorClient(context, orchestrator.address, job)
    first.register(1, "127.0.0.1:7001", [0], time.monotonic() + 5)
    extra = OrchestratorClient(context, orchestrator.address, job)
    with pytest.raises(RegistrationError, match=f"job '{job}' already has its 1 nodes"):
        extra.register(1, "127.0.0.1:7002", [1], time.monotonic() + 5)
    extra.close()
    first.close()


def test_garbage_to_the_orchestrator_is_refused_and_it_keeps_serving(
    orchestrator: Orchestrator, context: Any, caplog: pytest.LogCaptureFixture
) -> None:
    host, port = orchestrator.address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:  # not even ZeroMQ
        raw.sendall(os.urandom(4096))
    rogue = context.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    dropped = rogue.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    rogue.connect(f"tcp://{orchestrator.address}")
    rogue.send(b"\xff\x00not msgpack")
    rogue.send(msgpack.packb([1, 2, 3]))
    rogue.send(msgpack.packb({"t": "register", "job": "x", "num_nodes": "two", "address": 5, "peers": [-1]}))
    rogue.send_multipart([b"two", b"frames"])
    rogue.send(b"x" * (2 << 20))  # larger than the orchestrator accepts
    wait_until(lambda: "malformed registration" in caplog.text, 5, "the rogue's registration refused")
    assert dropped.poll(5000), "the orchestrator kept the connection that sent more than it accepts"
    rogue.disable_monitor()
    dropped.close(0)
    rogue.close()
    topologies = register_all(
        orchestrator, context, f"after-{next(_jobs)}", [("127.0.0.1:7001", [0]), ("127.0.0.1:7002", [1])]
    )
    assert [t.index for t in topologies] == [0, 1]
    assert "refused a malformed message" in caplog.text


def _mesh(context: Any, share_memory: bool) -> Iterator[tuple[NodeNetwork, NodeNetwork]]:
    a = NodeNetwork(context, "mesh", "127.0.0.1", 0, lambda src: None)
    b = NodeNetwork(context, "mesh", "127.0.0.1", 0, lambda src: None)
    infos = [a.info, b.info] if share_memory else None  # without infos nodes do not know they share a host
    a.connect(0, [a.address, b.address], infos)
    b.connect(1, [a.address, b.address], infos)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def mesh(context: Any) -> Iterator[tuple[NodeNetwork, NodeNetwork]]:
    """Two connected data services of job "mesh" (node 0 and node 1), over TCP only."""
    yield from _mesh(context, share_memory=False)


@pytest.fixture
def shm_mesh(context: Any) -> Iterator[tuple[NodeNetwork, NodeNetwork]]:
    """The same, knowing they share this host (large chunks through shared memory)."""
    yield from _mesh(context, share_memory=True)


def test_garbage_to_a_data_service_is_refused_and_it_keeps_serving(
    mesh: tuple[NodeNetwork, NodeNetwork], context: Any, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = mesh
    host, port = b.address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(os.urandom(4096))
    stranger = context.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.setsockopt(zmq.ROUTING_ID, b"intruder")
    stranger.connect(f"tcp://{b.address}")
    stranger.send_multipart([encode_header({"t": "data", "job": "mesh", "seq": 0, "src": 0})])
    stranger.send(b"y" * (MAX_MESSAGE_BYTES + 1))  # over ZMQ_MAXMSGSIZE: dropped before allocation
    # A known node sending malformed messages: only node 0's own connection carries its routing id
    # (the ROUTER refuses a second one), and no public call sends frames as they are (on purpose).
    dealer = a._dealers[1]
    dealer.send_multipart([b"\xc1 bad header"])
    dealer.send_multipart([msgpack.packb({"t": "data", "job": "other", "seq": 0, "src": 0})])
    dealer.send_multipart(
        [msgpack.packb({"t": "data", "job": "mesh", "seq": 0, "src": 1})]
    )  # claims another source
    dealer.send_multipart([msgpack.packb({"t": "data", "job": "mesh", "seq": 0, "src": 0}), b"1", b"2"])
    a.send(1, {"t": "data", "seq": 0, "payload": "ok"}, np.arange(3.0))
    header, payload = b.receive(0, 0, time.monotonic() + 5, "the good message")
    assert header["payload"] == "ok" and np.frombuffer(payload.buffer).tolist() == [0.0, 1.0, 2.0]
    stranger.close()
    for reason in ("unknown sender", "undecodable header", "does not match", "3 frames"):
        assert reason in caplog.text


def test_absurd_declared_sizes_fail_the_collective_without_allocating(
    mesh: tuple[NodeNetwork, NodeNetwork],
) -> None:
    a, b = mesh
    call = {"kind": "all_reduce", "op": "sum", "root": None, "shape": [4], "dtype": "float64"}
    signature = {"kind": "all_reduce", "op": "sum", "root": None, "shape": [4], "dtype": "float64"}
    a.send(1, {"t": "data", "seq": 0, **signature, "off": 0, "n": 10**15}, np.zeros(4))
    link = ZmqLink(b, 0, call, time.monotonic() + 5)
    with pytest.raises(MismatchError, match=r"sent elements 0\+1000000000000000 where 0 of 4 were expected"):
        link.recv_into(0, np.empty(4))
    a.send(1, {"t": "data", "seq": 0, **signature, "off": 0, "n": 4}, np.zeros(3))  # 24 bytes for 4 elements
    with pytest.raises(MismatchError, match="sent 24 bytes for 4 elements"):
        link.recv_into(0, np.empty(4))


def test_a_data_service_with_a_token_refuses_connections_without_it(
    context: Any, caplog: pytest.LogCaptureFixture
) -> None:
    a = NodeNetwork(context, "secret-mesh", "127.0.0.1", 0, lambda src: None, token="t0k3n")
    b = NodeNetwork(context, "secret-mesh", "127.0.0.1", 0, lambda src: None, token="t0k3n")
    try:
        a.connect(0, [a.address, b.address])
        b.connect(1, [a.address, b.address])
        intruder = NodeNetwork(context, "secret-mesh", "127.0.0.1", 0, lambda src: None, token="guess")
        intruder.connect(0, [a.address, b.address])  # claims to be node 0, with the wrong token
        intruder.send(1, {"t": "data", "seq": 0, "from": "intruder"})
        a.send(1, {"t": "data", "seq": 0, "from": "node 0"})
        header, _ = b.receive(0, 0, time.monotonic() + 5, "node 0")
        assert header["from"] == "node 0"
        wait_until(lambda: "refused a connection" in caplog.text, 5, "the intruder's connection refused")
        assert f"data service {b.address} refused a connection" in caplog.text
        with pytest.raises(Exception, match="timed out"):  # nothing else ever arrived
            b.receive(0, 0, time.monotonic() + 0.3, "anything more")
        intruder.close()
    finally:
        a.close()
        b.close()


def test_same_host_nodes_pass_large_chunks_through_shared_memory(
    shm_mesh: tuple[NodeNetwork, NodeNetwork],
) -> None:
    a, b = shm_mesh
    assert a.info["shm"] and a.info["host"] == b.info["host"]
    count = (SLOTS + 4) * SLOT_BYTES // 8  # more chunks than slots: the rest go over TCP
    data = np.arange(count, dtype=np.float64)
    call = {"kind": "broadcast", "op": None, "root": 0, "shape": [count], "dtype": "float64"}
    sender = ZmqLink(a, 0, call, time.monotonic() + 30)
    sender.send(1, data)
    assert a.free_slots == []  # every slot lent
    out = np.empty(count)
    ZmqLink(b, 0, call, time.monotonic() + 30).recv_into(0, out)
    np.testing.assert_array_equal(out, data)
    sender.flush()
    deadline = time.monotonic() + 5
    while len(a.free_slots or ()) < SLOTS and time.monotonic() < deadline:  # acks come back to node 0
        with contextlib.suppress(Exception):
            a.receive(1, 99, time.monotonic() + 0.05, "nothing")
    assert a.free_slots == list(range(SLOTS))


def test_forged_slots_and_acks_are_refused(
    shm_mesh: tuple[NodeNetwork, NodeNetwork], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = shm_mesh
    call = {"kind": "all_reduce", "op": "sum", "root": None, "shape": [4], "dtype": "float64"}
    signature = {"kind": "all_reduce", "op": "sum", "root": None, "shape": [4], "dtype": "float64"}
    a.send(1, {"t": "data", "seq": 0, **signature, "off": 0, "n": 4, "shm": SLOTS + 3})
    with pytest.raises(MismatchError, match="unusable slot"):
        ZmqLink(b, 0, call, time.monotonic() + 5).recv_into(0, np.empty(4))
    b.send(0, {"t": "ack", "seq": 0, "slot": 2})  # a slot node 0 never lent to node 1
    with contextlib.suppress(Exception):
        a.receive(1, 0, time.monotonic() + 0.3, "the ack to be drained")
    assert "acknowledged slot 2 it was not lent" in caplog.text


def test_an_abort_carries_the_senders_error_record_and_a_malformed_one_is_refused(
    mesh: tuple[NodeNetwork, NodeNetwork], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = mesh
    a.send(1, {"t": "abort", "ch": 0, "seq": 0, "class": "MemoryError", "peers": "all", "message": "x"})
    a.abort(1, ErrorRecord.of(CollectiveTimeout("waited for peer 3", [3])))
    with pytest.raises(CollectiveTimeout, match="timed out waiting for step 0"):  # (that abort was refused)
        b.receive(0, 0, time.monotonic() + 0.3, "step 0")
    with pytest.raises(
        CollectiveTimeout, match="node 0 gave up step 1: CollectiveTimeout: waited for peer 3"
    ) as timed:
        b.receive(0, 1, time.monotonic() + 5, "step 1")  # (the step timed out there: no peer was lost)
    assert timed.value.missing == (3,)
    a.abort(2, ErrorRecord.of(MemoryError("simulated")))
    with pytest.raises(PeerLostError, match="node 0 gave up step 2: MemoryError: simulated") as failed:
        b.receive(0, 2, time.monotonic() + 5, "step 2")
    assert failed.value.peers == ()  # (nobody was lost: node 0 failed)
    a.abort(3, ErrorRecord.of(PeerLostError("peer 5 died", [5])))
    with pytest.raises(PeerLostError, match="node 0 gave up step 3: PeerLostError: peer 5 died") as lost:
        b.receive(0, 3, time.monotonic() + 5, "step 3")
    assert lost.value.peers == (5,)  # (the peer node 0 lost: the one this error names too)
    assert "invalid peers of an error" in caplog.text


def test_segments_of_dead_processes_are_removed(tmp_path: Any) -> None:
    from collective.transport import shm

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = f"/dev/shm/collective-{int(dead.stdout)}-{'feedbeef' * 2}"  # its creator died making it
    with open(os.open(stale, os.O_CREAT | os.O_WRONLY, 0o600), "wb") as handle:
        handle.write(b"x")
    segment = shm.SendSegment.create()
    assert segment is not None
    try:
        assert not os.path.exists(stale) and os.path.exists(segment.path)
    finally:
        segment.close()
    assert not os.path.exists(segment.path)


def test_a_node_sending_more_than_a_step_can_need_fails_it_instead_of_filling_memory(
    mesh: tuple[NodeNetwork, NodeNetwork], caplog: pytest.LogCaptureFixture
) -> None:
    """Before any call declares the step's size a node may queue BUDGET_FLOOR bytes for it, no more."""
    a, b = mesh
    chunk = np.zeros(CHUNK_BYTES // 8)
    for offset in range(0, BUDGET_FLOOR // CHUNK_BYTES + 4):
        a.send(1, {"t": "data", "seq": 0, "off": offset}, chunk)
    a.send(1, {"t": "data", "seq": 0 + STEPS_AHEAD + 1})  # further ahead than any node can be
    wait_until(  # node 1 does not read: the background drain queues what it may and drops the rest
        lambda: "node 0 sent a message of step 3" in caplog.text, 10, "node 1's drain at the last message"
    )
    received = 0
    with pytest.raises(MismatchError, match="node 0 sent more than 64 MiB for step 0"):
        while True:
            b.receive(0, 0, time.monotonic() + 5, "a flood")
            received += 1
    assert received <= BUDGET_FLOOR // CHUNK_BYTES
    assert "node 0 sent a message of step 3 while this node is at 0" in caplog.text


def test_two_nodes_sending_large_arrays_to_each_other_first_do_not_deadlock(
    mesh: tuple[NodeNetwork, NodeNetwork],
) -> None:
    """Receive queues are bounded (RECEIVE_HWM); senders never block, so both sends complete first."""
    count = 96 << 17  # 96 MiB: far more than RECEIVE_HWM messages and the sockets' buffers
    assert count * 8 > RECEIVE_HWM * CHUNK_BYTES
    call = {"kind": "all_reduce", "op": "sum", "root": None, "shape": [count], "dtype": "float64"}
    results: dict[int, Any] = {}

    def run(me: NodeNetwork, other: int) -> None:
        try:
            me.send(other, {"t": "call", "seq": 0, "shape": [count], "dtype": "float64"})  # as agree() does
            me.receive(other, 0, time.monotonic() + 30, "the call")
            link = ZmqLink(me, 0, call, time.monotonic() + 30)
            link.send(other, np.full(count, me.index + 1.0))
            out = np.empty(count)
            link.recv_into(other, out)
            link.flush()
            results[me.index] = (out[0], out[-1])
        except Exception as exc:
            results[me.index] = exc

    threads = [threading.Thread(target=run, args=(node, 1 - node.index)) for node in mesh]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {0: (2.0, 2.0), 1: (1.0, 1.0)}
