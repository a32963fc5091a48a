"""Shared-memory segments (transport.shm_segment, as the send segments of transport.shm use them): a
peer's path is checked before it is mapped; ours never outlive the process; stale ones are removed."""

from __future__ import annotations

import contextlib
import glob
import multiprocessing
import os
import secrets
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from collective.transport.network import NodeNetwork
from collective.transport.shm import SendSegment
from collective.transport.shm_segment import remove_stale, start_time

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")

SIZE = SendSegment.SIZE


def _name(pid: int | None = None) -> str:
    """A segment name of this (live) process, or of ``pid``."""
    return f"/dev/shm/collective-{os.getpid() if pid is None else pid}-{secrets.token_hex(8)}"


@pytest.fixture
def made() -> Iterator[Callable[..., str]]:
    """Makes files (sparse, of any size and mode) with the header of a segment of this process, or
    of process ``pid`` started at ``start``, and removes them after the test."""
    paths: list[str] = []
    real = SendSegment.create()
    assert real is not None
    with open(real.path, "rb") as handle:
        header_of_ours = handle.read(64)  # (magic, pid, start time, size): this process's
    real.close()

    def make(
        path: str | None = None,
        size: int = SIZE,
        mode: int = 0o600,
        pid: int | None = None,
        start: int | None = None,
    ) -> str:
        path = path or _name(pid)
        header = bytearray(header_of_ours)
        if pid is not None or start is not None:
            struct.pack_into("<qq", header, 8, os.getpid() if pid is None else pid, start or 0)
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
        try:
            os.fchmod(descriptor, mode)
            os.write(descriptor, header)
            os.ftruncate(descriptor, size)
        finally:
            os.close(descriptor)
        paths.append(path)
        return path

    yield make
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def test_our_own_segments_are_accepted_and_a_copy_with_our_header_too(made: Any) -> None:
    segment = SendSegment.create()
    assert segment is not None
    try:
        info = os.stat(segment.path)
        assert info.st_mode & 0o777 == 0o600 and info.st_size == SIZE
        assert info.st_blocks * 512 >= SIZE  # reserved up front: a full /dev/shm fails here, not later
        SendSegment.attach(segment.path).close()
        SendSegment.attach(made()).close()  # (the checks below each break one thing of this one)
    finally:
        segment.close()
    assert not os.path.exists(segment.path)


@pytest.mark.parametrize(
    "case",
    [
        "outside /dev/shm",
        "dot-dot",
        "not our name",
        "symlink",
        "mode 644",
        "wrong size",
        "fifo",
        "another kind",
        "pid not its name's",
        "pid reused",
    ],
)
def test_a_peer_cannot_name_any_file_as_its_segment(case: str, made: Any, tmp_path: Path) -> None:
    name = _name()
    if case == "outside /dev/shm":
        path = made(str(tmp_path / os.path.basename(name)))
    elif case == "dot-dot":
        path = "/dev/shm/../.." + made(str(tmp_path / os.path.basename(name)))
    elif case == "not our name":
        path = made(f"/dev/shm/other-{secrets.token_hex(8)}")
    elif case == "symlink":  # to a file that passes every other check
        os.symlink(made(), name)
        path = name
    elif case == "mode 644":
        path = made(mode=0o644)
    elif case == "wrong size":
        path = made(size=SIZE + 4096)
    elif case == "another kind":
        path = made()
        with open(path, "r+b") as handle:
            handle.write(b"COLRING1")
    elif case == "pid not its name's":
        path = made(_name(os.getppid()))
    elif case == "pid reused":  # this process's pid, started at another time: not this process's
        path = made(start=(start_time("self") or 0) + 1)
    else:
        os.mkfifo(name, 0o600)
        path = name
    try:
        with pytest.raises((ValueError, OSError)):
            SendSegment.attach(path)
    finally:
        if case in ("symlink", "fifo"):
            os.unlink(name)


def _create_and_vanish(pipe: Connection) -> None:
    segment = SendSegment.create()
    assert segment is not None
    pipe.send(segment.path)
    os._exit(0)  # no atexit, no finalizer: the segment stays behind, as after SIGKILL


def test_stale_segments_are_removed_a_live_processs_kept_and_a_forked_child_leaves_ours() -> None:
    context = multiprocessing.get_context("fork")
    theirs, ours = context.Pipe()
    child = context.Process(target=_create_and_vanish, args=(theirs,))
    child.start()
    assert ours.poll(30)
    dead = Path(ours.recv())
    child.join(30)
    assert dead.exists() and child.exitcode == 0
    mine = SendSegment.create()  # removes stale segments first
    assert mine is not None
    try:
        assert not dead.exists()
        assert Path(mine.path).exists() and remove_stale() == 0  # a live process's stays
    finally:
        mine.close()


def test_a_segment_whose_pid_was_reused_or_whose_creator_died_making_it_is_stale(made: Any) -> None:
    reused = made(start=(start_time("self") or 0) + 1)  # our pid, another process's start time
    incomplete = made(_name(_dead_pid()), size=0)  # its creator died before it wrote the header
    live = made()
    remove_stale()
    assert not os.path.exists(reused) and not os.path.exists(incomplete) and os.path.exists(live)


def _dead_pid() -> int:
    command = [sys.executable, "-c", "import os; print(os.getpid())"]
    return int(subprocess.run(command, capture_output=True, text=True).stdout)


def test_a_node_naming_a_file_that_is_not_a_segment_is_served_over_tcp(made: Any) -> None:
    context: zmq.Context[Any] = zmq.Context()
    a = NodeNetwork(context, "shm", "127.0.0.1", 0, lambda src: None)
    b = NodeNetwork(context, "shm", "127.0.0.1", 0, lambda src: None)
    try:
        forged = {**b.info, "shm": made(mode=0o644)}  # the right host, a file of the right size
        a.connect(0, [a.address, b.address], [a.info, forged])
        not_mapped = a.shared_view(1, 0, 8, np.dtype(np.uint8)) is None  # (a mapped one: a view of slot 0)
        assert not_mapped and a.stage(1, b"x" * 100) is None
    finally:
        a.close()
        b.close()
        context.destroy(linger=0)


NODE_THAT_RAISES = """
import glob
import os
import threading
import collective as col
from collective.transport.orchestrator import Orchestrator

orchestrator = Orchestrator("127.0.0.1", 0)
threading.Thread(target=orchestrator.serve, daemon=True).start()
config = col.CollectiveConfig(
    num_devices=1, num_nodes=1, global_address=orchestrator.address, node_address="127.0.0.1:0",
    data_service_port=0, job="raises", timeout=20,
)
col.register(0, "cpu", config)
print(*sorted(glob.glob(f"/dev/shm/collective-{os.getpid()}-*")), flush=True)  # send, ring, p2p
raise RuntimeError("the training script failed before finish()")
"""


def test_a_node_that_exits_without_finish_leaves_no_segment() -> None:
    result = subprocess.run(
        [sys.executable, "-c", NODE_THAT_RAISES], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1 and "RuntimeError: the training script failed" in result.stderr
    paths = result.stdout.split()
    assert len(paths) == 3, result.stdout + result.stderr  # its send, ring and p2p segments
    assert all(path.startswith("/dev/shm/collective-") for path in paths), result.stdout + result.stderr
    assert not any(map(os.path.exists, paths))
    assert not glob.glob(f"/dev/shm/collective-{paths[0].split('-')[1]}-*")
