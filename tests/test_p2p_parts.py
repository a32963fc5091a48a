"""The mailbox's side of a point-to-point message that comes from another process in parts (unit
tests; tests/node_worker.py sends such messages between real processes)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import collective as col
from collective.node.mailbox import Mailbox
from collective.node.protocol import PART_BYTES, P2PMessage
from collective.transport.wire import WireError

pytestmark = pytest.mark.timeout(30)


def _parts(data: np.ndarray, ident: int = 7) -> list[tuple[P2PMessage, bytes]]:
    raw = data.reshape(-1).view(np.uint8)
    count = -(-raw.nbytes // PART_BYTES)
    return [
        (
            P2PMessage(0, 1, 5, data.shape, str(data.dtype), ident, k, count),
            raw[k * PART_BYTES : (k + 1) * PART_BYTES].tobytes(),
        )
        for k in range(count)
    ]


def _take(box: Mailbox, seconds: float = 0.2) -> np.ndarray:
    source, data = box.take(0, 1, 5, time.monotonic() + seconds, seconds, lambda _: None)
    assert source == 0
    return data


def test_a_message_in_parts_is_kept_whole_once_its_last_part_is_in() -> None:
    data = np.arange(PART_BYTES // 4 * 2 + 3, dtype=np.float32).reshape(-1, 1)
    box = Mailbox()
    parts = _parts(data)
    assert len(parts) == 3
    for message, chunk in parts[:-1]:
        box.arrived(2, message, chunk)
    with pytest.raises(col.CollectiveTimeout):
        _take(box)  # not yet
    box.arrived(2, *parts[-1])
    np.testing.assert_array_equal(_take(box), data)


def test_a_part_out_of_place_is_refused_and_its_message_dropped() -> None:
    data = np.ones(PART_BYTES // 8 * 3, np.float64)
    box = Mailbox()
    first, second, third = _parts(data)
    box.arrived(2, *first)
    with pytest.raises(WireError, match="part 2 of 3"):
        box.arrived(2, *third)  # the second never came
    box.arrived(2, *second)  # no assembly left for it: dropped
    with pytest.raises(col.CollectiveTimeout):
        _take(box)
    with pytest.raises(WireError, match="part 0 of 3"):
        box.arrived(2, first[0], first[1][:-1])  # a short part


def test_a_message_alone_is_kept_whatever_its_size() -> None:
    """A 1.06 GiB array was dropped at the 1 GiB limit although nothing else was waiting: an
    array that size could never be received between processes."""
    box = Mailbox(limit=PART_BYTES)
    data = np.arange(PART_BYTES // 4 + 1, dtype=np.float32)
    for message, chunk in _parts(data):
        box.arrived(2, message, chunk)
    np.testing.assert_array_equal(_take(box), data)


def test_a_sender_past_the_limit_is_cut_off_and_never_read_in_the_wrong_place() -> None:
    """A, B (dropped), C: the second receive returned C in B's place, silently, and the third
    raised B's error. A receive on another tag raised it too."""
    box = Mailbox(limit=64 << 10)
    a, b, c = np.full(4096, 1.0), np.full(8192, 2.0), np.full(1, 3.0)  # 32 KiB, 64 KiB, 8 bytes
    for data in (a, b, c):
        box.put(0, 1, 5, data, remote=True)
    box.put(2, 1, 5, c, remote=True)  # another sender: unaffected
    np.testing.assert_array_equal(_take(box), a)  # what came before the drop still arrives, in order
    for _ in range(2):  # B's receive, and C's: never C in B's place
        with pytest.raises(col.MismatchError, match=r"peer 0 sent more than .* 65536 bytes to peer 1, tag 5"):
            _take(box)
    box.put(0, 1, 5, c, remote=True)  # cut off: even a small message now
    with pytest.raises(col.MismatchError, match="its later messages are dropped too"):
        box.take(0, 1, 9, time.monotonic() + 0.1, 0.1, lambda _: None)  # any tag from it
    source, data = box.take(2, 1, 5, time.monotonic() + 0.1, 0.1, lambda _: None)
    assert source == 2 and data.tolist() == [3.0]
    with pytest.raises(col.MismatchError, match="peer 0 sent more than"):  # from any source: one was
        box.take(None, 1, 5, time.monotonic() + 0.1, 0.1, lambda _: None)  # dropped for (peer 1, tag 5)
    with pytest.raises(col.CollectiveTimeout):  # (another tag, another peer: nothing of theirs was)
        box.take(None, 3, 7, time.monotonic() + 0.1, 0.1, lambda _: None)


def test_empty_messages_count_against_the_limit_too() -> None:
    """A million empty messages were kept (41 MiB to 416 MiB of memory): they counted 0 bytes."""
    box = Mailbox(limit=64 << 10)
    for _ in range(200):
        box.put(0, 1, 5, np.empty(0, np.float32), remote=True)
    kept = 0
    while True:
        try:
            _take(box, 0.01)
        except col.MismatchError:
            break
        kept += 1
    assert 0 < kept < 200 and kept <= (64 << 10) // 1024, kept
