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
"""

from __future__ import annotations

from typing import Any

import zmq

from collective.transport.auth import secure

__all__ = ["make_socket"]


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
