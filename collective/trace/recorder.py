"""The flight recorder: a bounded ring of this process's recent calls, always on.

Every collective a peer of this process makes is one entry: opened as the peer enters the call
(state ``scheduled``), told when its step is agreed (``started``: the call as agreed, the path and
schedule it takes), closed when it ends (``completed`` or ``failed``, with the error). An entry is a
small list holding the call's Signature; what the call was (op, shapes, bytes) is read from it only
when the ring is dumped, so a call pays for a list, three clock reads and a counter. The ring keeps the newest
COLLECTIVE_TRACE_SIZE entries (default 2000; 0 turns the recorder off); ``Stats`` keeps counts and
time histograms of every call since the process started, whatever the ring dropped.

A dump is one JSON document per process (``dump``): what the process is (pid, host, job, its
peers) and its entries, oldest first, with torch's Flight Recorder field names where they fit
(record_id, pg_id, collective_seq_id, profiling_name, time_created_ns, time_discovered_started_ns,
time_discovered_completed_ns, duration_ms, state, input_sizes, input_dtypes, frames).
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import tempfile
import threading
import time
from collections import deque
from typing import Any

import numpy as np

__all__ = [
    "ALGORITHM",
    "DEFAULT_SIZE",
    "FORMAT",
    "PATH",
    "SEQ",
    "SIGNATURE",
    "STARTED",
    "STATE",
    "VERSION",
    "Entry",
    "Recorder",
    "Stats",
    "as_dict",
    "caller",
    "size_class",
    "trace_dir",
]

FORMAT = "collective-flight-recorder"
VERSION = 1
DEFAULT_SIZE = 2000
SIZE_VARIABLE = "COLLECTIVE_TRACE_SIZE"
DIR_VARIABLE = "COLLECTIVE_TRACE_DIR"
CALLER_DEPTH = 8  # frames walked up to find the caller outside this package
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # collective/
_OURS_ALSO = tuple(  # the folders linked beside collective/ (algorithms, transport, bench)
    os.path.join(os.path.dirname(_OURS.rstrip(os.sep)), name) + os.sep
    for name in ("algorithms", "transport", "bench")
)
_SKIPPED = (_OURS, *_OURS_ALSO, os.path.dirname(threading.__file__) + os.sep + "threading.py")


def caller(depth: int = 2) -> str:
    """'file:line (function)' of the first frame outside this package, ``depth`` frames up to start."""
    frame: Any = sys._getframe(depth)
    for _ in range(CALLER_DEPTH):  # (a caller is a few frames up: past that, the caller is ours too)
        if frame is None or not frame.f_code.co_filename.startswith(_SKIPPED):
            break
        frame = frame.f_back
    if frame is None or frame.f_code.co_filename.startswith(_SKIPPED):
        return "-"
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} ({code.co_name})"


def size_class(nbytes: int) -> str:
    """A power-of-4 bucket of bytes: '0', '<=1KiB', '<=4KiB', ... '<=1GiB', '>1GiB'."""
    if nbytes <= 0:
        return "0"
    bound = 1024
    while nbytes > bound and bound < 1 << 30:
        bound *= 4
    if nbytes > bound:
        return ">1GiB"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if bound >= size:
            return f"<={bound // size}{unit}"
    return f"<={bound}B"


# An entry is a list (cheaper to make than an object, on every call of every peer), by these indices:
PEER, GROUP, SEQ, KIND, FRAME, SIGNATURE, PATH, ALGORITHM, STATE, CREATED, STARTED, ENDED, ERROR = range(13)
Entry = (
    list  # [peer, group, seq, kind, frame, signature, path, algorithm, state, created, started, ended, error]
)


def described(signature: Any) -> tuple[str | None, int | None, list[list[int]], list[str], int]:
    """(op, root, shapes, dtypes, bytes) of a call's Signature (read when dumped, not per call)."""
    if signature is None:
        return None, None, [], [], 0
    op = signature.op.value if signature.op is not None else None
    if signature.parts:
        shapes = [list(shape) for shape, _ in signature.parts]
        dtypes = [str(name) for _, name in signature.parts]
    elif signature.shape is not None and signature.dtype is not None:
        shapes, dtypes = [list(signature.shape)], [str(signature.dtype)]
    else:
        return op, signature.root, [], [], 0
    nbytes = sum(
        math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in zip(shapes, dtypes, strict=True)
    )
    return op, signature.root, shapes, dtypes, nbytes


def as_dict(entry: list[Any], record_id: int, world: tuple[int, ...]) -> dict[str, Any]:
    """An entry as a dump holds it (torch's Flight Recorder field names where they fit)."""
    op, root, shapes, dtypes, nbytes = described(entry[SIGNATURE])
    ended, created = entry[ENDED], entry[CREATED]
    filename, _, rest = entry[FRAME].rpartition(":")
    line, _, name = rest.partition(" ")
    return {
        "record_id": record_id,
        "pg_id": group_name(entry[GROUP], world),
        "ranks": list(entry[GROUP]),
        "peer": entry[PEER],
        "collective_seq_id": entry[SEQ],
        "is_p2p": entry[PATH] == "p2p",
        "profiling_name": f"collective:{entry[KIND]}",
        "kind": entry[KIND],
        "op": op,
        "root": root,
        "input_sizes": shapes,
        "input_dtypes": dtypes,
        "bytes": nbytes,
        "path": entry[PATH],
        "algorithm": entry[ALGORITHM],
        "state": entry[STATE],
        "time_created_ns": created,
        "time_discovered_started_ns": entry[STARTED] or None,
        "time_discovered_completed_ns": ended or None,
        "duration_ms": (ended - created) / 1e6 if ended else None,
        "error": entry[ERROR],
        "frames": [
            {
                "filename": filename or entry[FRAME],
                "line": int(line) if line.isdigit() else 0,
                "name": name.strip("()"),
            }
        ],
    }


def group_name(group: tuple[int, ...], world: tuple[int, ...]) -> str:
    return "world" if group == world else ",".join(map(str, group))


class Stats:
    """Counts and time histograms per (kind, algorithm, size class, group) since the process
    started. Per call only a counter row keyed by (group, kind, path, bytes) moves; size classes
    and seconds are worked out when asked (``snapshot``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[tuple[Any, ...], list[Any]] = {}

    def add(self, entry: list[Any], nanoseconds: int, failed: bool) -> None:
        signature = entry[SIGNATURE]
        if signature is None or signature.parts or signature.shape is None or signature.dtype is None:
            nbytes = described(signature)[4]
        else:
            nbytes = math.prod(signature.shape) * signature.dtype.itemsize
        key = (entry[GROUP], entry[KIND], entry[ALGORITHM] or entry[PATH] or "-", nbytes)
        row = self._rows.get(key)
        if row is None:
            with self._lock:
                row = self._rows.setdefault(key, [0, 0, 0, [0] * 64])
        row[0] += 1  # (a lost increment under a race costs one count, never a crash)
        row[1] += failed
        row[2] += nanoseconds
        row[3][min(nanoseconds.bit_length(), 63)] += 1

    def snapshot(self, world: tuple[int, ...]) -> list[dict[str, Any]]:
        with self._lock:
            items = [(key, [row[0], row[1], row[2], list(row[3])]) for key, row in self._rows.items()]
        merged: dict[tuple[str, str, str, str], list[Any]] = {}
        for (group, kind, algorithm, nbytes), (calls, failed, nanoseconds, bins) in items:
            key = (kind, algorithm, size_class(nbytes), group_name(group, world))
            row = merged.setdefault(key, [0, 0, 0, 0, [0] * 64])
            row[0] += calls
            row[1] += failed
            row[2] += nanoseconds
            row[3] += nbytes * calls
            row[4] = [a + b for a, b in zip(row[4], bins, strict=True)]
        return [
            {
                "kind": kind,
                "algorithm": algorithm,
                "size_class": size,
                "group": group,
                "calls": calls,
                "failed": failed,
                "seconds": nanoseconds / 1e9,
                "bytes": nbytes,
                "histogram": {f"{(1 << b) / 1e9:.3g}": n for b, n in enumerate(bins) if n},
            }
            for (kind, algorithm, size, group), (calls, failed, nanoseconds, nbytes, bins) in sorted(
                merged.items()
            )
        ]


class Recorder:
    """This process's ring of entries (see the module's docstring)."""

    def __init__(self, size: int | None = None) -> None:
        if size is None:
            text = os.environ.get(SIZE_VARIABLE, "").strip()
            size = int(text) if text.isdigit() else DEFAULT_SIZE
        self.size = size
        self._ring: deque[list[Any]] = deque(maxlen=max(size, 1))
        self.stats = Stats()
        self.job = ""
        self.world: tuple[int, ...] = ()
        self.peers: tuple[int, ...] = ()
        self._dumped: dict[tuple[tuple[int, ...], int], str | None] = {}
        self._lock = threading.Lock()
        self._token = 0
        self._p2p: dict[tuple[int, int, int], int] = {}  # (src, dst, tag) -> the next p2p_seq_id

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def joined(self, job: str, world: tuple[int, ...], peers: tuple[int, ...], token: int) -> None:
        """Name the job whose calls follow (dumps say which job and which peers they hold); a new
        job (another ``token``) starts an empty ring: its calls are numbered afresh."""
        with self._lock:
            if token != self._token:
                self._token = token
                self._ring.clear()
                self._dumped.clear()
                self._p2p.clear()
            self.job, self.world, self.peers = job, world, peers

    def open(self, peer: int, group: tuple[int, ...], seq: int, kind: str, frame: str) -> list[Any]:
        entry = [peer, group, seq, kind, frame, None, "", "", "scheduled", time.time_ns(), 0, 0, None]
        self._ring.append(entry)
        return entry

    def open_p2p(self, peer: int, src: int, dst: int, tag: int, kind: str, frame: str) -> list[Any]:
        """An entry for a send or receive of ``peer`` (``src`` -1: from any peer), numbered per
        (source, destination, tag) as a receiver matches them."""
        key = (src, dst, tag)
        with self._lock:
            seq = self._p2p.get(key, 0)
            self._p2p[key] = seq + 1
        entry = [peer, (src, dst), seq, kind, frame, None, "p2p", "", "started", time.time_ns(), 0, 0, None]
        self._ring.append(entry)
        return entry

    def close(self, entry: list[Any], error: BaseException | None = None) -> None:
        ended = entry[ENDED] = time.time_ns()
        if error is None:
            entry[STATE] = "completed"
        else:
            entry[STATE] = "failed"
            entry[ERROR] = f"{type(error).__name__}: {error}"
        self.stats.add(entry, ended - entry[CREATED], error is not None)

    def entries(self) -> list[list[Any]]:
        return list(self._ring)

    def document(self, reason: str) -> dict[str, Any]:
        return {
            "schema": FORMAT,
            "version": VERSION,
            "reason": reason,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "job": self.job,
            "world": len(self.world),
            "peers": list(self.peers),
            "dumped_ns": time.time_ns(),
            "trace_size": self.size,
            "entries": [as_dict(entry, i, self.world) for i, entry in enumerate(self.entries())],
        }

    def dump(self, path: str | None = None, reason: str = "dump_trace") -> str:
        """Write this process's dump to ``path`` (default: its file in ``trace_dir``); the path."""
        if path is None:
            folder = trace_dir(self.job)
            os.makedirs(folder, exist_ok=True)
            first = min(self.peers) if self.peers else 0
            path = os.path.join(folder, f"peer{first}-{os.getpid()}.json")
        text = json.dumps(self.document(reason))
        temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(temporary, "w") as file:
            file.write(text)
        os.replace(temporary, path)
        return path

    def dump_once(self, group: tuple[int, ...], seq: int, reason: str) -> str | None:
        """Dump for the failure of step ``seq`` of ``group``, once for all this process's peers
        (they fail alike); the path written (None: the recorder is off or the write failed)."""
        if self.size <= 0:
            return None
        with self._lock:
            if (group, seq) in self._dumped:
                return self._dumped[(group, seq)]
            if len(self._dumped) > 1000:
                self._dumped.clear()
            try:
                path: str | None = self.dump(reason=reason)
            except OSError:
                path = None
            self._dumped[(group, seq)] = path
        return path


def trace_dir(job: str) -> str:
    """Where dumps go: COLLECTIVE_TRACE_DIR, else collective-trace-<job> in the temp directory."""
    given = os.environ.get(DIR_VARIABLE, "").strip()
    if given:
        return given
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job) or "default"
    return os.path.join(tempfile.gettempdir(), f"collective-trace-{safe}")
