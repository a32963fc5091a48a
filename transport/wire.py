"""The wire format between nodes: one msgpack header frame, then raw array buffer frames.

Every message is a ZeroMQ multipart message ``[header, *payload]``. The header is a msgpack map
with at least ``t`` (type), ``job`` (job name), ``seq`` (collective step) and ``src`` (sending node
index). Types:

``data``  a chunk of the array of step ``seq``: ``off`` and ``n`` (first element and element count)
          plus the fields the caller asks every chunk to repeat (collective.protocol.check_fields),
          so every transfer re-checks that both sides run the same step. One payload frame of
          ``n`` elements, or ``shm``: the slot of the sender's shared-memory segment holding it.
``ack``   a shared-memory slot has been read (transport.network); ``abort``: the sender gave up
          step ``seq``. The messages about collectives (``call``, ``verdict``, ``p2p``) are
          collective.protocol's.

Nothing is unpickled: headers are msgpack with bounded sizes, payloads are raw bytes whose length
must equal what the header declares, and declared sizes are checked against the receiver's own
expectations before anything is allocated for them.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

__all__ = [
    "CHUNK_BYTES",
    "SMALL_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_MESSAGE_BYTES",
    "WireError",
    "declared_bytes",
    "decode_header",
    "dtype_from_name",
    "encode_header",
]

CHUNK_BYTES = 4 << 20  # large arrays travel in chunks of this size: ZeroMQ moves 2-8 MiB messages fastest
SMALL_BYTES = 64 << 10  # arrays up to this size travel inside the call header (one frame, one round)
MAX_HEADER_BYTES = SMALL_BYTES + (16 << 10)
MAX_MESSAGE_BYTES = CHUNK_BYTES + MAX_HEADER_BYTES  # socket-level limit (ZMQ_MAXMSGSIZE)

_NATIVE_NAMES = ["float16", "float32", "float64", "complex64", "complex128",
                 "int16", "int32", "int64", "uint16", "uint32", "uint64"]  # fmt: skip
_DTYPE_NAMES = frozenset(
    ["bfloat16", "int8", "uint8", *_NATIVE_NAMES]
    # and both byte orders spelled out ('>f4'; str() of a non-native dtype): numpy computes in them
    + [np.dtype(name).newbyteorder(order).str for name in _NATIVE_NAMES for order in ("<", ">")]
)


class WireError(ValueError):
    """A message that does not follow the wire format (it is dropped and logged)."""


def encode_header(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)  # type: ignore[no-any-return]


def decode_header(frame: bytes | memoryview) -> dict[str, Any]:
    """Parse a header frame; raises WireError for anything but a bounded msgpack map with job/seq/src/t."""
    if len(frame) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(
            frame,
            raw=False,
            max_str_len=4096,
            max_bin_len=SMALL_BYTES,
            max_array_len=MAX_HEADER_BYTES,  # bounded by the header's size (a coalesced call's list)
            max_map_len=32,
        )
    except Exception as exc:  # msgpack raises several types for malformed input
        raise WireError(f"undecodable header: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("header is not a map")
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
