"""The flight recorder (collective.trace.recorder), its dumps, and what reads them.

* ``RECORDER``: this process's recorder; every collective of its peers is recorded in it
  (collective.executors.rendezvous), and it dumps itself when a collective fails with
  CollectiveTimeout, PeerLostError or MismatchError, on SIGUSR1 and on ``dump_trace``;
* ``analyze``: ``collective trace analyze DIR`` merges every process's dump and names the culprit;
* ``chrome``: ``collective trace chrome DIR`` writes a Chrome trace (Perfetto) of the dumps.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import threading
from typing import Any

from collective.trace.recorder import (
    ALGORITHM,
    CLOCK,
    ENDED,
    PATH,
    SEQ,
    SIGNATURE,
    STARTED,
    STATE,
    Entry,
    Recorder,
    caller,
    run_for,
)

__all__ = [
    "ALGORITHM",
    "CLOCK",
    "ENDED",
    "PATH",
    "RECORDER",
    "SEQ",
    "SIGNATURE",
    "STARTED",
    "STATE",
    "Entry",
    "Recorder",
    "caller",
    "run_for",
    "dump_trace",
    "install_signal",
    "stats",
]

RECORDER = Recorder()
_installed = False
_at_exit: list[Any] = []


def dump_trace(path: str | None = None) -> str:
    """Write this process's flight recorder to ``path`` (default: its file in COLLECTIVE_TRACE_DIR,
    or collective-trace-<job> in the temp directory); returns the path written."""
    return RECORDER.dump(path, reason="dump_trace")


def stats() -> list[dict[str, Any]]:
    """Every (kind, algorithm, size class, group) this process's peers called: calls, failures,
    seconds, bytes and a histogram of call times (seconds, upper bounds), since the process started."""
    return RECORDER.snapshot()


def install_signal() -> None:
    """Dump on SIGUSR1 (once per process, from the main thread, where no handler is set), and at
    exit where COLLECTIVE_TRACE_EVERY_JOB=1 asks for every job's calls."""
    global _installed
    if RECORDER.every_job and not _at_exit:
        _at_exit.append(atexit.register(RECORDER.dump_job, "exit"))
    if (
        _installed
        or threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "SIGUSR1")
    ):
        return
    _installed = True
    if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGUSR1, lambda signum, frame: _dump_quietly("SIGUSR1"))


def _dump_quietly(reason: str) -> None:
    with contextlib.suppress(OSError):  # (a signal handler: nowhere to report to)
        RECORDER.dump(reason=reason)
