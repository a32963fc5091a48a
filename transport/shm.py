"""Shared-memory staging between nodes on the same host: one copy in, one read out.

Over loopback TCP every byte is copied twice by the kernel (sender to socket, socket to
receiver). Nodes on the same host (same host identity in the topology) instead pass large chunks
through a per-node *send segment* in /dev/shm: the sender copies a chunk into a free slot and sends
only a header naming the slot; the receiver reduces or copies straight out of the sender's
segment (mapped read-only) and acknowledges the slot, which frees it. When no slot is free the
chunk goes over ZeroMQ as usual, so sending never waits (two nodes sending to each other at once
cannot deadlock). The segment is created with mode 0600 and removed when the node leaves, and at
the latest when its process exits (any way Python exits: an exception, a lost peer, no finish());
one left behind by a killed process (SIGKILL, or a signal with no Python handler) is removed by
the next node that starts on the host.

A peer's segment path comes from the network, so it is trusted only as far as it is checked: a
name this module makes (``collective-<pid>-<12 hex digits>``) directly in /dev/shm, opened
without following a symbolic link, a regular file owned by this user with mode 0600 and exactly
the segment's size. Anything else is refused and that peer's chunks travel over TCP.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import socket
import stat
import uuid
import weakref
from typing import Any

import numpy as np

__all__ = ["SLOTS", "SLOT_BYTES", "PeerSegment", "SendSegment", "host_identity"]

SLOT_BYTES = 4 << 20
SLOTS = 16
_DIRECTORY = "/dev/shm"
_PREFIX = "collective-"
_NAME = re.compile(r"collective-[0-9]{1,10}-[0-9a-f]{12}")


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


class SendSegment:
    """This node's slots; ``None`` from ``create`` where /dev/shm is not available."""

    def __init__(self, path: str, memory: mmap.mmap) -> None:
        self.path = path
        self._memory = memory
        self._free = list(range(SLOTS))
        self._owner: dict[int, int] = {}  # slot -> the node it was lent to
        self._remove = weakref.finalize(self, _unlink, path)  # at close, collection or interpreter exit

    @classmethod
    def create(cls) -> SendSegment | None:
        if not os.path.isdir(_DIRECTORY):
            return None
        _remove_stale()
        path = os.path.join(_DIRECTORY, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError:
            return None
        try:
            os.fchmod(descriptor, 0o600)  # whatever the umask: peers check for exactly this mode
            os.ftruncate(descriptor, SLOTS * SLOT_BYTES)
            memory = mmap.mmap(descriptor, SLOTS * SLOT_BYTES)
        except OSError:
            os.unlink(path)
            return None
        finally:
            os.close(descriptor)
        return cls(path, memory)

    def stage(self, dst: int, data: np.ndarray) -> int | None:
        """Copy ``data`` (at most SLOT_BYTES) into a free slot lent to ``dst``; None if none is free."""
        if not self._free or data.nbytes > SLOT_BYTES:
            return None
        slot = self._free.pop()
        view = np.frombuffer(self._memory, np.uint8, data.nbytes, slot * SLOT_BYTES)
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

    def close(self) -> None:
        self._memory.close()
        self._remove()


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _remove_stale() -> None:
    """Remove segments left by processes that died without cleaning up (their pid is in the name)."""
    for name in os.listdir(_DIRECTORY):
        if not name.startswith(_PREFIX):
            continue
        pid = name[len(_PREFIX) :].split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(_DIRECTORY, name))
        except PermissionError:
            pass  # another user's process, alive


class PeerSegment:
    """Another node's send segment, mapped read-only; ValueError or OSError if ``path`` is not one."""

    def __init__(self, path: str) -> None:
        directory, name = os.path.split(path)
        if directory != _DIRECTORY or not _NAME.fullmatch(name):
            raise ValueError(f"{path[:200]!r} is not a segment of this library in {_DIRECTORY}")
        # No symbolic link; no waiting for a writer should the name be a FIFO.
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{path} is not a regular file")
            if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) != 0o600:
                raise ValueError(
                    f"{path} has owner {info.st_uid} and mode {stat.S_IMODE(info.st_mode):o} "
                    f"(a segment has this user's, {os.getuid()}, and 600)"
                )
            if info.st_size != SLOTS * SLOT_BYTES:
                raise ValueError(f"{path} has {info.st_size} bytes (a segment has {SLOTS * SLOT_BYTES})")
            self._memory = mmap.mmap(descriptor, SLOTS * SLOT_BYTES, prot=mmap.PROT_READ)
        finally:
            os.close(descriptor)

    def view(self, slot: Any, nbytes: int, dtype: np.dtype[Any]) -> np.ndarray | None:
        """The staged chunk, or None when ``slot`` / ``nbytes`` are out of range."""
        if not isinstance(slot, int) or not 0 <= slot < SLOTS or not 0 <= nbytes <= SLOT_BYTES:
            return None
        if nbytes % dtype.itemsize:
            return None
        return np.frombuffer(self._memory, dtype, nbytes // dtype.itemsize, slot * SLOT_BYTES)

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self._memory.close()
