"""Persistent sends and receives (collective.persistent.p2p): checked once, each use a message;
what can change between uses is checked at each, and every failure of send and recv holds."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import collective as col
from collective.trace import RECORDER
from tests.processes import finish_all, start_nodes
from tests.test_persistent import run_peers


def test_each_use_sends_the_contents_then_and_receives_into_the_same_buffer() -> None:
    started = threading.Event()

    def body(rt: col.Runtime, p: int) -> list[Any]:
        if p == 0:
            x = np.zeros(3, np.float32)
            with rt.send_init(p, x, dst=1, tag=7) as sent:
                for use in range(4):
                    x[:] = use
                    assert sent() is None
                started.wait(5)  # (peer 1's receive is started before this send comes)
                x[:] = 99
                sent.start()
                sent.wait()
            return []
        buffer = np.zeros(3, np.float32)
        seen = []
        with rt.recv_init(p, src=0, tag=7, out=buffer) as into, rt.recv_init(p, src=0, tag=7) as fresh:
            for _ in range(2):
                seen.append((into() is buffer, buffer.tolist()))
            first = fresh()  # (no out: the first use's array, written by every later use)
            second = fresh()
            seen.append((first is second is fresh.out, second.tolist()))
            into.start()
            started.set()
            seen.append((into.wait(timeout=5) is buffer, buffer.tolist()))
        return seen

    found = run_peers(2, body)
    assert found[1] == [(True, [0.0] * 3), (True, [1.0] * 3), (True, [3.0] * 3), (True, [99.0] * 3)], found


def test_receives_take_their_messages_in_the_order_they_were_started() -> None:
    """MPI's order: the receives from one source with one tag match its messages in the order
    they were started, whichever is waited for first; a recv or recv_any made after them takes
    the next; a use that ends without a message, and a handle let go, give their turn up."""
    sent, started = threading.Event(), threading.Event()

    def body(rt: col.Runtime, p: int) -> list[Any]:
        if p == 0:
            started.wait(5)
            for value in range(1, 8):
                rt.send(p, np.full(2, float(value)), 1, tag=3)
            sent.set()
            return []
        first, second = rt.recv_init(p, 0, tag=3), rt.recv_init(p, 0, tag=3, timeout=5)
        lost, dropped = rt.recv_init(p, 0, tag=3, timeout=0.05), rt.recv_init(p, 0, tag=3)
        lost.start()
        with pytest.raises(col.CollectiveTimeout):
            lost.wait()  # (its use ends without a message: its turn is given up)
        first.start()
        dropped.start()
        second.start()
        del dropped  # (let go while started: its turn is given up)
        started.set()
        sent.wait(5)
        seen = [rt.recv(p, 0, tag=3)[0]]  # (made after the three: the third message)
        seen += [second.wait()[0], first.wait()[0]]
        first.start()
        seen += [rt.recv_any(p, tag=3)[1][0], first.wait()[0]]  # (from any peer: the next too)
        first.start()
        seen += [rt.recv(p, 0, tag=3)[0], first.wait()[0]]
        return seen

    assert run_peers(2, body)[1] == [3.0, 2.0, 1.0, 5.0, 4.0, 7.0, 6.0]


def test_a_changed_buffer_a_wrong_message_and_misuse_are_errors() -> None:
    def body(rt: col.Runtime, p: int) -> list[str]:
        said = []
        if p == 0:
            x = np.zeros(4)
            sent = rt.send_init(p, x, 1)
            sent()
            x.shape = (2, 2)
            try:
                sent()
            except col.InvalidArgumentError as exc:
                said.append(str(exc))
            rt.send(p, np.ones(5), 1, tag=1)  # (a message that fits no buffer of 4)
            sent.free()
            sent.free()  # (a second free does nothing)
            for use in (sent, sent.start):
                try:
                    use()
                except col.InvalidArgumentError as exc:
                    said.append(str(exc))
            return said
        buffer = np.zeros(4)
        got = rt.recv_init(p, 0, out=buffer)
        said.append(str(got().tolist()))
        wrong = rt.recv_init(p, 0, tag=1, out=buffer)
        try:
            wrong()
        except col.InvalidArgumentError as exc:
            said.append(str(exc))
        said.append(str(rt.recv(p, 0, tag=1).tolist()))  # (the message stayed queued)
        buffer.flags.writeable = False
        try:
            got()
        except col.InvalidArgumentError as exc:
            said.append(str(exc))
        buffer.flags.writeable = True
        try:
            wrong.wait()
        except col.InvalidArgumentError as exc:
            said.append(str(exc))
        for bad in (
            lambda: rt.recv_init(p, p),
            lambda: rt.recv_init(p, 0, tag=-1),
            lambda: rt.send_init(p, [1], 0),
        ):
            try:
                bad()
            except col.InvalidArgumentError as exc:
                said.append(str(exc))
        return said

    found = run_peers(2, body)
    changed, freed, freed_start = found[0]
    assert "changed since it was made: was shape (4,) float64, is shape (2, 2) float64" in changed, changed
    assert freed == freed_start == "this persistent send was freed: make another"
    first, wrong, queued, read_only, unstarted, itself, tag, array = found[1]
    assert "changed since it was made: it is read-only now" in read_only, read_only
    assert first == "[0.0, 0.0, 0.0, 0.0]" and queued == "[1.0, 1.0, 1.0, 1.0, 1.0]", found
    assert "out has shape (4,)" in wrong and "still there" in wrong, wrong
    assert unstarted == "wait() on a persistent recv with no use started: call start()"
    assert "cannot send to or receive from itself" in itself and "tag must be" in tag and array, found


def test_a_receive_times_out_and_a_wait_shorter_than_the_use_lets_it_go_on() -> None:
    ready, done = threading.Event(), threading.Event()

    def body(rt: col.Runtime, p: int) -> list[str]:
        if p == 0:
            ready.wait(5)
            rt.send(p, np.full(2, 5.0), 1)
            done.wait(5)  # (a peer that left would make the last receive a PeerLostError)
            return []
        said = []
        with rt.recv_init(p, 0, timeout=5) as got:
            got.start()
            try:
                got.wait(timeout=0.05)  # (the wait's own bound: the use goes on)
            except col.CollectiveTimeout as exc:
                said.append(str(exc))
            ready.set()
            said.append(str(got.wait().tolist()))
            try:
                got(timeout=0.05)  # (the use's own timeout: it ends)
            except col.CollectiveTimeout as exc:
                said.append(str(exc))
            said.append(repr(got))
        done.set()
        return said

    waited, received, ended, state = run_peers(2, body)[1]
    assert "recv: peer 1 waited 0.05s for a message from peer 0 with tag 0" in waited, waited
    assert received == "[5.0, 5.0]" and "waited 0.05s" in ended and "ready" in state, (received, ended, state)


def test_a_receive_from_a_peer_that_left_is_a_peer_lost_error() -> None:
    left = threading.Event()

    def body(rt: col.Runtime, p: int) -> str:
        if p == 0:
            rt.finish(p)
            left.set()
            return ""
        left.wait(5)
        try:
            rt.recv_init(p, 0)()
        except col.PeerLostError as exc:
            return str(exc)
        return "no error"

    assert "peer 0 left the job (finish)" in run_peers(2, body)[1]


def test_uses_are_recorded_as_sends_and_receives() -> None:
    def body(rt: col.Runtime, p: int) -> list[Any]:
        x = np.zeros(2)
        handle = rt.send_init(p, x, 1, tag=3) if p == 0 else rt.recv_init(p, 0, tag=3, out=x)
        for _ in range(3):
            handle()
        entries = RECORDER.document("test")["entries"]
        return [
            (e["kind"], e["collective_seq_id"], e["state"], e["tag"], e["frames"][0]["name"])
            for e in entries
            if e["peer"] == p and e["is_p2p"]
        ]

    found = run_peers(2, body)
    assert found[0][-3:] == [("send", i, "completed", 3, "body") for i in range(3)], found[0]
    assert found[1][-3:] == [("recv", i, "completed", 3, "body") for i in range(3)], found[1]


@pytest.mark.parametrize("shm", [1, 0], ids=["shared-memory", "zeromq"])
def test_persistent_sends_and_receives_between_processes(orchestrator: str, shm: int) -> None:
    nodes = start_nodes(orchestrator, f"persistent-p2p-{shm}", 2, 1, "persistent_p2p", shm=shm)
    assert finish_all(nodes, 60) == [0, 0], [node.output() for node in nodes]
    assert all(node.wait_for("OK 9", 5) for node in nodes)


def test_a_use_checks_the_peer_and_its_buffer_when_it_is_waited_for_and_a_bounded_wait_records_nothing() -> (
    None
):
    """The peer must still be in its job at each use (as send and recv check it); a receive's
    buffer made read-only between start() and wait() fails the use before its message is taken;
    a wait that ends on its own bound leaves no entry in the flight recorder, nor does it take a
    number; any other error ends the use."""
    go = threading.Event()

    def body(rt: col.Runtime, p: int) -> list[Any]:
        said: list[Any] = []
        if p == 0:
            sent = rt.send_init(p, np.ones(2), 1)
            go.wait(5)
            sent()
            sent()
            rt.finish(p)
            try:
                sent()
            except col.RegistrationError as exc:
                said.append(type(exc).__name__)
            return said
        buffer = np.zeros(2)
        got = rt.recv_init(p, 0, out=buffer)
        got.start()
        try:
            got.wait(timeout=0.05)
        except col.CollectiveTimeout:
            said.append("bounded")
        go.set()
        said.append(got.wait().tolist())
        got.start()
        buffer.flags.writeable = False
        try:
            got.wait()
        except col.InvalidArgumentError as exc:
            said.append("read-only" in str(exc))
        said.append(repr(got))  # (the use ended: ready)
        said.append(rt.recv(p, 0).tolist())  # (the message was not taken)
        entries = RECORDER.document("test")["entries"]
        said.append([(e["collective_seq_id"], e["state"]) for e in entries if e["peer"] == p and e["is_p2p"]])
        return said

    found = run_peers(2, body)
    assert found[0] == ["RegistrationError"], found
    bounded, first, read_only, state, queued, recorded = found[1]
    assert bounded == "bounded" and first == [1.0, 1.0] and read_only and "ready" in state, found[1]
    assert queued == [1.0, 1.0] and recorded[:2] == [(0, "completed"), (1, "failed")], recorded


def test_a_torch_buffer_is_viewed_at_each_use() -> None:
    """A conjugate view (read as a copy) sends what it holds at each use; a receive into a tensor
    whose memory moved (set_) writes its new memory."""
    torch = pytest.importorskip("torch")

    def body(rt: col.Runtime, p: int) -> list[Any]:
        if p == 0:
            base = torch.zeros(2, dtype=torch.complex64)
            sent = rt.send_init(p, base.conj(), 1)
            for use in range(2):
                base.fill_(complex(use, 1))
                sent()
            return []
        out = torch.zeros(2, dtype=torch.complex64)
        got = rt.recv_init(p, 0, out=out)
        seen = [got().tolist()]
        out.set_(torch.zeros(2, dtype=torch.complex64))
        seen.append(got().tolist())
        return seen

    assert run_peers(2, body)[1] == [[-1j, -1j], [1 - 1j, 1 - 1j]]
