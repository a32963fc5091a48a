"""The messages node leaders exchange about collectives: one typed class per kind.

Each message encodes to a header map (the transport adds ``job`` and ``src`` and frames it with
the bounded codec of transport.wire) and decodes from one with every field validated; a malformed
message is a WireError, which the caller turns into the error its users see. Kinds:

``call``     a node's agreed Signature for step ``seq`` (kind, op, root, shape, dtype, has_data,
             error, parts, sizes, table), plus ``small``: the node's contribution as raw bytes when
             it holds at most SMALL_BYTES (then no data messages follow: every node combines them).
``verdict``  instead of a call: the node's local step failed (its transport.wire.ErrorRecord).
``p2p``      a point-to-point array from peer ``from`` to peer ``to`` with ``tag`` (payload frame).

Data chunks (``data``), shared-memory acknowledgements (``ack``) and ``abort`` are the
transport's own (transport.zmq_link, transport.network); ``check_fields`` gives the signature
fields every data chunk repeats so a receiver can compare them with its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

from collective.algorithms.ops import ReduceOp
from collective.calls import CALLS
from collective.errors import CollectiveError
from collective.signature import Signature
from collective.transport.wire import CHUNK_BYTES, ErrorRecord, WireError, dtype_from_name

__all__ = [
    "MANY_PARTS",
    "as_sent",
    "VERDICT_GRACE",
    "CallMessage",
    "P2PMessage",
    "VerdictMessage",
    "check_fields",
    "decode_call",
    "digested",
    "given_up",
    "verdict_error",
]

MANY_PARTS = 256  # a call listing more arrays than this sends their digest (``digested``)
VERDICT_GRACE = 1.0  # a node whose step failed reports it as its deadline passes: others wait this long more
LATE_MARGIN = VERDICT_GRACE / 2  # a node joins a step only if its call reaches every other node this early


def _is_int(value: Any, minimum: int = 0) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _ints(value: Any, name: str) -> tuple[int, ...]:
    """A list of integers (sizes, a table row: -1 stands for none)."""
    if not isinstance(value, list | tuple) or not all(_is_int(v, -1) for v in value):
        raise WireError(f"invalid {name} {value!r}")
    return tuple(value)


def _shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(_is_int(d) for d in value):
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
    return {
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
    if root is not None and not _is_int(root):
        raise WireError(f"invalid root {root!r}")
    if error is not None and not isinstance(error, str):
        raise WireError("invalid error field")
    parts = header.get("parts") or []
    if not isinstance(parts, list) or not all(isinstance(p, list) and len(p) == 2 for p in parts):
        raise WireError("invalid parts field")
    table = header.get("table") or []
    if not isinstance(table, list) or not all(isinstance(t, list) and len(t) == 2 for t in table):
        raise WireError("invalid table field")
    if not all(_is_int(rank) for rank, _ in table):
        raise WireError("invalid table field")
    return Signature(
        kind,
        op,
        root,
        None if shape is None else _shape(shape),
        None if dtype is None else dtype_from_name(dtype),
        bool(header.get("has_data")),
        error,
        tuple((_shape(shape), str(dtype_from_name(name))) for shape, name in parts),
        _ints(header.get("sizes") or [], "sizes"),
        tuple((rank, _ints(values, "table")) for rank, values in table),
    )


@dataclass(frozen=True)
class CallMessage:
    seq: int
    signature: Signature
    small: bytes | None = None
    until: float | None = None  # the wall-clock time at which the sender gives up waiting for the others

    def encode(self) -> dict[str, Any]:
        header = {"t": "call", "seq": self.seq, **signature_fields(as_sent(self.signature))}
        if self.small is not None:
            header["small"] = self.small
        if self.until is not None:
            header["until"] = self.until
        return header


def given_up(calls: list[tuple[int, dict[str, Any]]], now: float) -> tuple[int, float] | None:
    """(node, seconds past its deadline) of the first call here whose sender gives up the step before
    a call sent ``now`` would surely reach it, or None. A node that finds one must not join the step:
    the others might complete it without its sender, or its sender without the others."""
    for node, header in calls:
        until = header.get("until")
        if isinstance(until, int | float) and not isinstance(until, bool) and now > until - LATE_MARGIN:
            return node, now - (until - VERDICT_GRACE)
    return None


@dataclass(frozen=True)
class VerdictMessage:
    seq: int
    record: ErrorRecord

    @classmethod
    def of(cls, seq: int, error: CollectiveError) -> VerdictMessage:
        return cls(seq, ErrorRecord.of(error))

    def encode(self) -> dict[str, Any]:
        return {"t": "verdict", "seq": self.seq, **self.record.fields()}


def decode_call(header: dict[str, Any]) -> CallMessage | VerdictMessage:
    """A ``call`` or ``verdict`` header as its message; WireError for anything else."""
    if header.get("t") == "verdict":
        return VerdictMessage(header["seq"], ErrorRecord.from_fields(header))
    if header.get("t") != "call":
        raise WireError(f"expected a call, got a {header.get('t')!r} message")
    small = header.get("small")
    if small is not None and not isinstance(small, bytes):
        raise WireError("invalid small payload")
    until = header.get("until")
    if until is not None and (isinstance(until, bool) or not isinstance(until, int | float)):
        raise WireError("invalid deadline of a call")
    return CallMessage(header["seq"], signature_from_fields(header), small, until)


PART_BYTES = CHUNK_BYTES  # an array larger than this travels between processes in parts of this size
FINISHED_TAG = 1 << 63  # (past every user tag) a p2p message with it says its sender called finish()


@dataclass(frozen=True)
class P2PMessage:
    """One point-to-point array, or part ``part`` of ``parts`` of one (message ``ident`` of its
    process): an array over PART_BYTES travels in parts (reassembled by collective.p2p.Mailbox)."""

    sender: int
    receiver: int
    tag: int
    shape: tuple[int, ...]
    dtype: str
    ident: int = 0
    part: int = 0
    parts: int = 1

    def encode(self) -> dict[str, Any]:
        return {"t": "p2p", "seq": 0, "from": self.sender, "to": self.receiver, "tag": self.tag,
                "shape": list(self.shape), "dtype": self.dtype, "id": self.ident, "part": self.part,
                "parts": self.parts}  # fmt: skip

    @classmethod
    def decode(cls, header: dict[str, Any]) -> P2PMessage:
        sender, receiver, tag = header.get("from"), header.get("to"), header.get("tag")
        if not (_is_int(sender) and _is_int(receiver) and _is_int(tag)):
            raise WireError("invalid p2p addressing")
        ident, part, parts = header.get("id", 0), header.get("part", 0), header.get("parts", 1)
        if not (_is_int(ident) and _is_int(part) and _is_int(parts, minimum=1) and part < parts):
            raise WireError(f"invalid p2p part {part!r} of {parts!r}")
        dtype = str(dtype_from_name(header.get("dtype")))
        return cls(sender, receiver, tag, _shape(header.get("shape")), dtype, ident, part, parts)


def verdict_error(
    step: int, verdicts: list[tuple[int, VerdictMessage]], describe: Callable[[int], str]
) -> CollectiveError:
    """The error of a step that failed locally on some node: its class, every node's message."""
    records = [(node, verdict.record) for node, verdict in verdicts]
    message = "; ".join(f"{describe(node)}: {record.message}" for node, record in records)
    peers = sorted({peer for _, record in records for peer in record.peers})
    return ErrorRecord(records[0][1].name, tuple(peers), message).error(f"step {step} failed")
