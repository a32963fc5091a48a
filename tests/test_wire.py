"""transport.wire's two shared pieces: the one bounded msgpack decoder (and the limits each of its
callers gives it), and the one record of a failure that travels between processes."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from collective.calls.signature import Signature
from collective.errors import (
    CollectiveError,
    CollectiveTimeout,
    InvalidArgumentError,
    JobClosedError,
    MismatchError,
    PeerLostError,
)
from collective.node.protocol import VerdictMessage, decode_call, verdict_error
from collective.shm.ring import SignatureCodec
from collective.transport.orchestrator import MAX_MESSAGE, unpack
from collective.transport.shm_ring import MESSAGE_BYTES
from collective.transport.wire import (
    MAX_ERROR_PEERS,
    MAX_ERROR_TEXT,
    MAX_HEADER_BYTES,
    ErrorRecord,
    WireError,
    decode_header,
    decode_map,
)


class LocalProblem(InvalidArgumentError):
    """A subclass of ours, as collective.torch.checks has one."""


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


# -- the decoder ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "limits", "error"),
    [
        ({"a": "x" * 11}, {"strings": 10}, "undecodable thing"),
        ({"a": b"x" * 11}, {"binary": 10}, "undecodable thing"),
        ({"a": list(range(11))}, {"arrays": 10}, "undecodable thing"),
        ({str(i): i for i in range(11)}, {"entries": 10}, "undecodable thing"),
        ({"a": {str(i): i for i in range(11)}}, {"entries": 10}, "undecodable thing"),  # nested too
        ([1, 2], {}, "thing is not a map"),
    ],
    ids=["string", "binary", "array", "map", "nested map", "not a map"],
)
def test_decode_map_refuses_what_passes_a_bound(value: Any, limits: dict[str, int], error: str) -> None:
    with pytest.raises(WireError, match=error):
        decode_map(pack(value), 1 << 20, "thing", **limits)
    at_the_bound = {key: limit + 1 for key, limit in limits.items()}
    if at_the_bound:  # (one more is allowed: the bound is what is refused)
        assert decode_map(pack(value), 1 << 20, "thing", **at_the_bound) == value


def test_decode_map_refuses_a_long_frame_before_decoding_and_garbage() -> None:
    with pytest.raises(WireError, match="thing of 101 bytes exceeds 100"):
        decode_map(b"\x80" + b"\x00" * 100, 100, "thing")
    for garbage in (b"", b"\xc1", pack({"a": 1})[:-1], pack({"a": 1}) + b"\x00"):
        with pytest.raises(WireError, match="undecodable thing"):
            decode_map(garbage, 100, "thing")


def test_each_caller_keeps_its_limits_and_its_checks() -> None:
    header = {"t": "data", "job": "j", "seq": 0, "src": 1}
    assert decode_header(pack(header)) == header
    with pytest.raises(WireError, match="exceeds"):
        decode_header(pack({**header, "small": b"x" * MAX_HEADER_BYTES}))
    with pytest.raises(WireError, match="undecodable header"):
        decode_header(pack({**header, "job": "j" * 4097}))
    with pytest.raises(WireError, match="'src' missing"):
        decode_header(pack({"t": "data", "job": "j", "seq": 0}))
    # the orchestrator's: binary values (a store's) within the message's bound, strings of 4 KiB,
    # None for anything it refuses
    assert unpack(pack({"t": "heartbeat", "job": "j"})) == {"t": "heartbeat", "job": "j"}
    assert unpack(pack({"t": "kv", "job": "j", "x": b"\x00"})) == {"t": "kv", "job": "j", "x": b"\x00"}
    assert unpack(pack({"t": "kv", "job": "j", "x": b"\x00" * MAX_MESSAGE})) is None
    assert unpack(pack({"t": "heartbeat", "job": "j" * 4097})) is None
    assert unpack(pack({"t": "heartbeat"})) is None
    assert unpack(b"\x80" * (MAX_MESSAGE + 1)) is None
    # a call in shared memory: at most a slot's message, 32 fields
    codec = SignatureCodec()
    signature = Signature("all_reduce", None, None, (4,), np.dtype("float32"))
    message, _ = codec.encode(signature)
    assert SignatureCodec().decode(message) == signature
    with pytest.raises(WireError, match="undecodable call"):
        codec.decode(pack({str(i): i for i in range(33)}))
    with pytest.raises(WireError, match="exceeds"):
        codec.decode(pack({"kind": "x" * MESSAGE_BYTES}))


# -- the error record ----------------------------------------------------------------------------


def test_a_record_round_trips_through_a_header_and_a_line() -> None:
    record = ErrorRecord.of(CollectiveTimeout("peer 2 never came | nor 3", [2, 3]))
    assert record == ErrorRecord("CollectiveTimeout", (2, 3), "peer 2 never came | nor 3")
    header = decode_header(pack({"t": "abort", "job": "j", "seq": 1, "src": 0, **record.fields()}))
    assert ErrorRecord.from_fields(header) == record
    assert ErrorRecord.from_line(record.line()) == record
    assert str(record) == "CollectiveTimeout: peer 2 never came | nor 3"
    verdict = VerdictMessage.of(4, MismatchError("shapes differ"))
    assert decode_call(verdict.encode()) == verdict


def test_a_record_is_bounded_both_ways() -> None:
    record = ErrorRecord.of(PeerLostError("x" * 5000, range(100)))
    assert len(record.message) == MAX_ERROR_TEXT and len(record.peers) == MAX_ERROR_PEERS
    assert ErrorRecord.from_fields(record.fields()) == record
    for wrong in (
        {"class": "A" * 65, "message": ""},
        {"class": "not a name", "message": ""},
        {"class": 7, "message": ""},
        {"class": "MismatchError"},
        {"class": "MismatchError", "message": "x" * (MAX_ERROR_TEXT + 1)},
        {"class": "MismatchError", "message": "", "peers": list(range(MAX_ERROR_PEERS + 1))},
        {"class": "MismatchError", "message": "", "peers": [-1]},
        {"class": "MismatchError", "message": "", "peers": [True]},
    ):
        with pytest.raises(WireError):
            ErrorRecord.from_fields(wrong)
    cut = ErrorRecord.from_line(record.line()[:100])  # a fixed-size record keeps the start of the line
    assert cut.name == "PeerLostError" and cut.message == ""


@pytest.mark.parametrize(
    ("error", "kind", "peers"),
    [
        (CollectiveTimeout("late", [4]), CollectiveTimeout, (4,)),
        (CollectiveTimeout("late"), CollectiveTimeout, ()),  # (never the recorder: it is not late)
        (MismatchError("differ"), MismatchError, None),
        (InvalidArgumentError("bad"), InvalidArgumentError, None),
        (LocalProblem("bad"), InvalidArgumentError, None),  # a subclass travels as the public class
        (CollectiveError("odd"), CollectiveError, None),
        (PeerLostError("gone", [5]), PeerLostError, (5,)),
        (PeerLostError("gone"), PeerLostError, (9,)),
        (JobClosedError("closed"), PeerLostError, (9,)),  # its job closed: lost to the others
        (MemoryError("simulated"), PeerLostError, (9,)),  # not ours
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else None,
)
def test_a_record_is_its_error_again_with_a_context(error: BaseException, kind: type, peers: Any) -> None:
    for record in (ErrorRecord.of(error), ErrorRecord.from_line(ErrorRecord.of(error).line())):
        again = record.error("peer 9 gave up", [9])
        assert type(again) is kind and str(again) == f"peer 9 gave up: {error}"
        assert getattr(again, "peers", None) == peers or getattr(again, "missing", None) == peers


def test_the_verdicts_of_several_nodes_are_one_error() -> None:
    verdicts = [
        (1, VerdictMessage.of(3, CollectiveTimeout("waited for peer 4", [4]))),
        (2, VerdictMessage.of(3, CollectiveTimeout("waited for peers 4-5", [5, 4]))),
    ]
    error = verdict_error(3, verdicts, lambda node: f"node {node}")
    assert isinstance(error, CollectiveTimeout) and error.missing == (4, 5)
    assert str(error) == "step 3 failed: node 1: waited for peer 4; node 2: waited for peers 4-5"
