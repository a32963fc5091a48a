"""Shared-memory rings between the processes of one host: segments, progress words and waiting.

Every process of a job creates one *ring segment* in /dev/shm and maps the segments of the other
processes on its host read-only; a process writes only to its own segment, so no word has two
writers. A segment holds a header and CHANNELS channels::

    header   the segment's (magic, pid, start time, size), state, bell (futex word), sleepers,
             channel directory
    channel  progress (one int64 the owner raises), an abort ring (the owner's reasons for giving
             up a step), two slots (double-buffered: a header message plus up to INLINE_BYTES of
             data) and two chunk buffers of CHUNK_BYTES (double-buffered large data)

The directory maps a 64-bit key (a group of the job) to a channel; the owner assigns channels, the
others look them up. A waiter reads another process's progress word: it spins briefly, then
yields, then blocks on the owner's *bell*, a futex word the owner bumps after every change (and
wakes when some reader sleeps), and checks ``watch`` (liveness, aborts) periodically while
blocked. A lost wake-up (possible: there is no store-load fence between the poster's progress
store and its read of the sleepers word) costs at most MAX_SLEEP.

A ring segment is a transport.shm_segment Segment: named, created, validated before it is mapped,
and removed (when closed, at exit, or by the next process once its creator is gone) as every
segment of this library is. Relies on x86-64 store ordering (a reader that sees a progress value
sees the data written before it).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from collective.transport.shm_segment import Segment

__all__ = [
    "CHANNELS",
    "CHUNK_BYTES",
    "INLINE_BYTES",
    "MESSAGE_BYTES",
    "SIZE",
    "RingSegment",
    "Waiting",
    "futex_wake",
]

CHANNELS = 8
CHUNK_BYTES = 1 << 20
INLINE_BYTES = 64 << 10
MESSAGE_BYTES = 16 << 10  # a slot's header message (the caller's encoding)
ABORTS = 8  # abort records kept per channel
_RECORD = 512  # bytes per abort record: seq (int64), length (int64), text
_FIRST = 4096  # the channels start a page in, after the header
_CONTROL = 64 + ABORTS * _RECORD
_SLOT_HEAD = 64
_SLOT = _SLOT_HEAD + MESSAGE_BYTES + INLINE_BYTES
_CHANNEL = _CONTROL + 2 * _SLOT + 2 * CHUNK_BYTES
SIZE = _FIRST + CHANNELS * _CHANNEL
# header fields after the segment's own (byte offsets). The sleepers count has a cache line of its
# own: every post reads the other members' counts, which would otherwise share a line with their
# bells, which they write at every post (each read a miss between cores).
_STATE, _BELL, _KEYS, _SLEEPERS = 32, 40, 64, 192

MAX_SLEEP = 0.01  # a blocked waiter looks again at least this often
_GAVE_AWAY = 20e-6  # a yield that took this long gave the CPU to somebody
_PATIENCE = 2e-3  # yields go on this long while they come straight back (nobody else wants the CPU)
WATCH_EVERY = 0.1  # and calls ``watch`` this often


class _Futex:
    """futex(2) through libc's syscall(); ``None`` where it is not available (then waiters poll)."""

    def __init__(self) -> None:
        number = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)
        libc = ctypes.CDLL(None, use_errno=True) if number is not None else None
        self.call = getattr(libc, "syscall", None)
        self.number = number
        if self.call is not None:
            self.call.restype = ctypes.c_long

    def wait(self, address: int, value: int, seconds: float) -> None:
        if self.call is None:
            time.sleep(min(seconds, 0.001))
            return
        whole = int(seconds)
        spec = (ctypes.c_long * 2)(whole, int((seconds - whole) * 1e9))
        self.call(self.number, ctypes.c_void_p(address), 0, ctypes.c_int(value), spec, None, 0)

    def wake(self, address: int) -> None:
        if self.call is not None:
            self.call(self.number, ctypes.c_void_p(address), 1, ctypes.c_int(0x7FFFFFFF), None, None, 0)


_FUTEX = _Futex()


def futex_wake(address: int) -> None:
    _FUTEX.wake(address)


class Channel:
    """Views of one channel of a segment (writable in its owner's process only)."""

    __slots__ = ("buffers", "data", "heads", "messages", "progress", "records", "slot_heads", "slots")

    def __init__(self, memory: Any, base: int) -> None:
        view = memoryview(memory)
        self.progress = view[base : base + 8].cast("q")
        self.records = [view[base + 64 + i * _RECORD : base + 64 + (i + 1) * _RECORD] for i in range(ABORTS)]
        self.heads = [record[:16].cast("q") for record in self.records]  # (seq, text length) each
        heads = [base + _CONTROL + i * _SLOT for i in (0, 1)]
        self.slot_heads = [view[h : h + _SLOT_HEAD].cast("q") for h in heads]
        self.messages = [view[h + _SLOT_HEAD : h + _SLOT_HEAD + MESSAGE_BYTES] for h in heads]
        data = [h + _SLOT_HEAD + MESSAGE_BYTES for h in heads]
        self.slots = [np.frombuffer(memory, np.uint8, INLINE_BYTES, d) for d in data]
        self.data = [view[d : d + INLINE_BYTES] for d in data]  # the same bytes as memoryviews
        first = base + _CONTROL + 2 * _SLOT
        self.buffers = [np.frombuffer(memory, np.uint8, CHUNK_BYTES, first + i * CHUNK_BYTES) for i in (0, 1)]

    def record(self, seq: int) -> str | None:
        """The owner's reason for giving up step ``seq``, if it recorded one."""
        for record, head in zip(self.records, self.heads, strict=True):
            if head[0] == seq:
                return bytes(record[16 : 16 + min(head[1], _RECORD - 16)]).decode(errors="replace")
        return None

    def write_record(self, seq: int, text: str) -> None:
        """Record why step ``seq`` was given up (oldest record replaced), before the progress says so."""
        heads = self.heads
        oldest = min(range(ABORTS), key=lambda i: heads[i][0])
        data = text.encode()[: _RECORD - 16]
        self.records[oldest][16 : 16 + len(data)] = data
        heads[oldest][1] = len(data)
        heads[oldest][0] = seq


class RingSegment(Segment):
    """One process's ring segment: its own (``create``, writable) or another's (``attach``, read-only)."""

    MAGIC = b"COLRING2"
    SIZE = SIZE
    KIND = "ring"

    def __init__(self, path: str, memory: Any, owner: bool) -> None:
        super().__init__(path, memory, owner)
        view = memoryview(memory)
        self.words = view[:_KEYS].cast("q")
        self.bell = view[_BELL : _BELL + 4].cast("i")
        self.sleepers = view[_SLEEPERS : _SLEEPERS + 4].cast("i")
        self.keys = view[_KEYS : _KEYS + 8 * CHANNELS].cast("Q")
        self.bell_address = int(np.frombuffer(memory, np.int32, 1, _BELL).ctypes.data)
        self.channels = [Channel(memory, _FIRST + i * _CHANNEL) for i in range(CHANNELS)]

    # -- state --------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return bool(self.words[_STATE // 8])

    def wake(self) -> None:
        """Wake every process blocked on this segment's bell."""
        _FUTEX.wake(self.bell_address)

    def bump(self) -> None:
        """Ring the bell: another word of this segment changed (owner only). Lock-free: two threads
        of the owner that bump at once may count one bump, which still changes the bell from what
        a sleeper read before either one's word changed (each writes its word before reading the
        bell), so that sleeper's futex wait returns: all a bump is for."""
        bell = self.bell
        bell[0] = (bell[0] + 1) & 0x7FFFFFFF

    # -- the channel directory ----------------------------------------------------------------

    def find(self, key: int) -> int | None:
        """The channel the owner gave ``key`` (None if none yet)."""
        for index in range(CHANNELS):
            if self.keys[index] == key:
                return index
        return None

    def assign(self, key: int, index: int, progress: int, record: tuple[int, str] | None = None) -> Channel:
        """Give channel ``index`` to ``key`` with its progress at ``progress`` and, if given, the
        record of why a step was given up (owner only). Nothing of the channel's last user stays
        readable: its records and its slots' heads are cleared."""
        channel = self.channels[index]
        self.keys[index] = 0
        for head in (*channel.heads, *channel.slot_heads):
            head[0] = -1
        if record is not None:
            channel.write_record(*record)
        channel.progress[0] = progress
        self.keys[index] = key  # last: readers that find the key see the channel ready
        return channel

    def close(self) -> None:
        """Mark the segment closed (readers see this process left) and unlink it (owner only). It
        stays mapped: this process's channels may still be read."""
        if self.owner:
            self.words[_STATE // 8] = 1
            self.bump()
            self.wake()
            self.unlink()


class Waiting:
    """How long a waiter spins, then yields, before it blocks: adapted to where its peers run.

    Spinning is best while the peers have CPUs of their own (a post is seen within a microsecond,
    and a spinner keeps its CPU when other programs compete for it), and worst when the scheduler
    puts a peer on the spinner's CPU (it does, now and then, even with a CPU free): the peer runs
    only once the spin ends (measured: 50 us of spin, 220 us per small collective). So the spin
    budget adapts: a wait that ends while spinning doubles it (up to ``most``); one that ends just
    after a yield that gave the CPU away (the yield took a while: somebody else ran) divides it by
    four (down to ``least``). A blocked waiter costs a wake-up (about 100 us on this VM), so it
    blocks only after the yields: 200 us of them, or up to 2 ms while each comes straight back
    (nobody else wants the CPU: yielding costs nobody anything, and the waiter sees the post at once).
    Oversubscribed hosts (more of the job's processes than CPUs) spin at most a microsecond or two.
    ``COLLECTIVE_SHM_SPIN_US`` (the most) and ``COLLECTIVE_SHM_YIELD_US`` override the defaults.
    """

    def __init__(self, processes: int, mine: RingSegment) -> None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        crowded = self.crowded = processes > cpus
        self.most = float(os.environ.get("COLLECTIVE_SHM_SPIN_US", 2 if crowded else 100)) * 1e-6
        self.least = min(self.most, 1e-6)
        self.spin = self.most
        self.yields = float(os.environ.get("COLLECTIVE_SHM_YIELD_US", 50 if crowded else 200)) * 1e-6
        self.mine = mine
        self._lock = threading.Lock()

    def until(
        self, word: Any, target: int, owner: RingSegment, deadline: float, watch: Callable[[], None]
    ) -> bool:
        """Wait until ``word[0] >= target`` (True) or the deadline (False); ``watch`` may raise."""
        if word[0] >= target:
            return True
        now = time.monotonic()
        stop = now + self.spin
        while now < stop:
            for _ in range(32):
                if word[0] >= target:
                    self.spin = min(self.most, 2 * self.spin)
                    return True
            now = time.monotonic()
        crowded = self.crowded
        stop, patience = now + self.yields, now + _PATIENCE
        while now < stop or (now < patience and not crowded):
            before = now
            os.sched_yield()
            now = time.monotonic()
            if word[0] >= target:
                if now - before > _GAVE_AWAY:  # the CPU went to somebody, and then the post came
                    self.spin = max(self.least, self.spin / 4)
                return True
            if now - before > _GAVE_AWAY:
                crowded = True  # somebody wants this CPU: block once the short yield phase is over
        return self._block(lambda: bool(word[0] >= target), owner, deadline, watch, now)

    def ready(
        self, check: Callable[[], bool], owner: RingSegment, deadline: float, watch: Callable[[], None]
    ) -> bool:
        """Wait until ``check()`` (True) or the deadline (False), ``owner``'s bell ringing on changes."""
        now = time.monotonic()
        stop = now + self.spin + self.yields
        while now < stop:
            if check():
                return True
            os.sched_yield()
            now = time.monotonic()
        return self._block(check, owner, deadline, watch, now)

    def _block(
        self,
        check: Callable[[], bool],
        owner: RingSegment,
        deadline: float,
        watch: Callable[[], None],
        now: float,
    ) -> bool:
        sleepers = self.mine.sleepers
        watched = -WATCH_EVERY
        while True:
            if now - watched >= WATCH_EVERY:
                watch()
                watched = now
            if now >= deadline:
                return check()
            bell = owner.bell[0]
            with self._lock:
                sleepers[0] += 1
            try:
                if check():
                    return True
                _FUTEX.wait(owner.bell_address, bell, min(deadline - now, MAX_SLEEP, WATCH_EVERY))
            finally:
                with self._lock:
                    sleepers[0] -= 1
            if check():
                return True
            now = time.monotonic()
