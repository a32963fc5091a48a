"""Shared-memory staging between nodes on the same host: one copy in, one read out.

Over loopback TCP every byte is copied twice by the kernel (sender to socket, socket to
receiver). Nodes on the same host (same host identity in the topology) instead pass large chunks
through a per-node *send segment* in /dev/shm: the sender copies a chunk into a free slot and sends
only a header naming the slot; the receiver reduces or copies straight out of the sender's
segment (mapped read-only) and acknowledges the slot, which frees it. When no slot is free the
chunk goes over ZeroMQ as usual, so sending never waits (two nodes sending to each other at once
cannot deadlock).

A send segment is a transport.shm_segment Segment (created, validated, mapped and removed as
every segment of this library is): its header page, then SLOTS slots of SLOT_BYTES. A peer's
segment path comes from the network, so it is trusted only as far as that validation goes (a
segment name directly in /dev/shm, of this user, mode 0600, the exact size, a send segment's
magic, of a running process); anything else is refused and that peer's chunks travel over TCP.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import numpy as np

from collective.transport.shm_segment import Segment

__all__ = ["SLOTS", "SLOT_BYTES", "SendSegment", "host_identity"]

SLOT_BYTES = 4 << 20
SLOTS = 16
_DATA = 4096  # the slots start a page after the segment's header


def host_identity() -> str:
    """Names this machine (and boot): nodes with equal identities share /dev/shm.

    ``COLLECTIVE_HOST_ID`` overrides it (as NCCL_HOSTID does NCCL's): processes that must not
    share memory though they could (separate containers on one host, a test of several hosts).
    """
    named = os.environ.get("COLLECTIVE_HOST_ID", "").strip()
    if named:
        return named
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as handle:
        boot = handle.read().strip()
    return f"{socket.gethostname()}/{boot}"


class SendSegment(Segment):
    """A node's slots: its own (``create``: None where /dev/shm cannot hold them), which it lends to
    nodes of its host, or another node's (``attach``), mapped read-only, whose slots it reads."""

    MAGIC = b"COLSEND1"
    SIZE = _DATA + SLOTS * SLOT_BYTES
    KIND = "send"

    def __init__(self, path: str, memory: Any, owner: bool) -> None:
        super().__init__(path, memory, owner)
        self._free = list(range(SLOTS))
        self._owner: dict[int, int] = {}  # slot -> the node it was lent to

    @property
    def free_slots(self) -> list[int]:
        """The slots not lent to any node now, sorted (for tests)."""
        return sorted(self._free)

    def stage(self, dst: int, data: np.ndarray) -> int | None:
        """Copy ``data`` (at most SLOT_BYTES) into a free slot lent to ``dst``; None if none is free."""
        if not self._free or data.nbytes > SLOT_BYTES:
            return None
        slot = self._free.pop()
        view = np.frombuffer(self.memory, np.uint8, data.nbytes, _DATA + slot * SLOT_BYTES)
        np.copyto(view, data.reshape(-1).view(np.uint8))
        self._owner[slot] = dst
        return slot

    def release(self, src: int, slot: Any) -> bool:
        """Node ``src`` is done with ``slot``; False if that slot was not lent to it."""
        if not isinstance(slot, int) or self._owner.get(slot) != src:
            return False
        del self._owner[slot]
        self._free.append(slot)
        return True

    def view(self, slot: Any, nbytes: int, dtype: np.dtype[Any]) -> np.ndarray | None:
        """A chunk staged in ``slot`` (of another node's segment), or None when ``slot`` / ``nbytes``
        are out of range."""
        if not isinstance(slot, int) or not 0 <= slot < SLOTS or not 0 <= nbytes <= SLOT_BYTES:
            return None
        if nbytes % dtype.itemsize:
            return None
        return np.frombuffer(self.memory, dtype, nbytes // dtype.itemsize, _DATA + slot * SLOT_BYTES)
