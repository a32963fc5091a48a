"""Ring segments (transport.shm_ring): private files, validated before mapping, removed when stale;
waits that spin, yield, block on the owner's futex bell, time out and watch."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from collective.transport.shm_ring import SIZE, RingSegment, Waiting
from collective.transport.shm_segment import remove_stale

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")


def test_a_segment_is_private_reserved_and_removed_at_close() -> None:
    segment = RingSegment.create()
    assert segment is not None
    path = Path(segment.path)
    info = path.stat()
    assert info.st_mode & 0o777 == 0o600 and info.st_size == SIZE and info.st_uid == os.geteuid()
    assert info.st_blocks * 512 >= SIZE  # reserved up front: a full /dev/shm fails here, not later
    other = RingSegment.attach(segment.name, os.getpid())
    assert other.pid == os.getpid() and not other.closed and other.alive()
    segment.close()
    assert not path.exists() and other.closed


def test_only_our_own_well_formed_segments_are_mapped(tmp_path: Path) -> None:
    segment = RingSegment.create()
    assert segment is not None
    try:
        with pytest.raises(ValueError, match="not the ring segment of process"):
            RingSegment.attach(segment.name, os.getpid() + 1)  # the pid in the name must match
        for name in ("../etc/passwd", f"collective-{os.getpid()}-zz", "collective-1-0123456789abcdef/x", 7):
            with pytest.raises(ValueError):
                RingSegment.attach(name, os.getpid())
        link = Path("/dev/shm") / f"collective-{os.getpid()}-{'ab' * 8}"
        link.symlink_to(segment.path)
        try:
            with pytest.raises(OSError):  # O_NOFOLLOW
                RingSegment.attach(link.name, os.getpid())
        finally:
            link.unlink()
        os.chmod(segment.path, 0o644)
        with pytest.raises(ValueError, match="private regular file"):
            RingSegment.attach(segment.name, os.getpid())
        os.chmod(segment.path, 0o600)
        os.truncate(segment.path, SIZE - 4096)
        with pytest.raises(ValueError, match="bytes, expected"):
            RingSegment.attach(segment.name, os.getpid())
    finally:
        segment.close()


def _create_and_vanish(pipe: Connection) -> None:
    segment = RingSegment.create()
    assert segment is not None
    pipe.send(segment.path)
    os._exit(0)  # no atexit, no finalizer: the segment stays behind, as after SIGKILL


def test_segments_of_dead_processes_are_removed_by_the_next_one() -> None:
    context = multiprocessing.get_context("fork")
    theirs, ours = context.Pipe()
    child = context.Process(target=_create_and_vanish, args=(theirs,))
    child.start()
    assert ours.poll(30)
    path = Path(ours.recv())
    child.join(30)
    assert path.exists()
    mine = RingSegment.create()  # removes stale segments first
    assert mine is not None
    try:
        assert not path.exists()
        assert Path(mine.path).exists() and remove_stale() == 0  # a live process's stays
    finally:
        mine.close()


def test_a_blocked_waiter_is_woken_by_the_owners_post() -> None:
    owner, reader = RingSegment.create(), RingSegment.create()
    assert owner is not None and reader is not None
    try:
        theirs = RingSegment.attach(owner.name, os.getpid())
        word = theirs.channels[0].progress
        waiting = Waiting(1, reader)
        waiting.spin = waiting.yields = 0  # straight to the futex

        def post() -> None:
            time.sleep(0.2)  # (kept: the delay under test, measured below: the waiter blocks meanwhile)
            owner.channels[0].progress[0] = 5
            owner.bump()
            owner.wake()

        poster = threading.Thread(target=post)
        poster.start()
        started = time.monotonic()
        assert waiting.until(word, 5, theirs, time.monotonic() + 10, lambda: None)
        assert 0.15 < time.monotonic() - started < 1.0
        poster.join()
        assert not waiting.until(word, 6, theirs, time.monotonic() + 0.2, lambda: None)  # the deadline

        def watch() -> None:
            raise RuntimeError("gone")

        with pytest.raises(RuntimeError, match="gone"):
            waiting.until(word, 6, theirs, time.monotonic() + 10, watch)
    finally:
        owner.close()
        reader.close()
