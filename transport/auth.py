"""The job token: ZeroMQ CURVE with key pairs derived from a shared secret.

When a job has a token, the orchestrator and every data service are CURVE servers whose key pair
is derived from the token, and every node's sockets are CURVE clients with the server's public key
and a client key pair derived from the same token. A connection that cannot complete the CURVE
handshake (wrong token, or none) is dropped by ZeroMQ before any message is delivered; the token
never crosses the wire (CURVE is a challenge-response over Curve25519 keys, and it encrypts the
traffic too). Socket monitors turn failed handshakes into a log line on the refusing side (naming
the refused peer's address) and a RegistrationError on the refused side.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import socket as _socket
import threading
import time
from typing import Any

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from collective.transport.logs import Throttle

__all__ = [
    "HANDSHAKE_FAILED",
    "UNKNOWN_ADDRESS",
    "RefusalWatch",
    "handshake_failure",
    "secure",
    "watch_refusals",
]

UNKNOWN_ADDRESS = "an unknown address"  # a peer whose address could not be read

log = logging.getLogger(__name__)

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_WATCHED = HANDSHAKE_FAILED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
_POLL_MS = 100
RECENT = 16  # refused connections remembered (for the orchestrator's waiting messages)


def _key_pair(token: str, role: str) -> tuple[bytes, bytes]:
    secret = z85.encode(hashlib.sha256(f"collective/curve/{role}/{token}".encode()).digest())
    return zmq.curve_public(secret), secret


def secure(socket: zmq.Socket[Any], token: str | None, server: bool) -> None:
    """Make ``socket`` a CURVE server or client for ``token`` (nothing when the job has no token)."""
    if token is None:
        return
    server_public, server_secret = _key_pair(token, "server")
    if server:
        socket.curve_server = True
        socket.curve_secretkey = server_secret
        socket.curve_publickey = server_public
    else:
        client_public, client_secret = _key_pair(token, "client")
        socket.curve_serverkey = server_public
        socket.curve_publickey = client_public
        socket.curve_secretkey = client_secret


def handshake_failure(event: Any) -> bool:
    """Whether a socket monitor event reports a failed handshake."""
    return bool(event["event"] & HANDSHAKE_FAILED)


def _peer_name(fd: int) -> str:
    """host:port of the remote end of the TCP connection ``fd`` (a descriptor libzmq owns)."""
    try:
        duplicate = os.dup(fd)  # libzmq's descriptor stays untouched
    except OSError:
        return UNKNOWN_ADDRESS
    try:
        with _socket.socket(fileno=duplicate) as sock:
            duplicate = -1  # the socket owns it now
            host, port = sock.getpeername()[:2]
    except (OSError, ValueError, TypeError):
        return UNKNOWN_ADDRESS
    finally:
        if duplicate >= 0:
            os.close(duplicate)
    return f"{host}:{port}"


class RefusalWatch:
    """Logs every connection a listening socket refuses (failed handshake) from a small thread.

    ZeroMQ's monitor reports an accepted connection with its file descriptor, and a failed handshake
    followed at once by the disconnection of that descriptor: the refused peer's address is read
    from the descriptor when it is accepted. ``stop()`` ends the thread before closing the monitor
    socket, which only that thread uses.
    """

    def __init__(self, socket: zmq.Socket[Any], where: str) -> None:
        self._socket = socket
        self._where = where
        self._throttle = Throttle(log)
        self._lock = threading.Lock()
        self._recent: collections.deque[tuple[float, str]] = collections.deque(maxlen=RECENT)
        self._count = 0
        self._stopping = threading.Event()
        self._monitor = socket.get_monitor_socket(_WATCHED)
        self._thread = threading.Thread(target=self._run, name="collective-refusals", daemon=True)
        self._thread.start()

    def refused(self) -> tuple[int, list[tuple[float, str]]]:
        """(connections refused so far, the latest (monotonic time, peer address) pairs)."""
        with self._lock:
            return self._count, list(self._recent)

    def _run(self) -> None:
        peers: dict[int, str] = {}  # descriptor -> remote address, for connections still open
        failed = False  # the next disconnection is that of a refused connection
        while True:
            if not self._monitor.poll(_POLL_MS):
                self._throttle.flush()
                if self._stopping.is_set():  # the stop event was lost (monitor queue full): drained
                    return
                continue
            try:
                event = recv_monitor_message(self._monitor)
            except zmq.ZMQError:
                return
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_MONITOR_STOPPED:
                return
            if kind == zmq.EVENT_ACCEPTED:
                peers[int(value)] = _peer_name(int(value))
                log.debug("%s accepted a connection from %s", self._where, peers[int(value)])
            elif kind & HANDSHAKE_FAILED:
                failed = True
            elif kind == zmq.EVENT_DISCONNECTED:
                peer = peers.pop(int(value), UNKNOWN_ADDRESS)
                if failed:
                    failed = False
                    self._refuse(peer)

    def _refuse(self, peer: str) -> None:
        with self._lock:
            self._count += 1
            self._recent.append((time.monotonic(), peer))
        self._throttle.warning(
            "%s refused a connection from %s: the handshake failed (wrong or missing job token)",
            self._where,
            peer,
        )

    def stop(self) -> None:
        """Stop monitoring and end the thread; the socket itself stays open."""
        self._stopping.set()
        with contextlib.suppress(zmq.ZMQError):
            self._socket.disable_monitor()  # sends EVENT_MONITOR_STOPPED: the thread returns at once
        self._thread.join(5)
        if self._thread.is_alive():  # never seen: closing under a reading thread would abort libzmq
            log.error("%s: the connection monitor did not stop; its socket is left open", self._where)
            return
        self._monitor.close(0)


def watch_refusals(socket: zmq.Socket[Any], where: str) -> RefusalWatch:
    """Start logging the connections ``socket`` refuses; call ``stop()`` on the result before closing it."""
    return RefusalWatch(socket, where)
