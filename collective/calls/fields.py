"""A Signature as the fields of a message: between nodes (collective.node.protocol's ``call``)
and in a shared-memory slot (collective.shm.ring's codec). Decoding checks every field, so a
malformed call is a WireError, never a wrong call.
"""

from __future__ import annotations

import hashlib
from typing import Any, TypeGuard

from collective.algorithms.ops import ReduceOp
from collective.algorithms.strategies import parse_strategy
from collective.calls import CALLS
from collective.calls.signature import Signature
from collective.errors import ConfigError
from collective.transport.wire import WireError, dtype_from_name

__all__ = [
    "MANY_PARTS",
    "as_sent",
    "check_fields",
    "counted",
    "digested",
    "shape_of",
    "signature_fields",
    "signature_from_fields",
]

MANY_PARTS = 256  # a call listing more arrays than this sends their digest (``digested``)


def counted(value: Any, minimum: int = 0) -> TypeGuard[int]:
    """Whether ``value`` is an int (no bool) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _ints(value: Any, name: str) -> tuple[int, ...]:
    """A list of integers (sizes, a table row: -1 stands for none)."""
    if not isinstance(value, list | tuple) or not all(counted(v, -1) for v in value):
        raise WireError(f"invalid {name} {value!r}")
    return tuple(value)


def shape_of(value: Any) -> tuple[int, ...]:
    """A shape from a message (WireError if it is not one)."""
    if not isinstance(value, list | tuple) or not all(counted(d) for d in value):
        raise WireError(f"invalid shape {value!r}")
    return tuple(value)


def digested(signature: Signature) -> Signature:
    """A signature whose long list of parts is cut to its first 4 and a digest of them all (a
    coalesced call of thousands of arrays still fits a message; lists that differ still differ)."""
    digest = hashlib.blake2b(repr(signature.parts).encode(), digest_size=6).digest()
    tail = ((len(signature.parts), *digest), "uint8")
    return signature._replace(parts=(*signature.parts[:4], tail))


def as_sent(signature: Signature) -> Signature:
    """The signature as a message carries it (between nodes, and through shared memory): a long
    list of parts as its digest. Compare a node's own call in this form."""
    parts = signature.parts
    if len(parts) > MANY_PARTS or sum([len(shape) for shape, _ in parts]) > 4 * MANY_PARTS:
        return digested(signature)
    return signature


def signature_fields(spec: Signature) -> dict[str, Any]:
    fields = {
        "kind": spec.kind,
        "op": spec.op.value if spec.op is not None else None,
        "root": spec.root,
        "shape": list(spec.shape) if spec.shape is not None else None,
        "dtype": str(spec.dtype) if spec.dtype is not None else None,
        "has_data": spec.has_data,
        "error": spec.error,
        "parts": [[list(shape), dtype] for shape, dtype in spec.parts],
        "sizes": list(spec.sizes),
        "table": [[rank, list(values)] for rank, values in spec.table],
    }
    if spec.strategy is not None:
        fields["strategy"] = spec.strategy
    return fields


def check_fields(spec: Signature) -> dict[str, Any]:
    """The fields every data chunk of a step repeats (the receiver compares them with its own)."""
    fields = signature_fields(spec)
    return {key: fields[key] for key in ("kind", "op", "root", "shape", "dtype")}


def signature_from_fields(header: dict[str, Any]) -> Signature:
    """The Signature a ``call`` header carries; raises WireError if any field is malformed."""
    kind = header.get("kind")
    if kind not in CALLS:
        raise WireError(f"unknown collective {kind!r}")
    op_name, root, shape, dtype, error = (header.get(k) for k in ("op", "root", "shape", "dtype", "error"))
    op = None
    if op_name is not None:
        try:
            op = ReduceOp.parse(op_name)
        except ValueError:
            raise WireError(f"unknown reduce op {op_name!r}") from None
    if root is not None and not counted(root):
        raise WireError(f"invalid root {root!r}")
    if error is not None and not isinstance(error, str):
        raise WireError("invalid error field")
    parts = header.get("parts") or []
    if not isinstance(parts, list) or not all(isinstance(p, list) and len(p) == 2 for p in parts):
        raise WireError("invalid parts field")
    table = header.get("table") or []
    if not isinstance(table, list) or not all(isinstance(t, list) and len(t) == 2 for t in table):
        raise WireError("invalid table field")
    if not all(counted(rank) for rank, _ in table):
        raise WireError("invalid table field")
    strategy = header.get("strategy")
    if strategy is not None:
        try:
            strategy = str(parse_strategy(strategy))
        except ConfigError:
            raise WireError(f"invalid strategy {strategy!r}") from None
    return Signature(
        kind,
        op,
        root,
        None if shape is None else shape_of(shape),
        None if dtype is None else dtype_from_name(dtype),
        bool(header.get("has_data")),
        error,
        tuple((shape_of(shape), str(dtype_from_name(name))) for shape, name in parts),
        _ints(header.get("sizes") or [], "sizes"),
        tuple((rank, _ints(values, "table")) for rank, values in table),
        strategy,
    )
