"""The job token on every socket of a job; strangers on the data services; clean monitor shutdown."""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from collective.errors import PeerLostError
from collective.transport.network import NodeNetwork
from collective.transport.orchestrator import Orchestrator
from collective.transport.wire import encode_header
from tests.conftest import wait_until
from tests.processes import (
    WORKER,
    Proc,
    finish_all,
    node_env,
    start_orchestrator,
    start_orchestrator_with_token,
)

pytestmark = pytest.mark.timeout(120)
_jobs = itertools.count()

# A ZMTP 3.0 greeting (rfc.zeromq.org/spec/23): signature, version 3.0, mechanism NULL, as-server 0.
GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" * 32


def greeting_mechanism(address: str) -> bytes:
    """The security mechanism the ZeroMQ socket listening at ``address`` announces in its greeting."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(GREETING[:11])  # signature and major version: the peer then sends its whole greeting
        data = b""
        while len(data) < 64:
            chunk = raw.recv(64 - len(data))
            if not chunk:
                break
            data += chunk
    assert len(data) == 64 and data[0] == 0xFF and data[9] == 0x7F and data[10] == 3, data
    return data[12:32].rstrip(b"\0")


def registered(orchestrator: Proc, count: int, job: str) -> list[str]:
    """The data service addresses of the first ``count`` nodes of ``job`` to register (from its log)."""
    pattern = re.compile(rf"job '{job}': node at (\S+) registered")

    def found() -> list[str]:
        return [m.group(1) for _, line in list(orchestrator.lines) if (m := pattern.search(line))]

    wait_until(
        lambda: len(found()) >= count,
        30,
        lambda: f"{count} nodes of {job} did not register; output:\n{orchestrator.output()}",
    )
    return found()


def test_every_port_of_a_token_job_is_curve_and_a_stranger_injects_nothing(tmp_path: Path) -> None:
    """Node 1 registers first; a stranger connects to its data service as node-0 and sends a forged
    call for step 0 before the real node 0 exists. Every listening port speaks CURVE only, so the
    stranger never gets a message in and the job's checked results are right."""
    token = "job-secret"
    orchestrator, address = start_orchestrator_with_token(token)
    job = f"curve-{next(_jobs)}"
    stop = tmp_path / "stop"
    env = [node_env(address, job, rank, 2, 1, token=token) for rank in range(2)]
    second = Proc([sys.executable, WORKER, "until", str(stop)], env[1])
    nodes = [second]
    context: zmq.Context[Any] = zmq.Context()
    try:
        (data_service,) = registered(orchestrator, 1, job)
        assert greeting_mechanism(address) == b"CURVE"
        assert greeting_mechanism(data_service) == b"CURVE"
        stranger = context.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.setsockopt(zmq.ROUTING_ID, b"node-0")
        stranger.connect(f"tcp://{data_service}")
        forged = {
            "t": "call",
            "job": job,
            "seq": 0,
            "src": 0,
            "kind": "all_reduce",
            "op": "sum",
            "root": None,
            "shape": [5],
            "dtype": "float64",
            "has_data": True,
            "error": None,
            "small": (b"\x00" * 7 + b"\x40") * 5,
        }
        for _ in range(3):  # (once its handshake was refused ZeroMQ drops its pipe: a send would block)
            with contextlib.suppress(zmq.Again):
                stranger.send(encode_header(forged), zmq.NOBLOCK)
        wait_until(  # the stranger tried, and node 1 refused it
            lambda: any("refused a connection" in line for _, line in list(second.lines)),
            10,
            lambda: f"node 1 refusing the stranger; output:\n{second.output()}",
        )
        first = Proc([sys.executable, WORKER, "until", str(stop)], env[0])
        nodes.insert(0, first)
        first.wait_for("READY", 60)
        second.wait_for("READY", 60)
        both = registered(orchestrator, 2, job)
        assert greeting_mechanism(both[1]) == b"CURVE"  # node 0's data service too
        stop.touch()
        for node, code in zip(nodes, finish_all(nodes, 60), strict=True):
            assert code == 0, node.output()
        stranger.close()
    finally:
        finish_all(nodes, 30)
        context.destroy(linger=0)
        orchestrator.terminate()


@pytest.mark.parametrize("token", [None, "a-guess"], ids=["no-token", "wrong-token"])
def test_a_data_service_with_a_token_names_the_address_it_refused(
    token: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="collective.transport.sockets")  # (the connections it accepts)
    context: zmq.Context[Any] = zmq.Context()
    server = NodeNetwork(context, "mesh", "127.0.0.1", 0, lambda src: None, token="t0k3n")
    client = NodeNetwork(context, "mesh", "127.0.0.1", 0, lambda src: None, token=token)
    try:
        server.connect(1, ["127.0.0.1:9", server.address])
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
            probe = f"127.0.0.1:{raw.getsockname()[1]}"
            wait_until(  # the monitor reads the address while the connection is open
                lambda: f"accepted a connection from {probe}" in caplog.text, 5, f"the monitor read {probe}"
            )
            raw.sendall(GREETING)  # NULL mechanism: refused
            while raw.recv(4096):
                pass
        wait_until(lambda: f"refused a connection from {probe}" in caplog.text, 5, f"the refusal of {probe}")
        assert f"data service {server.address} refused a connection from {probe}" in caplog.text
        client.connect(0, [client.address, server.address])
        try:  # queued, or refused if the handshake already failed: never blocking
            client.send(1, {"t": "call", "seq": 0})
        except PeerLostError as exc:
            assert f"its data service at {server.address} refused the connection" in str(exc)
        with pytest.raises(Exception, match="timed out"):  # the client's message never arrived
            server.receive(0, 0, time.monotonic() + 0.5, "anything")
    finally:
        client.close()
        server.close()
        context.destroy(linger=0)


def test_a_token_orchestrator_stops_at_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="collective.transport.orchestrator")
    orchestrator = Orchestrator("127.0.0.1", 0, token="t0k3n")
    thread = threading.Thread(target=orchestrator.serve, daemon=True)
    thread.start()
    wait_until(lambda: "orchestrator listening on" in caplog.text, 5, "the orchestrator serving")
    started = time.monotonic()
    orchestrator.stop()
    thread.join(5)
    assert not thread.is_alive()
    assert time.monotonic() - started < 1.0  # measured: 3 ms; it waited 2 s for its monitor thread


CYCLES = """
import sys, threading, time
import numpy as np
import collective as col
from collective.transport.orchestrator import Orchestrator

orchestrator = Orchestrator("127.0.0.1", 0, token="cycle-token")
server = threading.Thread(target=orchestrator.serve, daemon=True)
server.start()
finishes = []


def node(rank, job, results):
    config = col.CollectiveConfig(
        num_devices=1, num_nodes=2, global_address=orchestrator.address, node_address="127.0.0.1:0",
        data_service_port=0, job=job, token="cycle-token", timeout=20,
    )
    with col.Runtime() as rt:
        rt.register(rank, "cpu", config)
        results[rank] = rt.all_reduce(rank, np.full(1 << 17, rank + 1.0))  # 1 MiB: the data path
        started = time.monotonic()
        rt.finish(rank)
        finishes.append(time.monotonic() - started)


for cycle in range(int(sys.argv[1])):
    results = {}
    threads = [threading.Thread(target=node, args=(rank, f"cycle-{cycle}", results)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 2 and all((r == 3.0).all() for r in results.values()), cycle
started = time.monotonic()
orchestrator.stop()
server.join(5)
print(f"slowest finish {max(finishes):.3f} orchestrator stop {time.monotonic() - started:.3f}", flush=True)
"""


def test_token_jobs_register_run_and_finish_many_times_without_an_abort() -> None:
    """Each finish() stops the data service's connection monitor; it must never abort libzmq."""
    result = subprocess.run([sys.executable, "-c", CYCLES, "25"], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr
    slowest, stop = map(float, re.findall(r"[\d.]+", result.stdout.splitlines()[-1]))
    assert slowest < 1.5 and stop < 1.5, result.stdout  # each waited 2 s for its monitor thread


def rss(pid: int) -> int:
    """Resident memory of process ``pid`` in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for {pid}")


FLOOD = 512 << 20


def test_a_flood_on_an_idle_data_service_leaves_its_memory_bounded_and_the_job_working(
    tmp_path: Path,
) -> None:
    """Without a token a data service is open to anyone: what a stranger sends must be dropped, not kept.

    Both nodes idle (no collective runs) while a stranger sends 512 MiB to node 0's data service
    in messages of the largest size it accepts; then the nodes run another checked round.
    """
    orchestrator, address = start_orchestrator()
    job = f"flood-{next(_jobs)}"
    stop = tmp_path / "stop"
    argv = [sys.executable, WORKER, "until", str(stop), "120"]
    nodes = [Proc(argv, node_env(address, job, 0, 2, 1))]
    context: zmq.Context[Any] = zmq.Context()
    try:
        (data_service,) = registered(orchestrator, 1, job)  # node 0's
        nodes.append(Proc(argv, node_env(address, job, 1, 2, 1)))
        for node in nodes:
            node.wait_for("READY", 60)
        pid = nodes[0].process.pid
        before = peak = rss(pid)
        flooder = context.socket(zmq.DEALER)
        flooder.setsockopt(zmq.LINGER, 0)
        flooder.setsockopt(zmq.SNDHWM, 8)
        flooder.setsockopt(zmq.ROUTING_ID, b"flooder")
        flooder.connect(f"tcp://{data_service}")
        chunk = b"\x00" * (4 << 20)
        sent, deadline = 0, time.monotonic() + 20
        while sent < FLOOD and time.monotonic() < deadline:
            try:
                flooder.send(chunk, zmq.NOBLOCK, copy=False)
                sent += len(chunk)
            except zmq.Again:
                time.sleep(0.01)  # (kept: a back-off, not an order) the node drains; the loop has a deadline
            peak = max(peak, rss(pid))
        settle = time.monotonic() + 1.0
        while time.monotonic() < settle:
            peak = max(peak, rss(pid))
            time.sleep(0.02)  # (kept: the sampling interval of the 1 s the node's memory is watched)
        flooder.close()
        stop.touch()
        for node, code in zip(nodes, finish_all(nodes, 60), strict=True):
            assert code == 0, node.output()
    finally:
        finish_all(nodes, 30)
        context.destroy(linger=0)
        orchestrator.terminate()
    print(f"flood: sent {sent >> 20} MiB; node RSS {before >> 20} MiB before, {peak >> 20} MiB at most")
    assert sent == FLOOD, f"only {sent >> 20} MiB could be sent"
    assert peak - before < 160 << 20, f"RSS grew from {before >> 20} MiB to {peak >> 20} MiB"
