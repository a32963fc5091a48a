"""What the flight recorder costs: an all_reduce with the recorder on and off, side by side.

    python -m collective.bench.studies.trace_overhead [--rounds 7] [--calls 2000] [--bytes 8 65536]

Threads: 4 peers of one process, rounds of ``--calls`` all_reduces each, the recorder switched on
and off between rounds (medians of the per-call time). Processes: ``collective bench --nodes 2
--peers 1`` runs, alternately with COLLECTIVE_TRACE_SIZE=0 and unset (medians of their medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from collective.config import CollectiveConfig
from collective.runtime import Runtime
from collective.trace import RECORDER

__all__ = ["main"]


def threads(rounds: int, calls: int, nbytes: int) -> dict[str, float]:
    """Median microseconds per call with the recorder on and off (4 thread peers)."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    size = RECORDER.size or 2000
    with Runtime() as runtime:
        config = CollectiveConfig(num_devices=4)
        start, done = threading.Barrier(5), threading.Barrier(5)
        stop = False

        def peer(p: int) -> None:
            runtime.register(p, "cpu", config)
            x = np.ones(nbytes // 4, np.float32)
            out = np.empty_like(x)
            while True:
                start.wait()
                if stop:
                    return
                for _ in range(calls):
                    runtime.all_reduce(p, x, out=out)
                done.wait()

        workers = [threading.Thread(target=peer, args=(p,)) for p in range(4)]
        for worker in workers:
            worker.start()
        for index in range(2 * rounds):
            state = ("on", "off")[index % 2]
            RECORDER.size = size if state == "on" else 0
            began = time.perf_counter()
            start.wait()
            done.wait()
            times[state].append((time.perf_counter() - began) / calls * 1e6)
        stop = True
        start.wait()
        for worker in workers:
            worker.join()
    RECORDER.size = size
    return {state: statistics.median(values) for state, values in times.items()}


def processes(rounds: int, calls: int, nbytes: int) -> dict[str, float]:
    """Median microseconds per call with the recorder on and off (2 processes, `collective bench`)."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    for index in range(2 * rounds):
        state = ("on", "off")[index % 2]
        env = {k: v for k, v in os.environ.items() if k != "COLLECTIVE_TRACE_SIZE"}
        if state == "off":
            env["COLLECTIVE_TRACE_SIZE"] = "0"
        with tempfile.TemporaryDirectory() as folder:
            record = os.path.join(folder, "rows.json")
            argv = [
                "--nodes",
                "2",
                "--peers",
                "1",
                "--op",
                "all_reduce",
                "-b",
                str(nbytes),
                "-e",
                str(nbytes),
                "--strategy",
                "auto",
            ]
            command = [
                sys.executable,
                "-m",
                "collective",
                "bench",
                *argv,
                "-w",
                "100",
                "-n",
                str(calls),
                "--json",
                record,
            ]
            subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
            with open(record, encoding="utf-8") as file:
                times[state].append(json.load(file)["rows"][0]["time_us"])
    return {state: statistics.median(values) for state, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m collective.bench.studies.trace_overhead", description=__doc__
    )
    parser.add_argument("--rounds", type=int, default=7, help="rounds with the recorder on, and as many off")
    parser.add_argument("--calls", type=int, default=2000, help="all_reduces per round")
    parser.add_argument(
        "--bytes", type=int, nargs="+", default=[8], help="message sizes (multiples of 4; default 8)"
    )
    args = parser.parse_args(argv)
    print("# all_reduce, recorder on vs off (medians, us per call)")
    for nbytes in args.bytes:
        for name, measure in (("4 threads", threads), ("2 processes", processes)):
            found = measure(args.rounds, args.calls, nbytes)
            ratio = found["on"] / found["off"]
            print(
                f"{nbytes:>8} B {name:>12}: on {found['on']:8.2f}  off {found['off']:8.2f}  "
                f"on/off {ratio:.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
