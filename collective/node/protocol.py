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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from collective.calls.fields import as_sent, counted, shape_of, signature_fields, signature_from_fields
from collective.calls.signature import Signature
from collective.errors import CollectiveError
from collective.transport.wire import CHUNK_BYTES, ErrorRecord, WireError, dtype_from_name

__all__ = [
    "VERDICT_GRACE",
    "CallMessage",
    "P2PMessage",
    "VerdictMessage",
    "decode_call",
    "given_up",
    "verdict_error",
]

VERDICT_GRACE = 1.0  # a node whose step failed reports it as its deadline passes: others wait this long more
LATE_MARGIN = VERDICT_GRACE / 2  # a node joins a step only if its call reaches every other node this early


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
BELL_TAG = FINISHED_TAG + 1  # a p2p message with it wakes a receiver: shared memory has messages for it
SKIP_TAG = FINISHED_TAG + 2  # one with it takes the turn of a message whose sender failed in its middle


@dataclass(frozen=True)
class P2PMessage:
    """One point-to-point array, or part ``part`` of ``parts`` of one (message ``ident`` of its
    process): an array over PART_BYTES travels in parts (reassembled by collective.node.mailbox.Mailbox).
    ``order`` numbers the messages from one node to another (-1: none, delivered as it comes): they
    take two paths on one host, TCP and shared memory, and are delivered in this order."""

    sender: int
    receiver: int
    tag: int
    shape: tuple[int, ...]
    dtype: str
    ident: int = 0
    part: int = 0
    parts: int = 1
    order: int = -1

    @classmethod
    def of(cls, sender: int, receiver: int, tag: int, data: Any) -> P2PMessage:
        """The message that carries the array ``data`` whole."""
        name = _NAMES.get(data.dtype) or _NAMES.setdefault(data.dtype, str(data.dtype))
        return cls(sender, receiver, tag, tuple(data.shape), name)

    def encode(self) -> dict[str, Any]:
        return {
            "t": "p2p",
            "seq": 0,
            "from": self.sender,
            "to": self.receiver,
            "tag": self.tag,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "id": self.ident,
            "part": self.part,
            "parts": self.parts,
            "order": self.order,
        }

    @classmethod
    def decode(cls, header: dict[str, Any]) -> P2PMessage:
        sender, receiver, tag = header.get("from"), header.get("to"), header.get("tag")
        if not (counted(sender) and counted(receiver) and counted(tag)):
            raise WireError("invalid p2p addressing")
        ident, part, parts = header.get("id", 0), header.get("part", 0), header.get("parts", 1)
        if not (counted(ident) and counted(part) and counted(parts, minimum=1) and part < parts):
            raise WireError(f"invalid p2p part {part!r} of {parts!r}")
        order = header.get("order", -1)
        if not counted(order, minimum=-1):
            raise WireError(f"invalid p2p order {order!r}")
        name = header.get("dtype")
        dtype = _DTYPE_NAMES.get(name) if isinstance(name, str) else None
        if dtype is None:
            dtype = str(dtype_from_name(name))  # (WireError unless it is one)
            _DTYPE_NAMES[str(name)] = dtype
        return cls(sender, receiver, tag, shape_of(header.get("shape")), dtype, ident, part, parts, order)


# dtype names, each made once (numpy makes them anew each time: microseconds, a message's budget)
_NAMES: dict[Any, str] = {}  # a dtype -> its name on the wire
_DTYPE_NAMES: dict[str, str] = {}  # a dtype's name on the wire -> numpy's name of it (checked)


def verdict_error(
    step: int, verdicts: list[tuple[int, VerdictMessage]], describe: Callable[[int], str]
) -> CollectiveError:
    """The error of a step that failed locally on some node: its class, every node's message."""
    records = [(node, verdict.record) for node, verdict in verdicts]
    message = "; ".join(f"{describe(node)}: {record.message}" for node, record in records)
    peers = sorted({peer for _, record in records for peer in record.peers})
    return ErrorRecord(records[0][1].name, tuple(peers), message).error(f"step {step} failed")
