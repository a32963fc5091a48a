"""The flight recorder: a bounded ring of this process's recent calls, always on.

Every collective a peer of this process makes is one entry, in the states ``scheduled`` (the peer
entered the call), ``started`` (its step is agreed: the call as agreed, the path and schedule it
takes), ``completed`` or ``failed`` (with the error). While a call is open its rendezvous holds it
and a dump reads it from there (``Recorder.watch``); once it ends, the rendezvous appends one tuple
to the ring. What the call was (op, shapes, bytes) is read from its Signature only when dumped, so
a call pays for a tuple and two clock reads (``CLOCK``: the monotonic clock, which a call reads for
its deadline anyway; a dump turns its times into the wall clock's). ``Stats`` tallies the ring in
batches (counts and time histograms of every call since the process started, whatever the ring
dropped). The ring keeps the newest COLLECTIVE_TRACE_SIZE entries (default 2000; 0 turns the recorder off).

A dump is one JSON document per process (``dump``): what the process is (pid, host, job, its
peers) and its entries, oldest first, with torch's Flight Recorder field names where they fit
(record_id, pg_id, collective_seq_id, profiling_name, time_created_ns, time_discovered_started_ns,
time_discovered_completed_ns, duration_ms, state, input_sizes, input_dtypes, frames).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import operator
import os
import socket
import sys
import tempfile
import threading
import time
import types
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "ALGORITHM",
    "CLOCK",
    "ENDED",
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
    "run_for",
    "size_class",
    "trace_dir",
]

FORMAT = "collective-flight-recorder"
VERSION = 1
DEFAULT_SIZE = 2000
SIZE_VARIABLE = "COLLECTIVE_TRACE_SIZE"
DIR_VARIABLE = "COLLECTIVE_TRACE_DIR"
EVERY_JOB_VARIABLE = "COLLECTIVE_TRACE_EVERY_JOB"  # 1: dump each job's calls as it ends, and at exit
CLOCK = time.monotonic_ns  # entries' times (the clock of the deadlines: one read serves both)
CALLER_DEPTH = 16  # frames walked up to find the caller outside this package
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # collective/
_ROOT = os.path.dirname(_OURS.rstrip(os.sep)) + os.sep
# Frames skipped on the way to a call's caller: the runtime (with the folders linked beside it),
# threading (an async call's worker), torch.distributed (the torch backend's callers' calls) and
# torch's autograd (a gradient hook's call is made at the script's backward()).
_SKIPPED = (_OURS, _ROOT + "algorithms" + os.sep, _ROOT + "transport" + os.sep, threading.__file__)
_SKIPPED_WITHIN = tuple(
    os.sep + os.path.join("torch", *part) for part in (("distributed", ""), ("autograd", ""), ("_tensor.py",))
)
# ... but the benchmarks are callers like any script.
_CALLERS = (_OURS + "bench" + os.sep, _ROOT + "bench" + os.sep)


def _ours(filename: str) -> bool:
    skipped = filename.startswith(_SKIPPED) and not filename.startswith(_CALLERS)
    return skipped or any(part in filename for part in _SKIPPED_WITHIN)


Where = tuple[Any, int]  # (code object, byte offset of its instruction) of a caller's frame
# id(code object) -> (it, whether it is this package's), checked once each; by id, as a code
# object hashes its whole body every time, and held, so that its id stays its own
_OURS_CODE: dict[int, tuple[Any, bool]] = {}
_last: list[Any] = [None]  # the code of the last caller found where the walk started (not ours)


def caller(depth: int = 2) -> Where | None:
    """Where the first frame outside this package is, ``depth`` frames up to start (None: none
    within a few frames): its code and instruction, read as a line when dumped (``frame_of``).
    Per call: a dict lookup a frame walked (none where the walk starts in the last call's
    caller); ``sys._getframe(depth)`` makes no frame object of the frames it skips, so callers
    start it at their caller's depth (a frame object made costs 0.2-0.3 us a call)."""
    frame: Any = sys._getframe(depth)
    code = frame.f_code
    if code is _last[0]:  # (the caller of the last call: a loop's)
        return (code, frame.f_lasti)
    found = _OURS_CODE.get(id(code))
    if found is not None and not found[1]:  # (a caller seen before)
        _last[0] = code
        return (code, frame.f_lasti)
    return _walk(frame)


def _walk(frame: Any) -> Where | None:
    """``caller``'s walk up from ``frame`` to the first frame outside this package."""
    ours = _OURS_CODE
    walked = 0
    while True:  # (a caller is a few frames up: past CALLER_DEPTH, the caller is ours too)
        code = frame.f_code
        found = ours.get(id(code))
        if found is None:
            if len(ours) > 4096:  # (code objects made on the fly: bounded)
                ours.clear()
            found = ours[id(code)] = (code, _ours(code.co_filename))
        if not found[1]:
            return (code, frame.f_lasti)
        frame = frame.f_back
        walked += 1
        if frame is None or walked == CALLER_DEPTH:
            return getattr(_queued, "where", None)  # (a call run for another thread: its caller)


_queued = threading.local()  # where the work this thread runs for another was asked for


def run_for(where: Where | None, work: Callable[[], Any]) -> Any:
    """Run ``work`` (queued by another thread, that ``caller`` found at ``where``) so that the
    calls it makes are recorded as made there, not in this thread's own frames."""
    _queued.where = where
    try:
        return work()
    finally:
        _queued.where = None


def frame_of(where: Where | None) -> dict[str, Any]:
    """A dump's frame (torch's fields): filename, line, name."""
    if where is None:
        return {"filename": "-", "line": 0, "name": ""}
    code, offset = where
    line = next((line for start, end, line in code.co_lines() if start <= offset < end), None)
    return {"filename": code.co_filename, "line": line or code.co_firstlineno, "name": code.co_name}


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


# An entry is a sequence (cheaper to make than an object, on every call of every peer): a tuple
# once ended, a list while open, by these indices (an entry's fields are named as they are):
PEER, GROUP, SEQ, KIND, FRAME, SIGNATURE, PATH, ALGORITHM, STATE, CREATED, STARTED, ENDED, ERROR = range(13)
Entry = Sequence


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
    return op, signature.root, shapes, dtypes, _nbytes(signature.shape, signature.dtype, signature.parts)


def _nbytes(shape: tuple[int, ...] | None, dtype: Any, parts: tuple[Any, ...]) -> int:
    """The bytes of a call of ``shape`` and ``dtype``, or of ``parts`` ((shape, dtype name) pairs)."""
    if parts:
        return sum(math.prod(shape) * np.dtype(name).itemsize for shape, name in parts)
    return 0 if shape is None or dtype is None else math.prod(shape) * np.dtype(dtype).itemsize


def wall_offset() -> int:
    """What turns a ``CLOCK`` time into the wall clock's (ns since the epoch) now."""
    return time.time_ns() - CLOCK()


def as_dict(entry: Sequence[Any], record_id: int, world: tuple[int, ...], offset: int) -> dict[str, Any]:
    """An entry as a dump holds it (torch's Flight Recorder field names where they fit), its
    times on the wall clock (``offset``: ``wall_offset()``)."""
    op, root, shapes, dtypes, nbytes = described(entry[SIGNATURE])
    ended, created, started = entry[ENDED], entry[CREATED], entry[STARTED]
    p2p = entry[PATH] == "p2p"
    group = entry[GROUP][:2] if p2p else entry[GROUP]  # (a send or receive's: source, destination, tag)
    document = {
        "record_id": record_id,
        "pg_id": group_name(group, world),
        "ranks": list(group),
        "peer": entry[PEER],
        "collective_seq_id": entry[SEQ],
        "is_p2p": p2p,
        "profiling_name": f"collective:{entry[KIND]}",
        "kind": entry[KIND],
        "op": op,
        "root": root,
        "input_sizes": shapes,
        "input_dtypes": dtypes,
        "bytes": nbytes,
        "path": entry[PATH],
        "algorithm": str(entry[ALGORITHM]) if entry[ALGORITHM] else "",
        "state": entry[STATE],
        "time_created_ns": created + offset,
        "time_discovered_started_ns": started + offset if started else None,
        "time_discovered_completed_ns": ended + offset if ended else None,
        "duration_ms": (ended - created) / 1e6 if ended else None,
        "error": entry[ERROR],
        "frames": [frame_of(entry[FRAME])],
    }
    if p2p:
        document["tag"] = entry[GROUP][2]
    return document


def group_name(group: tuple[int, ...], world: tuple[int, ...]) -> str:
    return "world" if group == world else ",".join(map(str, group))


class Stats:
    """Counts and time histograms per (kind, algorithm, size class, group) since the process
    started, tallied from the recorder's entries in batches (``tally``), not call by call: a call
    pays nothing here. Rows are keyed by (group, kind, algorithm, (shape, dtype, parts)) until
    asked (``snapshot``), which works out bytes and size classes; past ROWS distinct keys (shapes
    that change call after call) the rows are folded into their size classes."""

    ROWS = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[tuple[Any, ...], list[Any]] = {}  # key -> [calls, failed, ns, bins, bytes]
        self._folded: dict[tuple[Any, ...], list[Any]] = {}  # (group, kind, algorithm, class) -> row

    def tally(self, entries: Sequence[Sequence[Any]]) -> None:
        """Count ``entries`` (every one ended) in."""
        with self._lock:
            _tally(entries, self._rows)
            if len(self._rows) > self.ROWS:
                for (group, kind, algorithm, sized), row in self._rows.items():
                    nbytes = _nbytes(*sized)
                    key = (group, kind, algorithm, size_class(nbytes))
                    _merge(self._folded.setdefault(key, _row()), row, nbytes)
                self._rows = {}

    def snapshot(
        self, world: tuple[int, ...], ended: Sequence[Sequence[Any]] | None = None
    ) -> list[dict[str, Any]]:
        """Every row, with ``ended`` entries (not tallied yet) counted in too."""
        with self._lock:
            rows = {key: [*row[:3], list(row[3]), row[4]] for key, row in self._rows.items()}
            folded = [(key, [*row[:3], list(row[3]), row[4]]) for key, row in self._folded.items()]
        _tally(ended or [], rows)
        merged: dict[tuple[str, str, str, str], list[Any]] = {}
        for (group, kind, algorithm, sized), row in rows.items():
            nbytes = _nbytes(*sized)
            key = (kind, algorithm, size_class(nbytes), group_name(group, world))
            _merge(merged.setdefault(key, _row()), row, nbytes)
        for (group, kind, algorithm, size), row in folded:
            _merge(merged.setdefault((kind, algorithm, size, group_name(group, world)), _row()), row, 0)
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
            for (kind, algorithm, size, group), (calls, failed, nanoseconds, bins, nbytes) in sorted(
                merged.items()
            )
        ]


_STATIC = operator.itemgetter(GROUP, KIND, SIGNATURE, PATH, ALGORITHM)  # what a call's runs share
_SIZED = operator.attrgetter("shape", "dtype", "parts")  # what a call's bytes are worked out of
_UNSIZED = types.SimpleNamespace(shape=None, dtype=None, parts=())  # (a call that failed unprepared)
_ENDED, _CREATED, _ERROR = (
    operator.itemgetter(ENDED),
    operator.itemgetter(CREATED),
    operator.itemgetter(ERROR),
)
BINS = 64  # histogram bins: bin b counts calls of under 2**b ns (and at least 2**(b-1))


def _row() -> list[Any]:
    return [0, 0, 0, [0] * BINS, 0]


def _tally(entries: Sequence[Sequence[Any]], rows: dict[tuple[Any, ...], list[Any]]) -> None:
    """Add ended ``entries`` to ``rows``. The ring holds runs of entries of one call (a loop's
    calls share their agreed signature, group and path objects), so entries are grouped in runs of
    the same static fields (``groupby`` compares them by identity first, in C) and each run is
    keyed once; durations and histogram bins are counted in numpy (a batch costs a few C passes
    and a Python statement a run, not an entry)."""
    size = len(entries)
    if not size:
        return
    codes_of: dict[tuple[Any, ...], int] = {}  # the identities of a run's static fields -> its code
    keys: list[tuple[Any, ...]] = []  # code -> its row's key
    run_codes: list[int] = []
    lengths: list[int] = []
    for static, run in itertools.groupby(entries, _STATIC):
        group, kind, signature, path, algorithm = static
        identity = (id(group), kind, id(signature), path, id(algorithm))
        code = codes_of.get(identity)
        if code is None:
            code = codes_of[identity] = len(keys)
            sized = _SIZED(_UNSIZED if signature is None else signature)
            keys.append((group, kind, str(algorithm or path or "-"), sized))
        run_codes.append(code)
        lengths.append(len(list(run)))
    codes = np.repeat(np.array(run_codes, np.int64), lengths)
    ended = np.fromiter(map(_ENDED, entries), np.int64, size)
    nanoseconds = np.maximum(ended - np.fromiter(map(_CREATED, entries), np.int64, size), 0)
    bins = np.minimum(np.frexp(nanoseconds.astype(np.float64))[1], BINS - 1)  # (frexp: the bit length)
    count = len(keys)
    calls = np.bincount(codes, minlength=count)
    total = np.bincount(codes, weights=nanoseconds, minlength=count)
    histogram = np.bincount(codes * BINS + bins, minlength=count * BINS).reshape(count, BINS)
    errors = list(map(_ERROR, entries))
    failed = Counter(codes[[error is not None for error in errors]].tolist()) if any(errors) else Counter()
    for code, key in enumerate(keys):
        row = rows.setdefault(key, _row())
        row[0] += int(calls[code])
        row[1] += failed.get(code, 0)
        row[2] += int(total[code])
        row[3] = [a + int(b) for a, b in zip(row[3], histogram[code], strict=True)]


def _merge(into: list[Any], row: list[Any], nbytes: int) -> None:
    """Add ``row`` (calls, failed, ns, bins, bytes moved) of calls of ``nbytes`` each (0: its
    bytes are already counted) to ``into``."""
    into[0] += row[0]
    into[1] += row[1]
    into[2] += row[2]
    into[3] = [a + b for a, b in zip(into[3], row[3], strict=True)]
    into[4] += row[4] + nbytes * row[0]


class Recorder:
    """This process's ring of entries (see the module's docstring).

    An entry is a sequence by the indices above: a tuple once its call ended (appended then, by
    the rendezvous, in one go), a list while open (a send or receive's, in the ring from its start;
    a collective's, made up when dumped by the rendezvous it waits in: ``in_flight``). The ring is
    a list that grows to twice ``size`` entries, when its older half is tallied into ``stats`` and
    dropped (entries still open then are kept aside): one batch every ``size`` calls instead of a
    counter row to move on every call. Dumps hold the newest ``size`` entries.
    """

    def __init__(self, size: int | None = None) -> None:
        if size is None:
            text = os.environ.get(SIZE_VARIABLE, "").strip()
            size = int(text) if text.isdigit() else DEFAULT_SIZE
        self.ring: list[Sequence[Any]] = []
        self._open: list[Sequence[Any]] = []  # entries dropped from the ring while their call was open
        self.size = size
        self.stats = Stats()
        self.job = ""
        self.world: tuple[int, ...] = ()
        self.peers: tuple[int, ...] = ()
        self._groups: weakref.WeakSet[Any] = weakref.WeakSet()  # whatever holds open calls: in_flight()
        self._dumped: dict[tuple[tuple[int, ...], int], str | None] = {}  # by failed step
        self._whereabouts: dict[tuple[tuple[int, ...], int], list[str]] = {}  # by failed step
        self._lock = threading.Lock()
        self._token = 0
        self._p2p: dict[tuple[str, int, int, int], int] = {}  # (kind, src, dst, tag) -> the next number
        # what other processes' peers do (a multi-node job sets it: the orchestrator knows)
        self.remote: Callable[[list[int]], dict[int, str]] | None = None

    @property
    def size(self) -> int:
        """Entries a dump holds (0: the recorder is off)."""
        return self._size

    @size.setter
    def size(self, size: int) -> None:
        self._size = size
        self.enabled = size > 0
        self.limit = 2 * max(size, 1)  # the ring's length that has it folded

    def joined(self, job: str, world: tuple[int, ...], peers: tuple[int, ...], token: int) -> None:
        """Name the job whose calls follow (dumps say which job and which peers they hold); a new
        job (another ``token``) starts an empty ring: its calls are numbered afresh."""
        with self._lock:
            if token != self._token:
                if self.every_job and self._token:
                    self.dump_job("the job ended")
                self._token = token
                self._end_open("the job ended with it open")
                self._fold(len(self.ring))
                self._dumped.clear()
                self._whereabouts.clear()
                self._p2p.clear()
            self.job, self.world, self.peers = job, world, peers

    @property
    def every_job(self) -> bool:
        """Whether each job's calls are dumped as it ends (COLLECTIVE_TRACE_EVERY_JOB=1)."""
        return os.environ.get(EVERY_JOB_VARIABLE, "").strip() == "1"

    def dump_job(self, reason: str) -> str | None:
        """Dump the calls of the job this process is in, to a file of their own in ``trace_dir``
        (for COLLECTIVE_TRACE_EVERY_JOB); the path (None: none recorded, or the write failed)."""
        if not self.enabled or not self.ring:
            return None
        with contextlib.suppress(OSError):
            return self.dump(self._own_path(f"-job{self._token}"), reason)
        return None

    def fresh(self) -> None:
        """Start an empty ring (counted into ``stats``), to be numbered by the next job to come."""
        with self._lock:
            self._end_open("the job ended with it open")
            self._fold(len(self.ring))
            self._token = 0

    def _end_open(self, why: str) -> None:
        """End, as failed for ``why``, the entries still open of the job that ends (a receive
        started and never waited for: none of them can end any more) (lock held)."""
        for entry in itertools.chain(self._open, self.ring):
            if not entry[ENDED] and type(entry) is list:
                entry[ERROR], entry[STATE], entry[ENDED] = why, "failed", CLOCK()

    def watch(self, group: Any) -> None:
        """Read ``group.in_flight()`` (the entries of its open calls) into every dump."""
        self._groups.add(group)

    def record(self, entry: Sequence[Any]) -> None:
        """Put ``entry`` in the ring (a collective's path writes this out: it is every call's)."""
        ring = self.ring
        ring.append(entry)
        if len(ring) >= self.limit:
            self.fold()

    @staticmethod
    def closed(entry: list[Any], error: BaseException | None = None) -> list[Any]:
        """``entry``, ended now (``error``: failed)."""
        if error is not None:
            entry[ERROR] = f"{type(error).__name__}: {error}"
            entry[STATE] = "failed"
        else:
            entry[STATE] = "completed"
        entry[ENDED] = CLOCK()
        return entry

    def open_p2p(self, peer: int, src: int, dst: int, tag: int, kind: str, frame: Where | None) -> list[Any]:
        """An entry for a send or receive of ``peer`` (``src`` -1: from any peer), numbered per
        kind, source, destination and tag (the n-th send of a pair and tag meets the n-th receive),
        in the ring from now: end it with ``closed``."""
        key = (kind, src, dst, tag)
        with self._lock:
            seq = self._p2p.get(key, 0)
            self._p2p[key] = seq + 1
        entry = [
            peer,
            (src, dst, tag),
            seq,
            kind,
            frame,
            None,
            "p2p",
            None,
            "started",
            CLOCK(),
            0,
            0,
            None,
        ]
        self.record(entry)
        return entry

    def fold(self) -> None:
        """Tally the ring's older half into ``stats`` and drop it (a thread at a time: the others
        go on appending)."""
        if self._lock.acquire(blocking=False):
            try:
                self._fold(len(self.ring) - self._size)
            finally:
                self._lock.release()

    def _fold(self, count: int) -> None:
        """Tally the oldest ``count`` entries of the ring and drop them (lock held)."""
        ring = self.ring
        older = ring[:count]
        del ring[:count]  # (other threads only append: the first ``count`` are still these)
        held = self._open + older
        self.stats.tally(list(filter(_ENDED, held)))
        self._open = list(itertools.filterfalse(_ENDED, held))

    def entries(self) -> list[Sequence[Any]]:
        """The entries a dump holds, oldest first: calls still open from long ago, the newest
        ``size`` ended, sends and receives, then every collective still open."""
        ring = self.ring[-self._size :] if self._size > 0 else []
        return [*self._open, *ring, *sorted(self._flying(), key=_CREATED)]

    def _flying(self) -> list[Sequence[Any]]:
        """The entries of the collectives open now, from the groups they wait or run in."""
        return [entry for group in list(self._groups) for entry in group.in_flight()]

    def snapshot(self) -> list[dict[str, Any]]:
        """``stats`` as ``col.stats()`` returns them: every call ended so far counted."""
        with self._lock:
            ended = [entry for entry in (*self._open, *self.ring) if entry[ENDED]]
        return self.stats.snapshot(self.world, ended)

    def document(self, reason: str) -> dict[str, Any]:
        offset = wall_offset()
        return {
            "schema": FORMAT,
            "version": VERSION,
            "reason": reason,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "job": self.job,
            "job_serial": self._token,  # (which of this process's jobs)
            "world": len(self.world),
            "peers": list(self.peers),
            "dumped_ns": time.time_ns(),
            "trace_size": self.size,
            "entries": [as_dict(entry, i, self.world, offset) for i, entry in enumerate(self.entries())],
        }

    def dump(self, path: str | None = None, reason: str = "dump_trace") -> str:
        """Write this process's dump to ``path`` (default: its file in ``trace_dir``); the path."""
        if path is None:
            path = self._own_path()
        text = json.dumps(self.document(reason))
        temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(temporary, "w") as file:
            file.write(text)
        os.replace(temporary, path)
        return path

    def _own_path(self, suffix: str = "") -> str:
        """This process's dump file in ``trace_dir`` (made if missing): peer<first>-<pid><suffix>.json."""
        folder = trace_dir(self.job)
        os.makedirs(folder, exist_ok=True)
        first = min(self.peers) if self.peers else 0
        return os.path.join(folder, f"peer{first}-{os.getpid()}{suffix}.json")

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

    # -- what a peer is doing, for errors that name a missing peer -------------------------------

    def doing(self, peers: Iterable[int]) -> dict[int, str]:
        """What each of ``peers`` held in this process does now, as its own recorder says: the
        call it is in (kind, number, group, state, since when, caller) or its last one."""
        wanted = set(peers) & set(self.peers)
        if not wanted or not self.enabled:
            return {}
        now = CLOCK()
        found: dict[int, str] = {}
        flying = sorted(self._flying(), key=_CREATED, reverse=True)
        for entry in itertools.chain(flying, reversed(self.ring), reversed(self._open)):  # (newest first)
            peer = entry[PEER]
            if peer in wanted and peer not in found:
                found[peer] = activity(entry, self.world, now)
                if len(found) == len(wanted):
                    break
        for peer in wanted - found.keys():
            found[peer] = "has made no call yet"
        return found

    def whereabouts(self, group: tuple[int, ...], seq: int, peers: Iterable[int]) -> list[str]:
        """'peer 3 is in broadcast #7 ... at train.py:90', for each of ``peers`` that can be
        learned: from this process's recorder, else from the process that holds it (``remote``,
        set for a multi-node job: through the orchestrator). Worked out once per failed step."""
        with self._lock:
            known = self._whereabouts.get((group, seq))
        if known is not None:
            return known
        wanted = sorted(set(peers))
        found = self.doing(wanted)
        others = [peer for peer in wanted if peer not in found]
        if others and self.remote is not None:
            with contextlib.suppress(Exception):  # (whatever goes wrong, the error itself comes first)
                heard = self.remote(others)
                found.update((peer, f"{text} (at its node's last heartbeat)") for peer, text in heard.items())
        lines = [f"peer {peer} {found[peer]}" for peer in wanted if peer in found]
        with self._lock:
            if len(self._whereabouts) > 1000:
                self._whereabouts.clear()
            self._whereabouts[(group, seq)] = lines
        return lines


def activity(entry: Sequence[Any], world: tuple[int, ...], now: int) -> str:
    """What ``entry`` says its peer does: 'is in all_reduce #5 of group world (scheduled for 2.1
    s) at train.py:88', or 'is in no call; its last was ...'."""
    frame = frame_of(entry[FRAME])
    at = f"{frame['filename']}:{frame['line']}"
    if entry[PATH] == "p2p":
        src, dst, _ = entry[GROUP]
        what = f"{entry[KIND]} #{entry[SEQ]} from {'any peer' if src < 0 else f'peer {src}'} to peer {dst}"
    else:
        what = f"{entry[KIND]} #{entry[SEQ]} of group {group_name(entry[GROUP], world)}"
    if not entry[ENDED]:
        return f"is in {what} ({entry[STATE]} for {(now - entry[CREATED]) / 1e9:.1f} s) at {at}"
    return (
        f"is in no call; its last was {what} ({entry[STATE]} {(now - entry[ENDED]) / 1e9:.1f} s ago) at {at}"
    )


def trace_dir(job: str) -> str:
    """Where dumps go: COLLECTIVE_TRACE_DIR, else collective-trace-<job> in the temp directory."""
    given = os.environ.get(DIR_VARIABLE, "").strip()
    if given:
        return given
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job) or "default"
    return os.path.join(tempfile.gettempdir(), f"collective-trace-{safe}")
