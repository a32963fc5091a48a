"""The wire format between nodes: one msgpack header frame, then raw array buffer frames.

Every message is a ZeroMQ multipart message ``[header, *payload]``. The header is a msgpack map
with at least ``t`` (type), ``job`` (job name), ``seq`` (collective step) and ``src`` (sending node
index). Types:

``data``  a chunk of the array of step ``seq``: ``off`` and ``n`` (first element and element count)
          plus the fields the caller asks every chunk to repeat (collective.node.protocol.check_fields),
          so every transfer re-checks that both sides run the same step. One payload frame of
          ``n`` elements, or ``shm``: the slot of the sender's shared-memory segment holding it.
``ack``   a shared-memory slot has been read (transport.network); ``abort``: the sender gave up
          step ``seq``, and why (an ErrorRecord's fields). The messages about collectives
          (``call``, ``verdict``, ``p2p``) are collective.node.protocol's.

Nothing is unpickled: headers are msgpack with bounded sizes, payloads are raw bytes whose length
must equal what the header declares, and declared sizes are checked against the receiver's own
expectations before anything is allocated for them. ``decode_map`` is the one bounded msgpack
decoder (headers here, the orchestrator's messages, calls in shared memory), and ``ErrorRecord``
the one form of a failure that travels between processes (a verdict, an abort, a shared-memory
abort record).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from collective.errors import (
    CollectiveError,
    CollectiveTimeout,
    InvalidArgumentError,
    MismatchError,
    PeerLostError,
)

__all__ = [
    "CHUNK_BYTES",
    "SMALL_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_ERROR_PEERS",
    "MAX_ERROR_TEXT",
    "ErrorRecord",
    "WireError",
    "declared_bytes",
    "decode_header",
    "decode_map",
    "dtype_from_name",
    "encode_header",
]

CHUNK_BYTES = 4 << 20  # large arrays travel in chunks of this size: ZeroMQ moves 2-8 MiB messages fastest
SMALL_BYTES = 64 << 10  # arrays up to this size travel inside the call header (one frame, one round)
MAX_HEADER_BYTES = SMALL_BYTES + (16 << 10)
MAX_MESSAGE_BYTES = CHUNK_BYTES + MAX_HEADER_BYTES  # socket-level limit (ZMQ_MAXMSGSIZE)

_NATIVE_NAMES = [
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
]
_DTYPE_NAMES = frozenset(
    ["bfloat16", "int8", "uint8", *_NATIVE_NAMES]
    # and both byte orders spelled out ('>f4'; str() of a non-native dtype): numpy computes in them
    + [np.dtype(name).newbyteorder(order).str for name in _NATIVE_NAMES for order in ("<", ">")]
)


class WireError(ValueError):
    """A message that does not follow the wire format (it is dropped and logged)."""


MAX_ERROR_TEXT = 2000  # characters of a failure's message that travel
MAX_ERROR_PEERS = 64  # peers a failure names when it travels
_AS_THEMSELVES = {kind.__name__: kind for kind in (CollectiveError, InvalidArgumentError, MismatchError)}


@dataclass(frozen=True)
class ErrorRecord:
    """A failure as it travels between processes: its class, the peers it names, its message.

    A ``verdict`` of the call exchange and an ``abort`` carry its ``fields()`` in their headers; a
    shared-memory abort record holds its ``line()``, ``Class|peers|message``. ``error()`` makes it
    an error again on the side that receives it.
    """

    name: str  # the error's class: ours by their public class, any other by its own name
    peers: tuple[int, ...] = ()  # the peers it names (a timeout's missing ones, a lost one)
    message: str = ""

    @classmethod
    def of(cls, error: BaseException) -> ErrorRecord:
        """The record of ``error`` (its message and peers cut to their bounds)."""
        kind, peers = type(error), ()
        if isinstance(error, CollectiveError):  # (a subclass of ours travels as the one users catch)
            kind = next(k for k in kind.__mro__ if k.__module__ == CollectiveError.__module__)
            peers = getattr(error, "missing", None) or getattr(error, "peers", None) or ()
        return cls(kind.__name__, tuple(peers)[:MAX_ERROR_PEERS], str(error)[:MAX_ERROR_TEXT])

    def fields(self) -> dict[str, Any]:
        """The record as fields of a message header."""
        return {"class": self.name, "peers": list(self.peers), "message": self.message}

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> ErrorRecord:
        """The record a header carries; WireError if a field is malformed or over its bound."""
        name, peers, message = fields.get("class"), fields.get("peers", []), fields.get("message")
        if not isinstance(name, str) or not name.isidentifier() or len(name) > 64:
            raise WireError(f"invalid error class {str(name)[:64]!r}")
        if not isinstance(message, str) or len(message) > MAX_ERROR_TEXT:
            raise WireError(f"invalid error message (a string of at most {MAX_ERROR_TEXT} characters)")
        if not isinstance(peers, list) or len(peers) > MAX_ERROR_PEERS or not all(_is_peer(p) for p in peers):
            raise WireError(f"invalid peers of an error (at most {MAX_ERROR_PEERS} peer ids)")
        return cls(name, tuple(peers), message)

    def line(self) -> str:
        """The record as one line of text (for the fixed-size abort records of a ring segment)."""
        return f"{self.name}|{','.join(map(str, self.peers))}|{self.message}"

    @classmethod
    def from_line(cls, line: str) -> ErrorRecord:
        """The record ``line()`` wrote, however cut short (a fixed-size record keeps its start)."""
        name, peers, message = [*line.split("|", 2), "", ""][:3]
        numbers = [int(p) for p in peers.split(",")[:MAX_ERROR_PEERS] if p.strip().isdigit()]
        return cls(name, tuple(numbers), message[:MAX_ERROR_TEXT])

    def error(self, context: str, peers: Iterable[int] = ()) -> CollectiveError:
        """The error on this side, ``context: message``: a timeout (naming the peers it missed) and
        the errors every process raises alike as themselves; any other (a lost peer, a closed job,
        an exception that is not ours) as a PeerLostError naming its peers, else ``peers``."""
        text = f"{context}: {self.message}"
        if self.name == CollectiveTimeout.__name__:
            return CollectiveTimeout(text, self.peers)
        kind = _AS_THEMSELVES.get(self.name)
        if kind is not None:
            error: CollectiveError = kind(text)
            return error
        return PeerLostError(text, self.peers or tuple(peers))

    def __str__(self) -> str:
        return f"{self.name}: {self.message}"


def _is_peer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def encode_header(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)  # type: ignore[no-any-return]


def decode_map(
    frame: bytes | memoryview,
    most: int,
    what: str,
    *,
    strings: int = -1,
    binary: int = -1,
    arrays: int = -1,
    entries: int = -1,
) -> dict[str, Any]:
    """``frame`` (at most ``most`` bytes) as a msgpack map; WireError for anything else (``what``
    names it). The limits bound string and binary lengths, array lengths and map entries (-1: the
    frame's length, msgpack's own default), so nothing is allocated past them."""
    if len(frame) > most:
        raise WireError(f"{what} of {len(frame)} bytes exceeds {most}")
    try:
        value = msgpack.unpackb(
            frame,
            raw=False,
            max_str_len=strings,
            max_bin_len=binary,
            max_array_len=arrays,
            max_map_len=entries,
        )
    except Exception as exc:  # msgpack raises several types for malformed input
        raise WireError(f"undecodable {what}: {exc}") from None
    if not isinstance(value, dict):
        raise WireError(f"{what} is not a map")
    return value


def decode_header(frame: bytes | memoryview) -> dict[str, Any]:
    """Parse a header frame; raises WireError for anything but a bounded msgpack map with job/seq/src/t."""
    header = decode_map(
        frame,
        MAX_HEADER_BYTES,
        "header",
        strings=4096,
        binary=SMALL_BYTES,
        arrays=MAX_HEADER_BYTES,  # bounded by the header's size (a coalesced call's list)
        entries=32,
    )
    expected = {"t": str, "job": str, "seq": int, "src": int}
    for key, kind in expected.items():
        if not isinstance(header.get(key), kind) or isinstance(header.get(key), bool):
            raise WireError(f"header field {key!r} missing or not a {kind.__name__}")
    return header


def dtype_from_name(name: Any) -> np.dtype[Any]:
    if not isinstance(name, str) or name not in _DTYPE_NAMES:
        raise WireError(f"unsupported dtype {name!r}")
    if name == "bfloat16":
        import ml_dtypes

        name = ml_dtypes.bfloat16
    dtype: np.dtype[Any] = np.dtype(name)
    return dtype


def declared_bytes(header: dict[str, Any]) -> int:
    """The size of the array a ``call`` header declares (0 if it declares none it can be sized by)."""
    shape, dtype = header.get("shape"), header.get("dtype")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        return 0
    try:
        return math.prod(shape) * dtype_from_name(dtype).itemsize
    except (WireError, ImportError):
        return 0
