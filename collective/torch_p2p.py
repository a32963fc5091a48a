"""``dist.send`` / ``dist.recv`` of the "collective" backend, through the group's torch store.

Our runtime's send/recv moves arrays between peers of one process; between processes (each
torch rank is one) it is not there yet, so the backend carries point-to-point messages in the
key-value store torch hands its process groups: a send sets the key
``collective/p2p/<src>/<dst>/<tag>/<n>`` (the n-th message of that channel) to the tensor's bytes
and returns (eager, like our send: two ranks may send to each other, then receive); a receive
waits for its key (polling, so it notices a lost sender by the job's heartbeats instead of
waiting for the store's timeout), copies the bytes into the tensor and deletes the key. The
receiving tensor gives the shape and dtype; a message of another size is an error.

Every byte goes through rank 0's store server: fine for control messages and pipeline stages
of moderate size, not a bulk data path.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from collective.errors import CollectiveTimeout, InvalidArgumentError, JobClosedError
from collective.runtime import Runtime
from collective.torch_work import TorchWork, backend_error, host, store_back

torch: Any = importlib.import_module("torch")

__all__ = ["PointToPoint"]

POLL_FIRST, POLL_MAX = 0.0005, 0.05  # seconds between looks at the store while a receive waits


def _lost(runtime: Runtime, peer: int) -> BaseException | None:
    """The error for ``peer``'s node being lost or gone, if the job's heartbeats say so."""
    job = getattr(runtime, "_job", None)
    if job is None:
        return JobClosedError(f"recv: the job ended while waiting for peer {peer}")
    node = getattr(job, "node", None)
    found: BaseException | None = node.lost_peer(peer) if node is not None else None
    return found


class PointToPoint:
    """send/recv over ``store`` between this process's peer and the group's other ranks."""

    runtime: Runtime
    peer: int
    store: Any
    timeout: float
    launch: Callable[..., TorchWork]
    peer_of: Callable[[int], int]
    _sent: dict[tuple[int, int], int]
    _taken: dict[tuple[int, int], int]
    _p2p_lock: threading.Lock

    def _key(self, counters: dict[tuple[int, int], int], other: int, tag: int, sending: bool) -> str:
        with self._p2p_lock:
            n = counters.get((other, tag), 0)
            counters[(other, tag)] = n + 1
        src, dst = (self.peer, other) if sending else (other, self.peer)
        return f"collective/p2p/{src}/{dst}/{tag}/{n}"

    def send(self, tensors: Sequence[Any], dst: int, tag: int = 0) -> TorchWork:
        if len(tensors) != 1:
            raise backend_error(InvalidArgumentError(f"send takes one tensor, got {len(tensors)}"))
        tensor = tensors[0]
        try:
            data = host(tensor).reshape(-1).view(torch.uint8).numpy().tobytes()
            self.store.set(self._key(self._sent, self.peer_of(dst), tag, True), data)
        except BaseException as exc:
            raise backend_error(exc) from exc
        return TorchWork.completed([tensor], "send")

    def recv(self, tensors: Sequence[Any], src: int, tag: int = 0) -> TorchWork:
        if len(tensors) != 1:
            raise backend_error(InvalidArgumentError(f"recv takes one tensor, got {len(tensors)}"))
        tensor, source = tensors[0], self.peer_of(src)
        key = self._key(self._taken, source, tag, False)
        return self.launch("recv", lambda: self._take(key, source, tag, tensor), [tensor], _ASYNC, True)

    def recv_anysource(self, tensors: Sequence[Any], tag: int = 0) -> TorchWork:
        raise backend_error(
            InvalidArgumentError("recv without src (any source) is not supported by the collective backend")
        )

    def _take(self, key: str, source: int, tag: int, tensor: Any) -> None:
        deadline = time.monotonic() + self.timeout
        pause = POLL_FIRST
        while not self.store.check([key]):
            lost = _lost(self.runtime, source)
            if lost is not None:
                raise lost
            if time.monotonic() > deadline:
                raise CollectiveTimeout(
                    f"recv: peer {self.peer} waited {self.timeout:g}s for a message from peer {source} "
                    f"with tag {tag}; check that it calls send(..., dst={self.peer}, tag={tag})",
                    [source],
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX)
        data = bytes(self.store.get(key))
        self.store.delete_key(key)
        buffer = host(tensor)
        if len(data) != buffer.numel() * buffer.element_size():
            raise InvalidArgumentError(
                f"recv: peer {source} sent {len(data)} bytes with tag {tag}; the receiving tensor "
                f"{tuple(tensor.shape)} {tensor.dtype} holds {buffer.numel() * buffer.element_size()}"
            )
        if data:
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            buffer.reshape(-1).view(torch.uint8).copy_(flat)
        store_back(buffer, tensor)


class _Async:
    asyncOp = True  # a receive always runs on the p2p queue; torch waits on its work


_ASYNC = _Async()
