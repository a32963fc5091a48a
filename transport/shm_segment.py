"""A named /dev/shm segment of this user: how every segment of this library is made, checked and removed.

Two kinds use it, each with its own layout after the header: the send segments of transport.shm
(staging between nodes of one host) and the ring segments of transport.shm_ring (the processes
of a host). Every segment starts with a header its creator writes once::

    magic (8 bytes, the kind's; written last: a segment with it is complete), pid, start time
    (the creator's, in clock ticks since boot), size (int64 each)

Segments are named ``collective-<pid>-<16 hex>``, created 0600 with O_EXCL and O_NOFOLLOW, their
whole size reserved up front (a full /dev/shm fails at creation, never later with SIGBUS), and
unlinked when closed, when garbage-collected or at exit (by their creator only, never by a forked
child). Another process's segment is validated before it is mapped read-only: our name pattern
directly in /dev/shm, opened without following links (nor waiting, should the name be a FIFO), a
regular file of our uid with mode 0600 and exactly the kind's size, the kind's magic, and a
creator that is the process of its name and still runs (pid and start time: a process that
reuses a dead one's pid is not it). Segments of processes that are gone are removed by the next
process that creates one.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import re
import secrets
import stat
import struct
import weakref
from typing import Any, ClassVar, TypeVar

__all__ = ["DIRECTORY", "HEADER", "NAME", "Segment", "process_alive", "remove_stale"]

DIRECTORY = "/dev/shm"
NAME = re.compile(r"collective-(\d{1,10})-([0-9a-f]{16})")
HEADER = 32  # the bytes of the header (the kinds lay out theirs after it)
_FIELDS = struct.Struct("<8sqqq")  # magic, pid, start time, size
_S = TypeVar("_S", bound="Segment")


def start_time(pid: int | str) -> int | None:
    """The process's start time in clock ticks since boot (None: no such process, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def process_alive(pid: int, start: int) -> bool:
    """Whether process ``pid`` (started at ``start``, in ticks) still runs: not dead, reaped or reused."""
    if start <= 0 or not os.path.isdir("/proc/self"):  # no start time known: the pid alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return start_time(pid) == start


class Segment:
    """A mapped segment: this process's own (``create``, writable) or another's (``attach``, read-only).

    A kind subclasses it with its ``MAGIC``, ``SIZE`` (the header included) and ``KIND`` (a word
    for messages); its constructor takes ``(path, memory, owner)``.
    """

    MAGIC: ClassVar[bytes]
    SIZE: ClassVar[int]
    KIND: ClassVar[str]

    def __init__(self, path: str, memory: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.memory = memory
        self.owner = owner
        _, self.pid, self.start, _ = _FIELDS.unpack_from(memory)
        self._remove = weakref.finalize(self, _unlink, path, os.getpid()) if owner else None

    @classmethod
    def create(cls: type[_S]) -> _S | None:
        """This process's new segment (stale ones removed first); None where /dev/shm cannot hold one."""
        if not os.path.isdir(DIRECTORY):
            return None
        remove_stale()
        path = os.path.join(DIRECTORY, f"collective-{os.getpid()}-{secrets.token_hex(8)}")
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            descriptor = os.open(path, flags, 0o600)
        except OSError:
            return None
        try:
            os.fchmod(descriptor, 0o600)  # whatever the umask: readers check for exactly this mode
            os.ftruncate(descriptor, cls.SIZE)
            os.posix_fallocate(descriptor, 0, cls.SIZE)  # ENOSPC now rather than SIGBUS later
            memory = mmap.mmap(descriptor, cls.SIZE)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        finally:
            os.close(descriptor)
        _FIELDS.pack_into(memory, 0, bytes(8), os.getpid(), start_time("self") or 0, cls.SIZE)
        memory[:8] = cls.MAGIC  # last: a segment with its magic is complete
        return cls(path, memory, True)

    @classmethod
    def attach(cls: type[_S], name: Any, pid: int | None = None) -> _S:
        """The segment ``name`` (or its path in /dev/shm) of process ``pid`` (None: of the process its
        name says), validated and mapped read-only; ValueError or OSError if it is not one, or its
        process is gone."""
        directory, base = os.path.split(name) if isinstance(name, str) else ("", "")
        match = NAME.fullmatch(base) if directory in ("", DIRECTORY) else None
        if match is None or (pid is not None and int(match.group(1)) != pid):
            whose = "a process" if pid is None else f"process {pid}"
            raise ValueError(f"{str(name)[:200]!r} is not the {cls.KIND} segment of {whose} in {DIRECTORY}")
        owner, path = int(match.group(1)), os.path.join(DIRECTORY, base)
        with _open_checked(path, cls.SIZE) as handle:
            memory = mmap.mmap(handle.fileno(), cls.SIZE, prot=mmap.PROT_READ)
        magic, creator, start, size = _FIELDS.unpack_from(memory)
        if magic != cls.MAGIC or creator != owner or size != cls.SIZE or not process_alive(owner, start):
            memory.close()
            raise ValueError(f"{path} is not a complete {cls.KIND} segment of a running process {owner}")
        return cls(path, memory, False)

    def alive(self) -> bool:
        """Whether the segment's creator still runs."""
        return process_alive(self.pid, self.start)

    def unlink(self) -> None:
        """Remove the segment's name (the creator's only; its mapping stays)."""
        if self._remove is not None:
            self._remove()

    def close(self) -> None:
        """Unlink it (the creator) and unmap it, unless arrays still view it (then it goes with them)."""
        self.unlink()
        with contextlib.suppress(BufferError):
            self.memory.close()


def _unlink(path: str, creator: int) -> None:
    if os.getpid() == creator:  # a forked child must not remove its parent's segment
        with contextlib.suppress(OSError):
            os.unlink(path)


def _open_checked(path: str, size: int | None) -> io.FileIO:
    """``path`` opened read-only without following links (nor blocking on a FIFO); ValueError unless
    it is a regular file of this user with mode 0600 and, when given, ``size`` bytes."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(descriptor)
        mode = stat.S_IMODE(info.st_mode)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or mode != 0o600:
            raise ValueError(f"{path} is not a private regular file of this user (mode 600)")
        if size is not None and info.st_size != size:
            raise ValueError(f"{path} has {info.st_size} bytes, expected {size}")
    except BaseException:
        os.close(descriptor)
        raise
    return os.fdopen(descriptor, "rb", buffering=0)


def remove_stale() -> int:
    """Unlink the segments of processes that are gone (dead, or their pid reused); how many.

    A complete segment names its creator's start time; one without its magic yet (its creator was
    killed while making it, or is making it now) is judged by the pid of its name alone.
    """
    removed = 0
    with contextlib.suppress(OSError):
        for name in os.listdir(DIRECTORY):
            match = NAME.fullmatch(name)
            if match is None:
                continue
            path, pid = os.path.join(DIRECTORY, name), int(match.group(1))
            try:
                with _open_checked(path, None) as handle:
                    header = handle.read(HEADER)
            except (OSError, ValueError):
                continue  # not ours
            magic, creator, start, _ = _FIELDS.unpack(header.ljust(HEADER, b"\0"))
            if len(header) < HEADER or magic == bytes(8):  # incomplete
                creator, start = pid, 0
            if creator == pid and not process_alive(pid, start):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    removed += 1
    return removed
