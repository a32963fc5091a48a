"""The orchestrator daemon under hostile input and slow starts: it keeps serving and says what it knows."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from collective.transport.orchestrator_client import OrchestratorClient
from tests.processes import READY

pytestmark = pytest.mark.timeout(120)
_jobs = itertools.count()


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def form(context: zmq.Context[Any], address: str, job: str, nodes: int, timeout: float) -> list[Any]:
    """Register ``nodes`` one-peer nodes of ``job`` from threads: each one's Topology or exception."""
    clients = [OrchestratorClient(context, address, job) for _ in range(nodes)]
    results: list[Any] = [None] * nodes

    def run(i: int) -> None:
        try:
            results[i] = clients[i].register(nodes, f"127.0.0.1:{7001 + i}", [i], time.monotonic() + timeout)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(nodes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    for client in clients:
        client.close()
    return results


def test_an_orchestrator_whose_stderr_nobody_reads_keeps_serving_through_garbage(
    context: zmq.Context[Any],
) -> None:
    """Without a token libzmq parses random bytes as ZMTP/1.0 messages, each one refused: logged one
    line each, synchronously, they filled the unread pipe and the service stopped."""
    process = subprocess.Popen(
        [sys.executable, "-m", "collective", "orchestrator", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        line = process.stdout.readline().decode()  # the only line ever read while it runs
        assert line.startswith(READY), line
        address = line[len(READY) :].strip()
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as crafted:
            crafted.sendall(b"\x01\x00" * 2048)  # ZMTP/1.0: 2,048 empty messages in 4 KiB
        for _ in range(1000):
            with socket.create_connection((host, int(port)), timeout=5) as raw:
                raw.sendall(os.urandom(512))
        started = time.monotonic()
        topologies = form(context, address, f"after-garbage-{next(_jobs)}", 2, timeout=10)
        assert [getattr(t, "index", t) for t in topologies] == [0, 1]
        assert time.monotonic() - started < 5
        process.terminate()
        assert process.wait(10) == 0
        logged = process.stderr.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    refusals = logged.count("refused a malformed message")
    assert 1 <= refusals <= 5, logged  # one line, then summaries at most every 5 s
    assert "more like" in logged, logged
