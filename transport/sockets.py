"""Every ZeroMQ socket of the transport is made here, with all its limits and its security.

``make_socket`` takes every limit as a required keyword, so no socket of a job can exist without
a linger period, a maximum message size, bounded queues where they can be bounded, and CURVE
when the job has a token (transport.auth derives the keys). The sockets of the transport:

=====================  ========  =========  =========  =================================
socket                 kind      RCVHWM     SNDHWM     why
=====================  ========  =========  =========  =================================
orchestrator           ROUTER    64         1000       drained continuously by its loop
orchestrator client    DEALER    64         64         small control messages
data service           ROUTER    16         (unused)   bounded: senders back off over TCP
data service dealer    DEALER    1          0          never blocks (see below); receives nothing
=====================  ========  =========  =========  =================================

High-water marks count messages per connection. A data service's receive queue is bounded, so a
stranger flooding it (before a background drain drops what it sent) costs at most RCVHWM x
MAXMSGSIZE per connection; a legitimate sender that gets ahead is slowed by TCP flow control
instead. A dealer's send queue is unbounded on purpose: it holds only this node's own arrays,
lent without copying, for the current step, and a send that could block could deadlock two
nodes sending to each other before either receives. Monitor sockets (inproc PAIRs pyzmq makes
for socket events) are the only sockets made elsewhere; they never leave the process.

``watch_connections`` watches a listening socket's connections: the ones it refuses (a failed
CURVE handshake: logged, naming the peer's address) and the ones that close (the owner's
``on_closed``: the orchestrator and the data services name a dead peer at once with it).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket as _socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from collective.transport.auth import HANDSHAKE_FAILED, secure
from collective.transport.logs import Throttle

__all__ = ["UNKNOWN_ADDRESS", "ConnectionWatch", "connection_of", "make_socket", "watch_connections"]

log = logging.getLogger(__name__)

UNKNOWN_ADDRESS = "an unknown address"  # a peer whose address could not be read
_WATCHED = HANDSHAKE_FAILED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
_POLL_MS = 100
RECENT = 16  # refused connections remembered (for the orchestrator's waiting messages)


def make_socket(
    context: zmq.Context[Any],
    kind: int,
    *,
    token: str | None,
    server: bool,
    max_message: int,
    receive_hwm: int,
    send_hwm: int,
    linger: float = 0.0,
    routing_id: bytes | None = None,
) -> zmq.Socket[Any]:
    """A socket of ``kind`` with these limits; a CURVE server (``server``) or client when ``token`` is set.

    ``linger`` is in seconds; ``send_hwm=0`` (unbounded) is for sockets whose queue holds only this
    process's own data (see the module docstring).
    """
    socket: zmq.Socket[Any] = context.socket(kind)
    try:
        socket.setsockopt(zmq.LINGER, int(1000 * linger))
        socket.setsockopt(zmq.MAXMSGSIZE, max_message)
        socket.setsockopt(zmq.RCVHWM, receive_hwm)
        socket.setsockopt(zmq.SNDHWM, send_hwm)
        if routing_id is not None:
            socket.setsockopt(zmq.ROUTING_ID, routing_id)
        secure(socket, token, server=server)
    except BaseException:
        socket.close(0)
        raise
    return socket


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


class ConnectionWatch:
    """Watches the connections a listening socket accepts, from a small thread: logs every one it
    refuses (a failed handshake, with ``refusals``) and calls ``on_closed(fd)`` when an accepted
    connection closes (its peer's process exited, crashed or was killed: the kernel closed its end).

    ZeroMQ's monitor reports an accepted connection with its file descriptor, and a failed handshake
    followed at once by the disconnection of that descriptor: the refused peer's address is read
    from the descriptor when it is accepted. The socket's owner tells connections apart by that
    descriptor (``zmq.SRCFD`` of a message received on it). ``stop()`` ends the thread before
    closing the monitor socket, which only that thread uses.
    """

    def __init__(
        self,
        socket: zmq.Socket[Any],
        where: str,
        refusals: bool = True,
        on_closed: Callable[[int], None] | None = None,
    ) -> None:
        self._socket = socket
        self._where = where
        self._refusals = refusals
        self._on_closed = on_closed
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
                    if self._refusals:
                        self._refuse(peer)
                elif self._on_closed is not None:
                    try:
                        self._on_closed(int(value))
                    except Exception:  # (the watch goes on)
                        log.exception("%s: handling a closed connection failed", self._where)

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


def connection_of(frame: zmq.Frame) -> int | None:
    """The connection (descriptor) a received frame came on, as ``on_closed`` names it (None when
    libzmq cannot tell)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except zmq.ZMQError:
        return None


def watch_connections(
    socket: zmq.Socket[Any],
    where: str,
    refusals: bool = True,
    on_closed: Callable[[int], None] | None = None,
) -> ConnectionWatch:
    """Start watching the connections ``socket`` accepts (ConnectionWatch); call ``stop()`` on the
    result before closing it."""
    return ConnectionWatch(socket, where, refusals, on_closed)
