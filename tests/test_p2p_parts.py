"""The mailbox's side of a point-to-point message that comes from another process in parts (unit
tests; tests/node_worker.py sends such messages between real processes)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import collective as col
from collective.p2p import Mailbox
from collective.protocol import PART_BYTES, P2PMessage
from collective.transport.wire import WireError

pytestmark = pytest.mark.timeout(30)


def _parts(data: np.ndarray, ident: int = 7) -> list[tuple[P2PMessage, bytes]]:
    raw = data.reshape(-1).view(np.uint8)
    count = -(-raw.nbytes // PART_BYTES)
    return [
        (P2PMessage(0, 1, 5, data.shape, str(data.dtype), ident, k, count),
         raw[k * PART_BYTES : (k + 1) * PART_BYTES].tobytes())
        for k in range(count)
    ]  # fmt: skip


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


def test_a_message_over_the_limit_fails_the_next_receive_from_its_sender() -> None:
    box = Mailbox(limit=PART_BYTES)
    for message, chunk in _parts(np.zeros(PART_BYTES // 4 + 1, np.float32)):
        box.arrived(2, message, chunk)
    with pytest.raises(col.MismatchError, match="sent more than"):
        _take(box)
