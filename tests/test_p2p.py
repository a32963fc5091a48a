"""send / recv between local peers (threads): shapes and dtypes carried, data copied at send, tags
and sources in order, timeouts naming the source, a peer that finished, and bad arguments. (The
mailbox's side of messages from other processes is tests/test_p2p_parts.py.)"""

from __future__ import annotations

import threading
import time
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import collective as col
from tests.conftest import run_peers
from tests.peers import config, make_input, registered, same_bytes


def test_send_recv_carries_shape_and_dtype_and_copies_at_send(runtime: col.Runtime) -> None:
    arrays = [
        np.full((), 2.5),
        np.zeros((0, 3), np.int32),
        make_input(0, (4, 5), np.float16, seed=1),
        make_input(0, (7,), ml_dtypes.bfloat16, seed=2),
        make_input(0, (3, 4), np.int64, seed=3, view=True),
        make_input(0, (300_000,), np.float32, seed=4),
    ]
    originals = [x.copy() for x in arrays]

    def body(peer: int) -> Any:
        if peer == 0:
            for x in arrays:
                runtime.send(0, x, dst=1)
                x[...] = 0  # the data was copied at send: the receiver still gets the original
            return None
        got = [runtime.recv(1, src=0, timeout=10) for _ in arrays]
        out = np.full((2, 2), 9, np.float32)
        returned = runtime.recv(1, src=0, tag=4, out=out, timeout=10)
        return got, returned is out, out

    registered(runtime, 2)
    runtime.send(0, np.arange(4, dtype=np.float32).reshape(2, 2), dst=1, tag=4)
    _, (got, is_out, out) = run_peers(2, body, runtime)
    for received, original in zip(got, originals, strict=True):
        same_bytes(received, original)
    assert is_out
    same_bytes(out, np.arange(4, dtype=np.float32).reshape(2, 2))


def test_recv_into_an_out_whose_elements_share_memory_is_refused_and_the_message_stays(
    runtime: col.Runtime,
) -> None:
    """[[0, 1, 2], [3, 4, 5]] into np.broadcast_to-like or expanded memory came out [[3, 4, 5]] * 2."""
    registered(runtime, 2)
    message = np.arange(6.0).reshape(2, 3)
    runtime.send(0, message, dst=1)
    shared = np.lib.stride_tricks.as_strided(np.zeros(3), (2, 3), (0, 8))  # one row, seen twice
    with pytest.raises(col.InvalidArgumentError, match="out has elements that share memory"):
        runtime.recv(1, src=0, out=shared, timeout=5)
    transposed = np.zeros((3, 2)).T  # not contiguous, but its elements are its own: fine
    assert runtime.recv(1, src=0, out=transposed, timeout=5) is transposed
    np.testing.assert_array_equal(transposed, message)


def test_tags_do_not_block_each_other_and_each_src_dst_tag_keeps_its_order(runtime: col.Runtime) -> None:
    registered(runtime, 3)
    for i in range(10):
        runtime.send(0, np.full(2, i), dst=2, tag=5)
        runtime.send(1, np.full(2, 100 + i), dst=2, tag=5)
        runtime.send(0, np.full(2, 200 + i), dst=2, tag=3)
    # The last tag sent is received first; sources interleave; within (src, dst, tag) the order holds.
    assert [runtime.recv(2, src=0, tag=3, timeout=5)[0] for _ in range(10)] == [200 + i for i in range(10)]
    got_1 = [runtime.recv(2, src=1, tag=5, timeout=5)[0] for _ in range(5)]
    got_0 = [runtime.recv(2, src=0, tag=5, timeout=5)[0] for _ in range(10)]
    got_1 += [runtime.recv(2, src=1, tag=5, timeout=5)[0] for _ in range(5)]
    assert got_0 == list(range(10)) and got_1 == [100 + i for i in range(10)]


def test_two_peers_send_to_each_other_then_receive(runtime: col.Runtime) -> None:
    big = [make_input(p, (1 << 20,), np.float32, seed=7) for p in range(2)]  # 4 MiB: still eager

    def body(peer: int) -> Any:
        other = 1 - peer
        runtime.send(peer, big[peer], dst=other)
        runtime.send(peer, np.full(3, peer), dst=other, tag=1)
        return runtime.recv(peer, src=other, timeout=10), runtime.recv(peer, src=other, tag=1, timeout=10)

    registered(runtime, 2)
    for peer, (data, small) in enumerate(run_peers(2, body, runtime)):
        same_bytes(data, big[1 - peer])
        np.testing.assert_array_equal(small, np.full(3, 1 - peer))


def test_recv_without_a_send_times_out_naming_the_source_and_a_later_message_still_arrives(
    runtime: col.Runtime,
) -> None:
    registered(runtime, 3, timeout=30)
    started = time.monotonic()
    with pytest.raises(col.CollectiveTimeout) as info:
        runtime.recv(0, src=2, tag=7, timeout=0.3)
    assert time.monotonic() - started < 5, "the call's timeout, not the config's 30 s"
    assert info.value.missing == (2,) and isinstance(info.value, TimeoutError)
    assert "waited 0.3s for a message from peer 2 with tag 7" in str(info.value)
    runtime.send(2, np.ones(2), dst=0, tag=7)
    np.testing.assert_array_equal(runtime.recv(0, src=2, tag=7, timeout=5), np.ones(2))


def test_recv_from_a_peer_that_finished_is_a_peer_lost_error(runtime: col.Runtime) -> None:
    finished = threading.Event()

    def body(peer: int) -> Any:
        runtime.register(peer, "cpu", config(3, timeout=30))
        if peer == 1:
            runtime.send(1, np.arange(3), dst=0)
            runtime.finish(1)
            finished.set()
            return None
        if peer == 2:  # blocked in recv while peer 1 finishes: woken at once, not at the timeout
            started = time.monotonic()
            with pytest.raises(col.PeerLostError, match=r"peer 1 left the job \(finish\)") as info:
                runtime.recv(2, src=1)
            assert time.monotonic() - started < 10 and info.value.peers == (1,)
            return None
        assert finished.wait(10)
        sent = runtime.recv(0, src=1, timeout=5)  # what it sent before it left still arrives
        with pytest.raises(col.PeerLostError) as info:
            runtime.recv(0, src=1, timeout=20)
        with pytest.raises(col.PeerLostError, match=r"send: peer 1 left the job \(finish\)"):
            runtime.send(0, np.ones(3), dst=1)  # (it returned: the data waited for nobody)
        return sent, info.value.peers

    sent, peers = run_peers(3, body, runtime)[0]
    np.testing.assert_array_equal(sent, np.arange(3))
    assert peers == (1,)


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda rt: rt.send(0, np.ones(2), dst=2), r"dst=2 is not a peer of the job \(peers 0\.\.1\)"),
        (lambda rt: rt.send(0, np.ones(2), dst=-1), "dst=-1 is not a peer"),
        (lambda rt: rt.send(0, np.ones(2), dst=True), "dst=True is not a peer"),
        (lambda rt: rt.send(0, np.ones(2), dst="1"), "dst='1' is not a peer"),
        (lambda rt: rt.send(0, np.ones(2), dst=0), "peer 0 cannot send to or receive from itself"),
        (lambda rt: rt.send(0, np.ones(2), dst=1, tag=-1), r"tag must be .* to 2\*\*63 - 1, got -1"),
        (lambda rt: rt.send(0, np.ones(2), dst=1, tag=1.5), r"tag must be .* to 2\*\*63 - 1, got 1.5"),
        (lambda rt: rt.send(0, np.ones(2), dst=1, tag=True), r"tag must be .* to 2\*\*63 - 1, got True"),
        (lambda rt: rt.send(0, [1.0], dst=1), "send: peer 0: x must be an array"),
        (lambda rt: rt.recv(1, src=5), "src=5 is not a peer"),
        (lambda rt: rt.recv(1, src=1), "peer 1 cannot send to or receive from itself"),
        (lambda rt: rt.recv(1, src=0, tag=-2), "tag must be an integer from 0"),
        (lambda rt: rt.recv(1, src=0, timeout=-1), "timeout must be a finite number of seconds > 0"),
    ],
    ids=[
        "dst-world",
        "dst-negative",
        "dst-bool",
        "dst-str",
        "dst-self",
        "tag-negative",
        "tag-float",
        "tag-bool",
        "x-list",
        "src-world",
        "src-self",
        "recv-tag",
        "recv-timeout",
    ],
)
def test_bad_peers_tags_and_arrays_in_send_and_recv(runtime: col.Runtime, call: Any, expected: str) -> None:
    registered(runtime, 2)
    started = time.monotonic()
    with pytest.raises(col.InvalidArgumentError, match=expected):
        call(runtime)
    assert time.monotonic() - started < 5
    runtime.send(0, np.ones(2), dst=1)  # nothing broken
    np.testing.assert_array_equal(runtime.recv(1, src=0, timeout=5), np.ones(2))
