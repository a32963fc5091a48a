"""Shared-memory segments: a peer's path is checked before it is mapped; ours never outlive the process."""

from __future__ import annotations

import contextlib
import glob
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from collective.transport.network import NodeNetwork
from collective.transport.shm import SLOT_BYTES, SLOTS, PeerSegment, SendSegment

SIZE = SLOTS * SLOT_BYTES


def _name() -> str:
    """A segment name of this (live) process: never taken for a dead process's leftover."""
    return f"/dev/shm/collective-{os.getpid()}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def made() -> Iterator[Callable[..., str]]:
    """Makes files (sparse, of any size and mode) and removes them after the test."""
    paths: list[str] = []

    def make(path: str | None = None, size: int = SIZE, mode: int = 0o600) -> str:
        path = path or _name()
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
        os.fchmod(descriptor, mode)
        os.ftruncate(descriptor, size)
        os.close(descriptor)
        paths.append(path)
        return path

    yield make
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def test_our_own_segments_are_accepted() -> None:
    segment = SendSegment.create()
    assert segment is not None
    try:
        PeerSegment(segment.path).close()
    finally:
        segment.close()


@pytest.mark.parametrize(
    "case", ["outside /dev/shm", "dot-dot", "not our name", "symlink", "mode 644", "wrong size", "fifo"]
)
def test_a_peer_cannot_name_any_file_as_its_segment(case: str, made: Any, tmp_path: Path) -> None:
    name = _name()
    if case == "outside /dev/shm":
        path = made(str(tmp_path / os.path.basename(name)))
    elif case == "dot-dot":
        path = "/dev/shm/../.." + made(str(tmp_path / os.path.basename(name)))
    elif case == "not our name":
        path = made(f"/dev/shm/other-{uuid.uuid4().hex[:12]}")
    elif case == "symlink":  # to a file that would pass every other check
        os.symlink(made(), name)
        path = name
    elif case == "mode 644":
        path = made(mode=0o644)
    elif case == "wrong size":
        path = made(size=SIZE + 4096)
    else:
        os.mkfifo(name, 0o600)
        path = name
    try:
        with pytest.raises((ValueError, OSError)):
            PeerSegment(path)
    finally:
        if case in ("symlink", "fifo"):
            os.unlink(name)


def test_a_node_naming_a_file_that_is_not_a_segment_is_served_over_tcp(made: Any) -> None:
    context: zmq.Context[Any] = zmq.Context()
    a = NodeNetwork(context, "shm", "127.0.0.1", 0, lambda src: None)
    b = NodeNetwork(context, "shm", "127.0.0.1", 0, lambda src: None)
    try:
        forged = {**b.info, "shm": made(mode=0o644)}  # the right host, a file of the right size
        a.connect(0, [a.address, b.address], [a.info, forged])
        assert 1 not in a._peer_segments and a.stage(1, b"x" * 100) is None
    finally:
        a.close()
        b.close()
        context.destroy(linger=0)


NODE_THAT_RAISES = """
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
print(col.default_runtime()._job.node._network.info["shm"], flush=True)
raise RuntimeError("the training script failed before finish()")
"""


def test_a_node_that_exits_without_finish_leaves_no_segment() -> None:
    result = subprocess.run(
        [sys.executable, "-c", NODE_THAT_RAISES], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1 and "RuntimeError: the training script failed" in result.stderr
    path = result.stdout.strip()
    assert path.startswith("/dev/shm/collective-"), result.stdout + result.stderr
    assert not os.path.exists(path)
    assert not glob.glob(f"/dev/shm/collective-{path.split('-')[1]}-*")
