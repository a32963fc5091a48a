"""The wire format between nodes: one msgpack header frame, then raw array buffer frames.

Every message is a ZeroMQ multipart message ``[header, *payload]``. The header is a msgpack map
with at least ``t`` (type), ``job`` (job name), ``seq`` (collective step) and ``src`` (sending node
index). Types:

``call``  one node's CallSpec for step ``seq`` (kind, op, root, shape, dtype, has_data, error),
          plus ``small``: the node's (already locally reduced) array as raw bytes when it holds
          at most SMALL_BYTES, else absent; or ``verdict`` {class, message} when the node's local
          step failed. Exchanged all-to-all among node leaders before any data moves.
``data``  a chunk of the array of step ``seq``: ``off`` and ``n`` (first element and element count)
          plus the call's kind / op / root / shape / dtype, so every transfer re-checks that both
          sides run the same collective. One payload frame of ``n`` elements.

Nothing is unpickled: headers are msgpack with bounded sizes, payloads are raw bytes whose length
must equal what the header declares, and declared sizes are checked against the receiver's own
expectations before anything is allocated for them.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from collective.algorithms.ops import ReduceOp
from collective.calls import CallSpec

__all__ = [
    "CHUNK_BYTES",
    "SMALL_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_MESSAGE_BYTES",
    "WireError",
    "decode_header",
    "dtype_from_name",
    "encode_header",
    "spec_from_header",
    "spec_to_header",
]

CHUNK_BYTES = 4 << 20  # large arrays travel in chunks of this size: ZeroMQ moves 2-8 MiB messages fastest
SMALL_BYTES = 64 << 10  # arrays up to this size travel inside the call header (one frame, one round)
MAX_HEADER_BYTES = SMALL_BYTES + (16 << 10)
MAX_MESSAGE_BYTES = CHUNK_BYTES + MAX_HEADER_BYTES  # socket-level limit (ZMQ_MAXMSGSIZE)
_MAX_DIMS = 32

_DTYPE_NAMES = frozenset(
    ["float16", "float32", "float64", "bfloat16", "complex64", "complex128",
     "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
)  # fmt: skip


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
            max_array_len=_MAX_DIMS,
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


def spec_to_header(spec: CallSpec) -> dict[str, Any]:
    return {
        "kind": spec.kind,
        "op": spec.op.value if spec.op is not None else None,
        "root": spec.root,
        "shape": list(spec.shape) if spec.shape is not None else None,
        "dtype": str(spec.dtype) if spec.dtype is not None else None,
        "has_data": spec.has_data,
        "error": spec.error,
    }


def spec_from_header(header: dict[str, Any]) -> CallSpec:
    """The CallSpec a ``call`` header carries; raises WireError if any field is malformed."""
    kind = header.get("kind")
    if kind not in ("all_reduce", "reduce", "broadcast"):
        raise WireError(f"unknown collective {kind!r}")
    op_name, root, shape, dtype = (
        header.get("op"),
        header.get("root"),
        header.get("shape"),
        header.get("dtype"),
    )
    op = None
    if op_name is not None:
        try:
            op = ReduceOp.parse(op_name)
        except ValueError:
            raise WireError(f"unknown reduce op {op_name!r}") from None
    if root is not None and (not isinstance(root, int) or isinstance(root, bool) or root < 0):
        raise WireError(f"invalid root {root!r}")
    if shape is not None:
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise WireError(f"invalid shape {shape!r}")
        shape = tuple(shape)
    error = header.get("error")
    if error is not None and not isinstance(error, str):
        raise WireError("invalid error field")
    return CallSpec(
        kind,
        op,
        root,
        shape,
        None if dtype is None else dtype_from_name(dtype),
        bool(header.get("has_data")),
        error,
    )
