"""The Link conformance checks: what every transport's Link must do, shipped with the protocol.

In the spirit of trio's ``trio.testing.check_one_way_stream``, a transport's own tests hand over a
factory and the same checks run against every Link (in-process, recording, ZeroMQ, shared
memory, the next one)::

    from collective.algorithms.conformance import CHECKS, LinkGroup, check_link

    def make_links(n: int, timeout: float) -> LinkGroup:   # or just the list of links
        ...  # n fresh peers of one group (links[i].rank == i), waits ending `timeout` s from now
        return LinkGroup(links, abort=..., close=...)

    check_link(make_links)                # every check; AssertionError says what failed
    check_link(make_links, aborts=False)  # a transport that cannot abort skips that check
    for check in CHECKS: check(make_links)  # one by one (one test id each)

The checks (each builds its groups through the factory, and closes them):
``in_order`` (per pair; empty, small and large messages), ``matched_by_source`` (a receive takes
its source's next message, whoever sent first), ``recv_reduce`` (every op, into ``out`` and in
place), ``send_and_receive_in_one_step`` (a ring of large buffers, no deadlock),
``reuse_after_flush`` and ``reuse_after_reply`` (the two halves of the buffer-ownership rule of
link.py), ``empty_messages`` (barrier signals, one read-only empty array lent to all; empty
receives and reductions), ``timeout`` (a receive nobody answers raises CollectiveTimeout by the
deadline, on every peer) and ``abort`` (``LinkGroup.abort``: every peer waiting for the peer that
gave up raises a CollectiveError carrying its reason, at once).

This module imports only the Link protocol, the ops and the errors; no test framework.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from collective.algorithms.link import Link, send_signal, wait_signal
from collective.algorithms.ops import BITWISE, NUMPY_UFUNCS, ReduceOp
from collective.errors import CollectiveError, CollectiveTimeout

__all__ = ["CHECKS", "LARGE_BYTES", "Check", "LinkGroup", "MakeLinks", "check_link"]

LARGE_BYTES = (256 << 10) + 8  # above the sizes transports copy or inline: such buffers are lent
TIMEOUT = 10.0  # seconds: the deadline of the groups that are not meant to time out
PROMPT = 2.0  # seconds: how soon a timeout past its deadline, or an abort, must wake a waiting peer


@dataclass
class LinkGroup:
    """What a factory makes for one check: one Link per peer (``links[i].rank == i``).

    ``abort(peer, reason)``, where the transport has one, makes ``peer`` give up the collective
    as a failing peer does; ``close()`` releases what the group holds (sockets, threads).
    """

    links: Sequence[Link]
    abort: Callable[[int, str], None] | None = None
    close: Callable[[], None] | None = None


MakeLinks = Callable[[int, float], LinkGroup | Sequence[Link]]
"""``make_links(n, timeout)``: a fresh group of ``n`` peers whose waits end ``timeout`` seconds
from now, as a LinkGroup or just its links."""

Opener = Callable[[int, float], contextlib.AbstractContextManager[LinkGroup]]


@dataclass(frozen=True)
class Check:
    """One conformance check; ``needs`` names the ability it tests ("timeouts", "aborts") or is None."""

    name: str
    run: Callable[[Opener, int], None]
    needs: str | None = None

    def __call__(self, make_links: MakeLinks, *, large_bytes: int = LARGE_BYTES) -> None:
        """Run the check on groups from ``make_links``; raises AssertionError if the links fail it."""
        self.run(lambda n, timeout: _opened(make_links, n, timeout), large_bytes)

    def __str__(self) -> str:
        return self.name


def check_link(
    make_links: MakeLinks, *, timeouts: bool = True, aborts: bool = True, large_bytes: int = LARGE_BYTES
) -> None:
    """Run every check against links from ``make_links``; AssertionError on the first that fails.

    ``timeouts=False`` or ``aborts=False`` skip the checks of a transport without that ability;
    ``large_bytes`` is the size of the "large" messages (make it larger than any size the
    transport copies or sends inline, so that those buffers are lent).
    """
    abilities = {"timeouts": timeouts, "aborts": aborts}
    for check in CHECKS:
        if check.needs is None or abilities[check.needs]:
            check(make_links, large_bytes=large_bytes)


@contextlib.contextmanager
def _opened(make_links: MakeLinks, n: int, timeout: float) -> Iterator[LinkGroup]:
    made = make_links(n, timeout)
    group = made if isinstance(made, LinkGroup) else LinkGroup(list(made))
    try:
        ranks, sizes = [link.rank for link in group.links], {link.size for link in group.links}
        if ranks != list(range(n)) or sizes != {n}:
            raise AssertionError(
                f"make_links({n}, {timeout}) must give links of ranks 0 .. {n - 1} in a group of {n}; "
                f"got ranks {ranks}, sizes {sorted(sizes)}"
            )
        yield group
    finally:
        if group.close is not None:
            group.close()


def _start(
    group: LinkGroup, body: Callable[[Link], Any], peers: Sequence[int] | None = None, flush: bool = True
) -> Callable[[float], list[Any]]:
    """Run ``body(link)``, then (with ``flush``) ``link.flush()``, for each of ``peers`` (default
    all) in its own thread. Returns ``join(wait)``: the results by rank (None for the others); a
    failure is re-raised tagged with its peer; a peer still running ``wait`` seconds later hangs."""
    links = group.links
    chosen = list(range(len(links))) if peers is None else list(peers)
    results: list[Any] = [None] * len(links)
    errors: dict[int, BaseException] = {}

    def target(link: Link) -> None:
        try:
            results[link.rank] = body(link)
            if flush:
                link.flush()
        except BaseException as exc:
            errors[link.rank] = exc

    threads = [threading.Thread(target=target, args=(links[rank],), daemon=True) for rank in chosen]
    for thread in threads:
        thread.start()

    def join(wait: float) -> list[Any]:
        deadline = time.monotonic() + wait
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, thread in zip(chosen, threads, strict=True) if thread.is_alive()]
        if hung:
            raise AssertionError(f"peers {hung} still running {wait:.1f}s later: the links hang")
        for rank in sorted(errors):
            raise AssertionError(f"peer {rank} failed: {errors[rank]!r}") from errors[rank]
        return results

    return join


def _run(group: LinkGroup, body: Callable[[Link], Any]) -> list[Any]:
    """``body`` on every peer, then flushed; the results by rank."""
    return _start(group, body)(TIMEOUT + PROMPT)


def _equal(got: Any, want: Any, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype or got.tobytes() != want.tobytes():
        raise AssertionError(f"{what}: expected {want!r}, got {got!r}")


def _elements(large_bytes: int, dtype: Any) -> int:
    return int(-(-large_bytes // np.dtype(dtype).itemsize))


def _failed(link: Link, receive_from: int) -> BaseException | None:
    """The error a receive from ``receive_from`` (which never sends) raises, or None."""
    try:
        link.recv_into(receive_from, np.empty(1))
    except CollectiveError as exc:
        return exc
    return None


# -- the checks -----------------------------------------------------------------------------------


def _in_order(open_group: Opener, large_bytes: int) -> None:
    """Messages from one peer to another arrive in the order they were sent."""
    for length in (0, 1, 5, _elements(large_bytes, np.float64)):
        sent = [np.arange(length, dtype=np.float64) + 1000 * k for k in range(3)]
        with open_group(2, TIMEOUT) as group:
            received = _run(group, functools.partial(_three, sent=sent))[1]
        for index, (got, want) in enumerate(zip(received, sent, strict=True)):
            _equal(got, want, f"message {index} of 3 from peer 0 to 1 ({length} elements)")


def _three(link: Link, sent: list[np.ndarray]) -> list[np.ndarray]:
    if link.rank == 0:
        for array in sent:
            link.send(1, array)
        return []
    received = [np.empty_like(array) for array in sent]
    for out in received:
        link.recv_into(0, out)
    return received


def _matched_by_source(open_group: Opener, large_bytes: int) -> None:
    """A receive from peer s takes s's next message, whatever other peers sent before it."""
    sent: dict[int, list[np.ndarray]] = {
        0: [np.full(3, k, np.int32) for k in range(4)],
        2: [np.arange(k + 1, dtype=np.float64) - k for k in range(4)],
    }

    def body(link: Link) -> dict[int, list[np.ndarray]] | None:
        if link.rank in sent:
            for array in sent[link.rank]:
                link.send(1, array)
            return None
        time.sleep(0.05)  # let both peers' messages arrive
        received = {source: [np.empty_like(array) for array in arrays] for source, arrays in sent.items()}
        for source in (2, 0):  # peer 2's first, though peer 0's may have arrived first
            for out in received[source]:
                link.recv_into(source, out)
        return received

    with open_group(3, TIMEOUT) as group:
        received = _run(group, body)[1]
    for source, arrays in sent.items():
        for index, want in enumerate(arrays):
            _equal(received[source][index], want, f"message {index} from peer {source} to peer 1")


def _recv_reduce(open_group: Opener, large_bytes: int) -> None:
    """``out = op(message, operand)`` for every op, into a separate ``out`` and in place."""
    for op in ReduceOp:
        dtype = np.int64 if op in BITWISE else np.float64
        a, b = np.array([1, -2, 3, 6], dtype), np.array([4, 5, -6, 6], dtype)
        with open_group(2, TIMEOUT) as group:
            out, in_place = _run(group, functools.partial(_reduce_twice, op=op, a=a, b=b))[1]
        want = NUMPY_UFUNCS[op](a, b)
        _equal(out, want, f"recv_reduce {op.value} into a separate buffer")
        _equal(in_place, want, f"recv_reduce {op.value} in place (operand is out)")


def _reduce_twice(link: Link, op: ReduceOp, a: np.ndarray, b: np.ndarray) -> Any:
    if link.rank == 0:
        link.send(1, a)
        link.send(1, a)
        return None
    out, in_place = np.empty_like(b), b.copy()
    link.recv_reduce(0, b, out, op)
    link.recv_reduce(0, in_place, in_place, op)
    return out, in_place


def _send_and_receive_in_one_step(open_group: Opener, large_bytes: int) -> None:
    """The ring pattern: every peer sends right, then receives from the left, large buffers."""
    n, length = 5, _elements(large_bytes, np.float32)

    def body(link: Link) -> np.ndarray:
        out = np.empty(length, np.float32)
        link.send((link.rank + 1) % n, np.full(length, link.rank, np.float32))
        link.recv_into((link.rank - 1) % n, out)
        return out

    with open_group(n, TIMEOUT) as group:
        results = _run(group, body)
    for rank, out in enumerate(results):
        _equal(out, np.full(length, (rank - 1) % n, np.float32), f"peer {rank}'s message from the left")


def _reuse_after_flush(open_group: Opener, large_bytes: int) -> None:
    """Once ``flush`` returns, writing the sent buffer cannot change what the receiver gets."""
    sent = np.arange(_elements(large_bytes, np.float64), dtype=np.float64)

    def body(link: Link) -> Any:
        if link.rank == 0:
            buffer = sent.copy()
            link.send(1, buffer)
            link.flush()
            buffer[...] = -1  # reused at once
            return None
        time.sleep(0.2)  # receive late: the sender's flush had to wait, or the data had left
        out = np.empty_like(sent)
        link.recv_into(0, out)
        return out

    with open_group(2, TIMEOUT) as group:
        _equal(_run(group, body)[1], sent, "a buffer written after flush()")


def _reuse_after_reply(open_group: Opener, large_bytes: int) -> None:
    """Once a message arrives that the destination sent after consuming the buffer, the sender
    may write the buffer (and send it again)."""
    sent = np.arange(_elements(large_bytes, np.float64), dtype=np.float64)

    def body(link: Link) -> Any:
        if link.rank == 0:
            buffer = sent.copy()
            link.send(1, buffer)
            link.recv_into(1, np.empty(1))  # the reply: peer 1 has consumed the buffer
            buffer[...] = -1
            link.send(1, buffer)
            return None
        first, second = np.empty_like(sent), np.empty_like(sent)
        link.recv_into(0, first)
        link.send(0, np.ones(1))
        link.recv_into(0, second)
        return first, second

    with open_group(2, TIMEOUT) as group:
        first, second = _run(group, body)[1]
    _equal(first, sent, "a buffer written after the destination's reply, as first received")
    _equal(second, np.full_like(sent, -1), "the same buffer sent again after it was written")


def _empty_messages(open_group: Opener, large_bytes: int) -> None:
    """Barrier signals (one read-only empty array) between all pairs; empty recv_into/recv_reduce."""
    n, empty = 3, np.empty(0, np.float32)

    def body(link: Link) -> tuple[np.ndarray, np.ndarray]:
        others = [peer for peer in range(n) if peer != link.rank]
        for peer in others:
            send_signal(link, peer)
        for peer in others:
            wait_signal(link, peer)
        right, left = (link.rank + 1) % n, (link.rank - 1) % n
        link.send(right, np.empty(0, np.float32))
        link.send(right, np.empty(0, np.float32))
        out, acc = np.empty(0, np.float32), np.empty(0, np.float32)
        link.recv_into(left, out)
        link.recv_reduce(left, acc, acc, ReduceOp.SUM)
        return out, acc

    with open_group(n, TIMEOUT) as group:
        results = _run(group, body)
    for rank, (out, acc) in enumerate(results):
        _equal(out, empty, f"peer {rank}'s empty recv_into")
        _equal(acc, empty, f"peer {rank}'s empty recv_reduce")


def _timeout(open_group: Opener, large_bytes: int) -> None:
    """A receive that never completes raises CollectiveTimeout by the deadline, on every peer."""
    n, timeout = 3, 0.3
    with open_group(n, timeout) as group:
        started = time.monotonic()
        join = _start(group, lambda link: _failed(link, (link.rank + 1) % n), flush=False)  # none sends
        outcomes = join(timeout + PROMPT)
        took = time.monotonic() - started
    for rank, outcome in enumerate(outcomes):
        if not isinstance(outcome, CollectiveTimeout):
            raise AssertionError(
                f"peer {rank}: a receive that never completes must raise CollectiveTimeout by the "
                f"deadline; got {outcome!r}"
            )
    if took > timeout + PROMPT:
        raise AssertionError(f"the receives timed out after {took:.1f}s; the deadline was {timeout}s")


def _abort(open_group: Opener, large_bytes: int) -> None:
    """When a peer gives up, every peer waiting for it raises its error at once."""
    reason = "MemoryError: simulated by the conformance check"
    waiting = threading.Barrier(3)

    def body(link: Link) -> BaseException | None:
        waiting.wait(TIMEOUT)
        return _failed(link, 1)  # peer 1 gives up instead of sending

    with open_group(3, TIMEOUT) as group:
        if group.abort is None:
            raise AssertionError("the factory's LinkGroup has no abort: pass aborts=False to skip this check")
        join = _start(group, body, peers=[0, 2], flush=False)  # the group failed: nothing to flush
        waiting.wait(TIMEOUT)
        time.sleep(0.05)  # both peers are waiting now
        started = time.monotonic()
        group.abort(1, reason)
        outcomes = join(TIMEOUT)
        took = time.monotonic() - started
    for rank in (0, 2):
        if not isinstance(outcomes[rank], CollectiveError) or reason not in str(outcomes[rank]):
            raise AssertionError(
                f"peer {rank}, waiting for peer 1 which gave up ({reason!r}), must raise a "
                f"CollectiveError carrying that reason; got {outcomes[rank]!r}"
            )
    if took > PROMPT:
        raise AssertionError(f"the waiting peers woke {took:.1f}s after the abort: expected at once")


CHECKS: tuple[Check, ...] = (
    Check("in_order", _in_order),
    Check("matched_by_source", _matched_by_source),
    Check("recv_reduce", _recv_reduce),
    Check("send_and_receive_in_one_step", _send_and_receive_in_one_step),
    Check("reuse_after_flush", _reuse_after_flush),
    Check("reuse_after_reply", _reuse_after_reply),
    Check("empty_messages", _empty_messages),
    Check("timeout", _timeout, needs="timeouts"),
    Check("abort", _abort, needs="aborts"),
)
