"""``dist.send`` / ``dist.recv`` of the "collective" backend: our runtime's send and recv.

A send hands a copy of the tensor to the destination peer and returns (eager, like our send: two
ranks may send to each other, then receive), so it returns a completed work. A receive matches by
source and tag, in order, and writes into torch's tensor; it is queued with its (source, tag)'s,
apart from the collectives and other pairs, and runs on the thread that waits on its work (a
blocking ``recv`` is that work, waited on: no thread between), so a pending ``irecv`` holds up
neither a collective nor a receive from elsewhere. The receiving tensor must have the sender's
dtype and element count. A lost sender is a PeerLostError within
seconds (heartbeats), not the end of the timeout.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable, Sequence
from typing import Any

from collective.errors import CollectiveError, CollectiveTimeout
from collective.runtime import Runtime
from collective.torch.checks import dense, invalid, single, writable_tensor
from collective.torch.work import TorchWork, array, backend_error, host, store_back

torch: Any = importlib.import_module("torch")

__all__ = ["PointToPoint", "group_key"]


def group_key(name: str) -> int:
    """A group's 31-bit key: the high bits of its messages' tags (see PointToPoint)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little") >> 1


class PointToPoint:
    """send/recv between this process's peer and the group's other ranks (group ranks in, peers out).

    Torch keeps each group's messages apart (a communicator per group); ours match by source and
    tag only. So a message's tag carries its group's key (from the group's name, the same on every
    rank) above torch's 32-bit tag: a recv on one group never takes a message sent on another.
    """

    runtime: Runtime
    peer: int
    timeout: float
    launch: Callable[..., TorchWork]
    peer_of: Callable[[int], int]
    members: tuple[int, ...]
    p2p_key: int
    _done: TorchWork

    def _tag(self, tag: int) -> int:
        if not 0 <= tag < 1 << 32:
            raise invalid(f"tag {tag} is out of range: the collective backend takes 0..2**32-1")
        return self.p2p_key << 32 | tag

    def send(self, tensors: Sequence[Any], dst: int, tag: int = 0) -> TorchWork:
        tensor, target, tag = single(tensors, "send"), self.peer_of(dst), self._tag(tag)
        dense(tensor, "send")
        try:
            self.runtime.send(self.peer, array(host(tensor)).reshape(-1), target, tag, timeout=self.timeout)
        except CollectiveError as exc:
            raise backend_error(exc) from exc
        return self._done

    def recv(self, tensors: Sequence[Any], src: int, tag: int = 0) -> TorchWork:
        tensor, source, wire = single(tensors, "recv"), self.peer_of(src), self._tag(tag)
        writable_tensor(tensor, "recv")

        def body() -> None:
            buffer = host(tensor)
            try:
                self.runtime.recv(
                    self.peer, source, wire, timeout=self.timeout, out=array(buffer).reshape(-1)
                )
            except CollectiveTimeout as exc:
                raise _named(exc, wire, tag) from None
            store_back(buffer, tensor)

        work = self.launch("recv", body, [tensor], _ASYNC, (source, wire))
        work.sender = lambda: src
        return work

    def recv_anysource(self, tensors: Sequence[Any], tag: int = 0) -> TorchWork:
        """A receive from any rank of the group (the earliest message of its tag on the group);
        the work's ``_source_rank()`` is the sender's group rank once it completed."""
        tensor, wire = single(tensors, "recv"), self._tag(tag)
        writable_tensor(tensor, "recv")
        sender: list[int] = []

        def body() -> None:
            buffer = host(tensor)
            try:
                flat = array(buffer).reshape(-1)
                source, _ = self.runtime.recv_any(self.peer, wire, timeout=self.timeout, out=flat)
            except CollectiveTimeout as exc:
                raise _named(exc, wire, tag) from None
            store_back(buffer, tensor)
            sender.append(source)

        work = self.launch("recv", body, [tensor], _ASYNC, (-1, wire))
        work.sender = lambda: self.members.index(sender[0])
        return work


def _named(exc: CollectiveTimeout, wire: int, tag: int) -> CollectiveTimeout:
    """A receive's timeout naming torch's tag, not the one with its group's key."""
    return CollectiveTimeout(str(exc).replace(str(wire), str(tag)), exc.missing)


class _Async:
    asyncOp = True  # a receive always runs on the receive worker; torch waits on its work


_ASYNC = _Async()
