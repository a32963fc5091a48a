"""The job token: ZeroMQ CURVE with key pairs derived from a shared secret.

When a job has a token, the orchestrator and every data service are CURVE servers whose key pair
is derived from the token, and every node's sockets are CURVE clients with the server's public key
and a client key pair derived from the same token. A connection that cannot complete the CURVE
handshake (wrong token, or none) is dropped by ZeroMQ before any message is delivered; the token
never crosses the wire (CURVE is a challenge-response over Curve25519 keys, and it encrypts the
traffic too). Socket monitors turn failed handshakes into a log line on the refusing side (naming
the refused peer's address: transport.sockets.ConnectionWatch) and a RegistrationError on the
refused side.
"""

from __future__ import annotations

import hashlib
from typing import Any

import zmq
from zmq.utils import z85

__all__ = ["HANDSHAKE_FAILED", "handshake_failure", "secure"]

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


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
