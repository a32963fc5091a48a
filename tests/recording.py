"""A simulated network of recording links, for running algorithms without any transport.

Each peer runs in a thread with a ``RecordingLink``. The network counts messages and bytes per
peer (the algorithms' cost model) and enforces the Link ownership rule adversarially: a message
is consumed only while its sender is blocked (in a receive, a flush, or done), as late as any
real transport could, and at that moment the sender's buffer must still hold what was sent.
A sender that wrote to a lent buffer too early is reported in ``violations``.

Like a real transport it passes the shipped Link conformance checks
(``collective.algorithms.conformance``): with a ``timeout`` every wait ends by the network's
deadline (CollectiveTimeout), and ``abort(peer, reason)`` fails every wait as a peer that gave up.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from collective.algorithms.ops import ReduceOp, combine
from collective.errors import CollectiveTimeout, PeerLostError

WAIT = 20.0


@dataclass
class Traffic:
    sent_messages: int = 0
    sent_bytes: int = 0
    received_messages: int = 0
    received_bytes: int = 0
    messages: list[tuple[int, int]] = field(default_factory=list)  # (destination, bytes), in sending order


class Network:
    def __init__(self, size: int, timeout: float | None = None) -> None:
        """``size`` peers; with ``timeout`` every wait ends by that many seconds from now (else
        each wait gives up after ``WAIT``)."""
        self.size = size
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.gave_up: tuple[int, str] | None = None  # (peer, reason) once a peer aborted
        self.cv = threading.Condition()
        self.boxes: dict[tuple[int, int], deque[tuple[Any, bytes]]] = {}
        self.running = [True] * size
        self.outstanding = [0] * size
        self.traffic = [Traffic() for _ in range(size)]
        self.violations: list[str] = []

    def links(self) -> list[RecordingLink]:
        return [RecordingLink(self, rank) for rank in range(self.size)]

    def abort(self, peer: int, reason: str) -> None:
        """``peer`` gives up: every wait, now or later, raises PeerLostError naming it and ``reason``."""
        with self.cv:
            self.gave_up = (peer, reason)
            self.cv.notify_all()

    def wait_for(self, ready: Callable[[], bool], what: str, peers: list[int]) -> None:
        """Wait (holding ``cv``) until ``ready()``; raise on an abort or past the deadline."""
        limit = WAIT if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        self.cv.wait_for(lambda: self.gave_up is not None or ready(), timeout=limit)
        if self.gave_up is not None:
            peer, reason = self.gave_up
            raise PeerLostError(f"peer {peer} gave up: {reason}", [peer])
        if not ready():
            raise CollectiveTimeout(f"{what}: timed out", peers)

    def run(self, body: Callable[[RecordingLink], Any]) -> list[Any]:
        """Run ``body(link)`` for every peer in its own thread; re-raise the first failure."""
        results = run_links(self.links(), body)
        leftover = {pair: len(box) for pair, box in self.boxes.items() if box}
        assert not leftover, f"messages never received: {leftover}"
        return results


def run_links(links: list[Any], body: Callable[[Any], Any]) -> list[Any]:
    """Run ``body(link)`` and then ``link.flush()`` for each link in its own thread.

    Returns the results by rank; re-raises the first failure tagged with its rank; a thread still
    running after the wait fails the test. A link with ``finished()`` is told when its peer is done.
    """
    results: list[Any] = [None] * len(links)
    errors: list[BaseException | None] = [None] * len(links)

    def target(link: Any) -> None:
        try:
            results[link.rank] = body(link)
            link.flush()
        except BaseException as exc:
            errors[link.rank] = exc
        finally:
            finished = getattr(link, "finished", None)
            if finished is not None:
                finished()

    threads = [threading.Thread(target=target, args=(link,), daemon=True) for link in links]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT + 5)
    assert not any(t.is_alive() for t in threads), "peers hung"
    for rank, error in enumerate(errors):
        if error is not None:
            raise AssertionError(f"peer {rank} failed: {error!r}") from error
    return results


class RecordingLink:
    def __init__(self, network: Network, rank: int) -> None:
        self.network = network
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.network.size

    def send(self, dst: int, data: Any) -> None:
        assert 0 <= dst < self.size and dst != self._rank, f"bad destination {dst}"
        assert data.ndim == 1 and data.flags.c_contiguous, "algorithms send flat contiguous arrays"
        net = self.network
        with net.cv:
            net.boxes.setdefault((self._rank, dst), deque()).append((data, data.tobytes()))
            net.outstanding[self._rank] += 1
            traffic = net.traffic[self._rank]
            traffic.sent_messages += 1
            traffic.sent_bytes += data.nbytes
            traffic.messages.append((dst, data.nbytes))
            net.cv.notify_all()

    def _consume(self, src: int, use: Callable[[Any], None]) -> None:
        net = self.network
        with net.cv:
            net.running[self._rank] = False
            net.cv.notify_all()
            net.wait_for(
                lambda: bool(net.boxes.get((src, self._rank))) and not net.running[src],
                f"peer {self._rank} waited for a message from {src}",
                [src],
            )
            data, snapshot = net.boxes[(src, self._rank)].popleft()
            if data.tobytes() != snapshot:
                net.violations.append(f"peer {src} wrote to a buffer lent to peer {self._rank}")
            use(data)  # while the sender is still blocked: it cannot resume without net.cv
            net.outstanding[src] -= 1
            traffic = net.traffic[self._rank]
            traffic.received_messages += 1
            traffic.received_bytes += data.nbytes
            net.running[self._rank] = True
            net.cv.notify_all()

    def recv_into(self, src: int, out: Any) -> None:
        def use(data: Any) -> None:
            assert data.shape == out.shape and data.dtype == out.dtype, "message does not fit the buffer"
            np.copyto(out, data)

        self._consume(src, use)

    def recv_reduce(self, src: int, operand: Any, out: Any, op: ReduceOp) -> None:
        def use(data: Any) -> None:
            assert data.shape == out.shape == operand.shape, "message does not fit the buffer"
            combine(op, data, operand, out)

        self._consume(src, use)

    def finished(self) -> None:
        """This peer's thread is done: it counts as blocked (it will never write a buffer again)."""
        with self.network.cv:
            self.network.running[self._rank] = False
            self.network.cv.notify_all()

    def flush(self) -> None:
        net = self.network
        with net.cv:
            net.running[self._rank] = False
            net.cv.notify_all()
            net.wait_for(
                lambda: net.outstanding[self._rank] == 0,
                f"peer {self._rank}: lent buffers never consumed",
                [],
            )
            net.running[self._rank] = True
