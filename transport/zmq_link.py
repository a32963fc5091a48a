"""The ZeroMQ Link: node leaders run the same algorithms over the data service.

``send`` cuts an array into chunks of ``wire.CHUNK_BYTES`` (one message each, sent without
copying and tracked) and returns; ``recv_into`` / ``recv_reduce`` consume chunks as they arrive,
copying or reducing each straight out of ZeroMQ's receive buffer into the destination;
``flush`` waits until ZeroMQ has released every lent buffer. Every data header repeats the
collective's step and arguments, and a receiver compares them with its own: the always-on check.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import zmq

from collective.algorithms.ops import Array, ReduceOp, combine, copy_into
from collective.errors import CollectiveTimeout, MismatchError
from collective.transport.inproc import on_device_of
from collective.transport.network import NodeNetwork
from collective.transport.outbox import went_out
from collective.transport.wire import CHUNK_BYTES, SMALL_BYTES

__all__ = ["ZmqLink"]


class ZmqLink:
    """This node's end of step ``seq`` among the nodes of ``network``."""

    def __init__(
        self,
        network: NodeNetwork,
        seq: int,
        signature: dict[str, Any],
        deadline: float,
        describe: Any = str,
        nodes: list[int] | None = None,
        channel: int = 0,
    ) -> None:
        """``signature``: fields every chunk repeats; ``nodes``: the node indices of this link's ranks;
        ``channel``: the group's (each group counts its own steps)."""
        self._network = network
        self._seq = seq
        self._deadline = deadline
        self._describe = describe  # node index -> "node 1 (peers 2-3)"
        self._signature = signature
        self._nodes = nodes if nodes is not None else list(range(network.size))
        self._rank = self._nodes.index(network.index)
        self._channel = channel
        self._trackers: list[tuple[int, zmq.MessageTracker]] = []  # (destination node, tracker)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._nodes)

    def send(self, rank: int, data: Array) -> None:
        dst = self._nodes[rank]
        if not isinstance(data, np.ndarray):  # a CuPy array leaves the device once
            data = data.get()
        base = {"t": "data", "ch": self._channel, "seq": self._seq, **self._signature}
        if data.size == 0:
            self._network.send(dst, {**base, "off": 0, "n": 0})
            return
        per_chunk = max(1, CHUNK_BYTES // data.itemsize)
        for offset in range(0, data.size, per_chunk):
            piece = data[offset : offset + per_chunk]
            header = {**base, "off": offset, "n": piece.size}
            slot = self._network.stage(dst, piece) if piece.nbytes > SMALL_BYTES else None
            if slot is not None:  # in shared memory: only the header travels
                self._network.send(dst, {**header, "shm": slot})
                continue
            # as bytes: a bfloat16 array has no buffer format ZeroMQ could read
            tracker = self._network.send(dst, header, piece.view(np.uint8))
            if tracker is not None:
                self._trackers.append((dst, tracker))

    def _chunks(self, src: int, length: int, dtype: Any) -> Iterator[tuple[slice, np.ndarray]]:
        """(where, view) for each chunk of the next array from ``src``, validated against this step."""
        received = 0
        while True:
            header, payload = self._network.receive(
                src, self._seq, self._deadline, f"data from {self._describe(src)}", self._channel
            )
            self._validate(src, header)
            offset, count = header.get("off"), header.get("n")
            if (
                not isinstance(offset, int)
                or not isinstance(count, int)
                or offset != received
                or not 0 <= count <= length - received
            ):
                raise MismatchError(
                    f"step {self._seq}: {self._describe(src)} sent elements {offset}+{count} where "
                    f"{received} of {length} were expected"
                )
            slot = header.get("shm")
            if slot is not None:  # staged in the sender's shared memory: read it there, then free it
                view = self._network.shared_view(src, slot, count * dtype.itemsize, dtype)
                if view is None or payload is not None:
                    raise MismatchError(
                        f"step {self._seq}: {self._describe(src)} named an unusable slot {slot!r}"
                    )
                yield slice(offset, offset + count), view
                self._network.release(src, self._seq, slot, self._channel)
            else:
                nbytes = 0 if payload is None else len(payload.buffer)
                if nbytes != count * dtype.itemsize:
                    raise MismatchError(
                        f"step {self._seq}: {self._describe(src)} sent {nbytes} bytes for {count} elements"
                    )
                yield (
                    slice(offset, offset + count),
                    np.frombuffer(payload.buffer, dtype) if count else np.empty(0, dtype),
                )
            received += count
            if received >= length:
                return

    def _validate(self, src: int, header: dict[str, Any]) -> None:
        if header["seq"] != self._seq or header["t"] != "data":
            raise MismatchError(
                f"{self._describe(src)} sent a {header['t']} message of step {header['seq']} while node "
                f"{self._network.index} runs step {self._seq}: the nodes called different numbers of "
                f"collectives"
            )
        theirs = {key: header.get(key) for key in self._signature}
        if theirs != self._signature:
            raise MismatchError(
                f"step {self._seq}: {self._describe(src)} runs {theirs} "
                f"but node {self._network.index} runs {self._signature}"
            )

    def recv_into(self, rank: int, out: Array) -> None:
        for where, view in self._chunks(self._nodes[rank], out.size, out.dtype):
            copy_into(out[where], on_device_of(out, view))

    def recv_reduce(self, rank: int, operand: Array, out: Array, op: ReduceOp) -> None:
        for where, view in self._chunks(self._nodes[rank], out.size, out.dtype):
            combine(op, on_device_of(out, view), operand[where], out[where])

    def flush(self) -> None:
        """Wait until ZeroMQ let go of every buffer sent; a lost destination is a PeerLostError at
        once (not a timeout at the deadline, naming nobody)."""
        for dst, tracker in self._trackers:
            error = went_out(tracker, self._deadline, partial(self._network.lost, dst))
            if error is not None:
                raise error
            if not tracker.done:
                raise CollectiveTimeout(
                    f"step {self._seq}: data sent by node {self._network.index} to {self._describe(dst)} "
                    f"was not delivered in time"
                )
        self._trackers.clear()
