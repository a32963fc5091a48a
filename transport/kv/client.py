"""A client of one key-value store an orchestrator serves (transport.kv.store), shared by threads.

Requests are answered by id, so a thread held in a ``get`` does not stop another's ``set`` (torch's
rendezvous keeps itself alive from a timer thread while the agent waits on a key). The socket
queues nothing for a connection not made yet (ZMQ_IMMEDIATE): a request to an orchestrator that
is not there fails after ``connect_timeout`` naming it, and one to an orchestrator of another token
fails at once, instead of being sent, late, whenever one comes up.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from collective.transport.auth import HANDSHAKE_FAILED, handshake_failure
from collective.transport.orchestrator import MAX_MESSAGE, pack, unpack
from collective.transport.sockets import make_socket

__all__ = ["CONNECT_TIMEOUT", "StoreClient", "StoreError"]

CONNECT_TIMEOUT = 30.0  # seconds a request waits for the connection to the orchestrator
POLL = 0.01  # seconds a thread holds the socket while it looks for answers
ANSWER_MARGIN = 5.0  # seconds past a get's or wait's own timeout its answer may take to arrive


class StoreError(Exception):
    """A store request that failed: no orchestrator, a wrong token, a timeout, an error it answered."""


class StoreClient:
    """Store ``name`` on the orchestrator at ``address`` (host:port), with the job ``token``."""

    def __init__(
        self, address: str, name: str, token: str | None, connect_timeout: float = CONNECT_TIMEOUT
    ) -> None:
        self.address, self.name = address, name
        self._connect_timeout = connect_timeout
        self._context = zmq.Context()
        self._socket = make_socket(
            self._context,
            zmq.DEALER,
            token=token,
            server=False,
            max_message=MAX_MESSAGE,
            receive_hwm=1000,
            send_hwm=1000,
            routing_id=b"store:" + uuid.uuid4().bytes,
        )
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._monitor: zmq.Socket[Any] = self._socket.get_monitor_socket(HANDSHAKE_FAILED)
        self._socket.connect(f"tcp://{address}")
        self._lock = threading.Lock()  # the socket's: one thread at a time
        self._ids = itertools.count()
        self._answers: dict[int, dict[str, Any]] = {}  # answers that came for other threads' requests
        self._waiting: set[int] = set()  # requests sent whose answer is still wanted
        self._refused = False
        self._closed = False

    def request(self, op: str, timeout: float, wait: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send ``op`` and return its answer; ``wait``: how long the orchestrator may hold it (a
        get's or wait's keys not set yet). Raises StoreError."""
        deadline = time.monotonic() + (timeout if wait is None else wait + ANSWER_MARGIN)
        message: dict[str, Any] = {"t": "kv", "job": self.name, "op": op, **fields}
        if wait is not None:
            message["wait"] = wait
        with self._lock:
            self._check_open()
            message["id"] = request_id = next(self._ids)
            self._send(pack(message), min(deadline, time.monotonic() + self._connect_timeout))
            self._waiting.add(request_id)
        try:
            while True:
                with self._lock:
                    self._check_open()
                    answer = self._answers.pop(request_id, None)
                    if answer is None and self._socket.poll(int(1000 * POLL)):
                        self._receive()
                        answer = self._answers.pop(request_id, None)
                if answer is not None:
                    break
                if time.monotonic() >= deadline:
                    raise StoreError(
                        f"the orchestrator at {self.address} did not answer a {op} of store {self.name!r} "
                        f"in {timeout if wait is None else wait:g}s (is it still running?)"
                    )
        finally:
            with self._lock:
                self._waiting.discard(request_id)
                self._answers.pop(request_id, None)
        if "error" in answer:
            raise StoreError(f"store {self.name!r} on the orchestrator at {self.address}: {answer['error']}")
        return answer

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._socket.disable_monitor()
            self._monitor.close(0)
            self._socket.close(0)
            self._context.destroy(linger=0)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"store {self.name!r}: the client was closed")
        if self._refused or (
            self._monitor.poll(0) and handshake_failure(recv_monitor_message(self._monitor))
        ):
            self._refused = True
            raise StoreError(
                f"the orchestrator at {self.address} refused this connection: the handshake failed (the job "
                f"token is wrong or missing on one side: COLLECTIVE_TOKEN must be the orchestrator's)"
            )

    def _send(self, frame: bytes, deadline: float) -> None:
        """Send once the connection is made (not before: ZMQ_IMMEDIATE), by ``deadline``."""
        while not self._socket.poll(int(1000 * POLL), zmq.POLLOUT):
            self._check_open()
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"no connection to the orchestrator at {self.address}: start `collective orchestrator` "
                    f"there (with this COLLECTIVE_TOKEN), or name the one that runs"
                )
        self._socket.send(frame)

    def _receive(self) -> None:
        """Keep every answer waiting now that a request still wants; drop the rest."""
        while True:
            try:
                frame = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            answer = unpack(frame)
            if answer is not None and answer.get("id") in self._waiting:
                self._answers[answer["id"]] = answer
