"""Point-to-point messages through shared memory (transport.shm_p2p) and their order with the TCP
path (collective.node.messages): unit tests in one process; tests/node_worker.py's "p2p" sends
messages of every size between real processes, through both paths."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from collective.node.messages import Messages
from collective.node.protocol import BELL_TAG, PART_BYTES, P2PMessage
from collective.transport.shm_p2p import MESSAGE_BYTES, QUEUE_BYTES, QUEUES, P2PSegment, Queues
from collective.transport.shm_ring import RingSegment
from collective.transport.wire import WireError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def host() -> Iterator[tuple[Queues, Queues]]:
    """Two processes' ends of the host's queues (nodes 0 and 1), both in this process."""
    segments = [P2PSegment.create(), P2PSegment.create()]
    assert segments[0] is not None and segments[1] is not None
    names = {0: segments[0].name, 1: segments[1].name}
    ends = (Queues(segments[0], 0, names), Queues(segments[1], 1, names))
    yield ends
    for end in ends:
        end.close()
    for segment in segments:
        segment.close()


def test_messages_arrive_whole_and_in_order_across_the_queues_wrap(host: tuple[Queues, Queues]) -> None:
    sender, receiver = host
    rng = np.random.default_rng(0)
    sent: list[tuple[bytes, bytes]] = []
    received: list[tuple[bytes, bytes]] = []
    for k in range(200):  # ~25 MiB through a 2 MiB queue: it wraps many times
        payload = rng.integers(0, 256, int(rng.integers(0, 250_000)), dtype=np.uint8)
        header = f"message {k}".encode() * int(rng.integers(1, 5))
        if not sender.post(1, header, payload):  # full: the receiver reads, then it fits
            received += [(h, p.tobytes()) for h, p in receiver.take(0)]
            assert sender.post(1, header, payload)
        sent.append((header, payload.tobytes()))
    received += [(h, p.tobytes()) for h, p in receiver.take(0)]
    assert received == sent
    assert receiver.take(0) == []


def test_a_full_queue_and_a_message_too_large_are_refused_for_tcp(host: tuple[Queues, Queues]) -> None:
    sender, receiver = host
    assert not sender.post(1, b"h", np.zeros(MESSAGE_BYTES + 1, np.uint8))  # too large
    posted = 0
    while sender.post(1, b"h", np.zeros(MESSAGE_BYTES, np.uint8)):
        posted += 1
    assert posted == QUEUE_BYTES // MESSAGE_BYTES - 1  # (each record has its header beside the payload)
    assert len(receiver.take(0)) == posted
    assert sender.post(1, b"h", np.zeros(MESSAGE_BYTES, np.uint8))  # read: room again
    assert not receiver.post(5, b"h", np.zeros(1, np.uint8))  # a node not of this host


def test_a_receiver_that_reads_no_queue_of_the_sender_gets_nothing_through_it() -> None:
    """A sender posts only where the receiver keeps a counter for it (it made one when it joined),
    so no message is ever left in a queue nobody reads."""
    mine, theirs = P2PSegment.create(), P2PSegment.create()
    assert mine is not None and theirs is not None
    sender = Queues(mine, 0, {0: mine.name, 1: theirs.name})  # node 1 has not joined: no Queues there
    try:
        assert not sender.post(1, b"h", np.zeros(4, np.uint8))
        assert not sender.wants_bell(1)
    finally:
        sender.close()
        mine.close()
        theirs.close()


def test_another_kind_of_segment_is_never_used(host: tuple[Queues, Queues]) -> None:
    sender, _ = host
    ring = RingSegment.create()
    assert ring is not None
    try:
        impostor = Queues(sender.mine, 0, {0: sender.mine.name, 2: ring.name, 3: "/tmp/elsewhere"})
        assert not impostor.post(2, b"h", np.zeros(4, np.uint8))
        assert not impostor.post(3, b"h", np.zeros(4, np.uint8))
        assert impostor.take(2) == []
    finally:
        ring.close()


def test_a_process_sends_to_as_many_others_as_it_has_queues(host: tuple[Queues, Queues]) -> None:
    sender, _ = host
    for node in range(2, 2 + QUEUES):
        P2PSegment._index(sender.mine.keys, node, assign=True)  # (queues given to other nodes)
    assert not sender.post(1, b"h", np.zeros(4, np.uint8))  # none left for node 1: TCP


# -- the order of the two paths -------------------------------------------------------------------


class _Network:
    """What Messages uses of a NodeNetwork: the job, the node, and its sends (recorded)."""

    def __init__(self, index: int) -> None:
        self.job, self.index = "job", index
        self.sent: list[tuple[int, dict[str, Any], Any]] = []

    def send(self, node: int, header: dict[str, Any], payload: Any = None, track: bool = False) -> None:
        self.sent.append((node, header, payload))

    def pump(self, seconds: float) -> None:
        pass

    def on_idle(self, call: Any) -> None:
        self.idle = call


class _Outbox:
    def __init__(self, network: _Network) -> None:
        self.network = network

    def send(self, node: int, header: dict[str, Any], payload: Any) -> None:
        self.network.send(node, header, payload)


@pytest.fixture
def pair(host: tuple[Queues, Queues]) -> Iterator[tuple[Messages, Messages, list[Any], _Network]]:
    """Node 0's Messages (sending) and node 1's (receiving: what it delivers, in order)."""
    delivered: list[Any] = []
    networks = [_Network(0), _Network(1)]
    names = {0: host[0].mine.name, 1: host[1].mine.name}
    ends = [
        Messages(_Outbox(networks[0]), networks[0], lambda *a: None, host[0].mine),  # type: ignore[arg-type]
        Messages(
            _Outbox(networks[1]),  # type: ignore[arg-type]
            networks[1],  # type: ignore[arg-type]
            lambda node, message, chunk: delivered.append((message.order, bytes(chunk))),
            host[1].mine,
        ),
    ]
    for end in ends:
        end.connect(names, 2)
    yield ends[0], ends[1], delivered, networks[0]
    for end in ends:
        end._queues.close()  # type: ignore[union-attr]  (the segments are the fixture's)


def _message(size: int) -> tuple[P2PMessage, np.ndarray]:
    return P2PMessage(0, 1, 5, (size,), "uint8"), np.full(size, size % 251, np.uint8)


def test_a_small_message_that_overtakes_a_large_one_waits_for_it(pair: Any) -> None:
    sender, receiver, delivered, network = pair
    large, small = _message(MESSAGE_BYTES + 8), _message(3)
    sender.send(1, *large)  # over TCP (too large for the queue)
    sender.send(1, *small)  # through shared memory: here first
    receiver.pump(0.001)
    assert delivered == []  # (held: the large one is number 0)
    ((node, header, payload),) = network.sent
    assert node == 1 and header["order"] == 0
    receiver.arrived(0, P2PMessage.decode(header), payload.tobytes())
    assert [order for order, _ in delivered] == [0, 1]
    assert delivered[1][1] == bytes(small[1])


def test_a_tcp_message_drains_the_shared_memory_sent_before_it(pair: Any) -> None:
    sender, receiver, delivered, network = pair
    sender.send(1, *_message(10))  # shared memory, not yet looked at
    sender.send(1, *_message(MESSAGE_BYTES + 8))  # TCP
    ((_, header, payload),) = network.sent
    receiver.arrived(0, P2PMessage.decode(header), payload.tobytes())
    assert [order for order, _ in delivered] == [0, 1]


def test_a_receiver_that_blocks_is_rung(pair: Any) -> None:
    sender, receiver, delivered, network = pair
    receiver._queues.mine.waiting[0] = 1  # (as while it blocks in pump)
    sender.send(1, *_message(4))
    ((node, header, _),) = network.sent
    assert node == 1 and header["tag"] == BELL_TAG
    receiver.arrived(0, P2PMessage.decode(header), b"")  # the bell: it looks at shared memory
    assert delivered == [(0, bytes(_message(4)[1]))]
    receiver._queues.mine.waiting[0] = 0


def test_a_source_whose_segment_cannot_be_attached_gets_no_counter() -> None:
    """A counter says "post here": given only to sources attached, whose queues are then read."""
    mine = P2PSegment.create()
    assert mine is not None
    receiver = Queues(mine, 1, {1: mine.name, 0: "/dev/shm/collective-1-0123456789abcdef"})
    try:
        assert P2PSegment._index(mine.readers, 0, assign=False) is None
    finally:
        receiver.close()
        mine.close()


def test_a_malformed_record_is_refused_and_the_queue_read_no_more(host: tuple[Queues, Queues]) -> None:
    sender, receiver = host
    assert sender.post(1, b"header", np.zeros(8, np.uint8))
    queue = P2PSegment._index(sender.mine.keys, 1, assign=False)
    assert queue is not None
    sender.mine.data[queue][:8].view(np.int64)[0] = 12  # (shorter than its own fields)
    with pytest.raises(WireError, match="malformed record"):
        receiver.take(0)
    assert sender.post(1, b"header", np.zeros(8, np.uint8))
    assert receiver.take(0) == []


class _Failing(_Outbox):
    """Fails the second part of a message in parts (a peer lost mid-send, Ctrl-C)."""

    def send(self, node: int, header: dict[str, Any], payload: Any) -> None:
        if header["part"] == 1:
            raise KeyboardInterrupt
        super().send(node, header, payload)


def test_a_message_whose_sender_failed_midway_gives_its_turn_to_the_next(pair: Any) -> None:
    sender, receiver, delivered, network = pair
    sender._outbox = _Failing(network)
    with pytest.raises(KeyboardInterrupt):
        sender.send(1, *_message(PART_BYTES + 8))  # part 0 sent, then the failure, then a skip
    sender._outbox = _Outbox(network)
    sender.send(1, *_message(MESSAGE_BYTES + 8))
    for _, header, payload in network.sent:
        receiver.arrived(0, P2PMessage.decode(header), payload.tobytes())
    assert [(order, len(chunk)) for order, chunk in delivered] == [(0, PART_BYTES), (1, MESSAGE_BYTES + 8)]
    assert not receiver._held.get(0)  # (nothing waits for a turn that never comes)


def test_a_skip_that_waited_for_its_turn_is_no_message(pair: Any) -> None:
    """A small message in shared memory (number 0) is late; a send in parts (number 1) fails after
    its first part and its skip arrives before number 0 is read: once 0 is in, 1 is skipped (its
    part dropped, not delivered as a message) and 2 follows."""
    sender, receiver, delivered, network = pair
    receiver._queues, queues = None, receiver._queues  # (number 0 not visible yet)
    sender.send(1, *_message(5))
    sender._outbox = _Failing(network)
    with pytest.raises(KeyboardInterrupt):
        sender.send(1, *_message(PART_BYTES + 8))
    sender._outbox = _Outbox(network)
    sender.send(1, *_message(MESSAGE_BYTES + 8))
    for _, header, payload in network.sent:  # part 0 of 1, the skip of 1, then 2: all held
        receiver.arrived(0, P2PMessage.decode(header), payload.tobytes())
    assert delivered == []
    receiver._queues = queues
    receiver.pump(0)  # number 0 read: the rest in turn
    assert [(order, len(chunk)) for order, chunk in delivered] == [
        (0, 5),
        (1, PART_BYTES),
        (2, MESSAGE_BYTES + 8),
    ]
