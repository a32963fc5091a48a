"""One process of a multi-process job running the conformance matrix (tests/matrix.py).

Usage: python tests/matrix_worker.py PROFILE   (the job comes from COLLECTIVE_* variables, as
tests/processes.py ``node_env`` sets them; PROFILE names the table in ``matrix.PROFILES``)

Every local peer (a thread each when COLLECTIVE_NUM_DEVICES > 1) registers, runs the whole table
with ``matrix.run_table`` through the module API and finishes. Output, once every peer is done:

    MATRIX <cases checked> <failures>       (summed over this process's peers)
    FAIL <case label>: <what differed>      (one per failure)
    PATH <path> <steps>                     (steps this process ran on each executor path)
    GROUP <members> <path> <steps>          (the same per group, members comma-separated)
    UNREAD <message>                        (an executors' log record in another format)
    ERROR <class> <message>                 (a peer raised: a CollectiveError, a hang's timeout)

Exit status 0 when every case matched and nothing raised, 1 otherwise.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.matrix, run as a script

import collective as col
from tests import matrix

JOIN_TIMEOUT = 100.0  # every collective has its own (COLLECTIVE_TIMEOUT); this bounds the whole run
_print_lock = threading.Lock()


def say(line: str) -> None:
    """One whole line on stdout, never interleaved with another thread's."""
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def main() -> int:
    """Run the table on every local peer; report; the exit status."""
    profile = sys.argv[1]
    config = col.CollectiveConfig.from_env()
    peers = col.peer_ids_from_env()
    world = config.num_devices * (config.num_nodes or 1)
    cases = matrix.build_cases(world, **matrix.PROFILES[profile])
    outcomes: dict[int, matrix.Failures | BaseException] = {}

    def run(peer: int) -> None:
        try:
            col.register(peer, "cpu", config)
            try:
                outcomes[peer] = matrix.run_table(col, peer, world, cases)
            finally:
                col.finish(peer)
        except BaseException as exc:
            outcomes[peer] = exc
            say(f"ERROR {type(exc).__name__} peer {peer}: {exc}")
            say("".join(traceback.format_exception(exc)).rstrip())

    counter = matrix.PathCounter()
    with counter.attached():
        threads = [threading.Thread(target=run, args=(peer,), name=f"peer-{peer}") for peer in peers]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + JOIN_TIMEOUT
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [peer for peer, thread in zip(peers, threads, strict=True) if thread.is_alive()]
    if stuck:
        say(f"ERROR Hang peers {stuck} still running after {JOIN_TIMEOUT:g}s")
    failures = [f for outcome in outcomes.values() if isinstance(outcome, list) for f in outcome]
    checked = sum(o.checked for o in outcomes.values() if isinstance(o, matrix.Failures))
    say(f"MATRIX {checked} {len(failures)}")
    for failure in failures:
        say(f"FAIL {failure}")
    for path, steps in sorted(counter.paths().items()):
        say(f"PATH {path} {steps}")
    for (members, path), steps in sorted(counter.routes.items()):
        say(f"GROUP {','.join(map(str, members))} {path} {steps}")
    for message in counter.unread:
        say(f"UNREAD {message}")
    sys.stdout.flush()
    raised = any(isinstance(outcome, BaseException) for outcome in outcomes.values())
    return 1 if failures or raised or stuck or len(outcomes) != len(peers) else 0


if __name__ == "__main__":
    code = main()
    if code:  # (a stuck peer thread must not keep the process alive)
        os._exit(code)
    sys.exit(code)
