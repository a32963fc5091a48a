"""What the flight recorder costs: an all_reduce with the recorder on, off, and off with the least
any recorder adds done by the caller, side by side.

    python -m collective.bench.studies.trace_overhead [--rounds 7] [--calls 2000] [--bytes 8 65536]

Three ways, taking turns round after round in the same peers (medians over the rounds of the
per-call time of ``--calls`` back-to-back all_reduces with ``out=``, the slowest peer's):

* ``off``: COLLECTIVE_TRACE_SIZE=0;
* ``on``: the recorder as it always runs (its entries tallied into ``stats()`` in batches);
* ``least``: the recorder off, and around each call, in the caller's loop, the least that any
  recorder of every call's caller, times and entry does: the caller's frame looked up
  (``trace.caller``), two clock reads, one entry appended to a ring (dropped in batches, never
  tallied). ``least / off`` is the floor of the recorder's overhead in this interpreter: no
  recorder goes under it.

Peers: 4 threads of this process, and 2 processes (one peer each, meeting through an orchestrator;
this module is their worker with ``--worker``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from collective.bench.jobs.multinode import collect_lines
from collective.config import CollectiveConfig
from collective.launch import node_environment, peer_ids_from_env, start_orchestrator, stop_processes
from collective.runtime import Runtime
from collective.trace import CLOCK, RECORDER, caller
from collective.trace.recorder import DEFAULT_SIZE

__all__ = ["WAYS", "main"]

WAYS = ("off", "on", "least")
WAIT = 600.0  # seconds a peer waits for the others at a round's barrier (then BrokenBarrierError)
ON = RECORDER.size or DEFAULT_SIZE  # the ring's size when on (COLLECTIVE_TRACE_SIZE's, else the default)


def _calls(use: Callable[[], Any], calls: int, least: bool, rank: int) -> float:
    """Seconds ``calls`` uses take back to back (``least``: with the least recorder around each)."""
    if not least:
        began = time.perf_counter()
        for _ in range(calls):
            use()
        return time.perf_counter() - began
    ring: list[tuple[Any, ...]] = []  # (the recorder's entries)
    members, kind, path, state = (rank,), "all_reduce", "-", "completed"
    began = time.perf_counter()
    for _ in range(calls):
        origin = caller(1)
        created = CLOCK()
        use()
        done = CLOCK()
        ring.append((rank, members, 0, kind, origin, None, path, None, state, created, created, done, None))
        if len(ring) >= 2 * ON:
            del ring[:ON]
    return time.perf_counter() - began


def _recording(way: str) -> None:
    RECORDER.size = ON if way == "on" else 0


def threads(rounds: int, calls: int, nbytes: int) -> dict[str, float]:
    """Median microseconds per call of each way (4 thread peers)."""
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    size = RECORDER.size
    with Runtime() as runtime:
        config = CollectiveConfig(num_devices=4)
        start, done = threading.Barrier(5, timeout=WAIT), threading.Barrier(5, timeout=WAIT)
        way = ""

        def peer(p: int) -> None:
            runtime.register(p, "cpu", config)
            x = np.ones(nbytes // 4, np.float32)
            out = np.empty_like(x)
            while True:
                start.wait()
                if not way:
                    return
                _calls(lambda: runtime.all_reduce(p, x, out=out), calls, way == "least", p)
                done.wait()

        workers = [threading.Thread(target=peer, args=(p,)) for p in range(4)]
        for worker in workers:
            worker.start()
        try:
            for index in range(rounds * len(WAYS)):
                way = WAYS[index % len(WAYS)]
                _recording(way)
                began = time.perf_counter()
                start.wait()
                done.wait()
                times[way].append((time.perf_counter() - began) / calls * 1e6)
        finally:
            way = ""
            start.wait()
            for worker in workers:
                worker.join()
            RECORDER.size = size
    return {way: statistics.median(values) for way, values in times.items()}


def processes(rounds: int, calls: int, nbytes: int) -> dict[str, float]:
    """Median microseconds per call of each way (2 processes of one peer each)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    orchestrator, address = start_orchestrator()
    workers: list[subprocess.Popen[str]] = []
    try:
        argv = [sys.executable, "-m", "collective.bench.studies.trace_overhead"]
        argv += ["--worker", "--rounds", str(rounds), "--calls", str(calls), "--bytes", str(nbytes)]
        for rank in range(2):
            environment = node_environment(address, f"trace-overhead-{os.getpid()}", rank, 2, 1, env)
            workers.append(
                subprocess.Popen(
                    argv, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        lines = collect_lines(workers, "trace_overhead worker", 600)
    finally:
        stop_processes([*workers, orchestrator])
    medians = next((line for line in lines if line.startswith("{")), None)
    if medians is None:
        raise RuntimeError(f"trace_overhead: the first worker printed no medians: {lines[-5:]}")
    found: dict[str, float] = json.loads(medians)
    return found


def worker(rounds: int, calls: int, nbytes: int) -> int:
    """One process of ``processes``: every way in turn; rank 0 prints the medians as JSON."""
    runtime = Runtime()
    (peer,) = peer_ids_from_env()
    runtime.register(peer, "cpu", CollectiveConfig.from_env())
    x = np.ones(nbytes // 4, np.float32)
    out = np.empty_like(x)

    def use() -> Any:
        return runtime.all_reduce(peer, x, out=out)

    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for index in range(rounds * len(WAYS)):
        way = WAYS[index % len(WAYS)]
        _recording(way)
        _calls(use, 20, way == "least", peer)  # (the way's first calls: kept, their lane found)
        runtime.barrier(peer)
        seconds = _calls(use, calls, way == "least", peer)
        slowest = runtime.all_reduce(peer, np.array([seconds]), "max")
        times[way].append(float(slowest[0]) / calls * 1e6)
    runtime.finish(peer)
    if peer == 0:
        print(json.dumps({way: statistics.median(values) for way, values in times.items()}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m collective.bench.studies.trace_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=7, help="rounds of each way, taking turns")
    parser.add_argument("--calls", type=int, default=2000, help="all_reduces per round")
    parser.add_argument(
        "--bytes", type=int, nargs="+", default=[8], help="message sizes (multiples of 4; default 8)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.rounds, args.calls, args.bytes[0])
    print("# all_reduce back to back, out=: the recorder on, off, and off + the least (medians, us per call)")
    for nbytes in args.bytes:
        for name, measure in (("4 threads", threads), ("2 processes", processes)):
            found = measure(args.rounds, args.calls, nbytes)
            print(
                f"{nbytes:>8} B {name:>12}: on {found['on']:8.2f}  off {found['off']:8.2f}  "
                f"least {found['least']:8.2f}  on/off {found['on'] / found['off']:.3f}  "
                f"least/off {found['least'] / found['off']:.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
