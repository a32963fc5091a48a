"""What keeping normal calls costs, and pays: an 8 B all_reduce with ``out``, keeping on and off.

    python -m collective.bench.studies.keeping [--rounds 15] [--calls 5000] [--bytes 8]

One peer alone in a job of this process (no other peer to wait for: what is timed is the call's
own path), a loop of all_reduces two ways: ``same`` (the same ``x`` and ``out`` every call: kept
from its second call, every later one a use) and ``fresh`` (a new ``x`` each call, the same
``out``: never kept, each call noted). Rounds alternate between keeping on and off
(two runtimes of one peer each, one made with ``COLLECTIVE_REPEAT=0``); medians of the per-call
time, us.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from collective.config import CollectiveConfig
from collective.persistent.kept import REPEAT_VARIABLE
from collective.runtime import Runtime

__all__ = ["main", "measure"]


def _runtime(keeping: bool, x: np.ndarray, out: np.ndarray) -> Runtime:
    """A runtime of one peer whose keeping is on or off (COLLECTIVE_REPEAT, read at its first
    keepable call: made here)."""
    saved = os.environ.get(REPEAT_VARIABLE)
    os.environ[REPEAT_VARIABLE] = "1" if keeping else "0"
    try:
        runtime = Runtime()
        runtime.register(0, "cpu", CollectiveConfig(num_devices=1))
        runtime.all_reduce(0, x, out=out)
    finally:
        if saved is None:
            del os.environ[REPEAT_VARIABLE]
        else:
            os.environ[REPEAT_VARIABLE] = saved
    return runtime


def _fresh(runtime: Runtime, count: int, out: np.ndarray) -> object:
    """An all_reduce of a new x."""
    return runtime.all_reduce(0, np.ones(count, np.float32), out=out)


def measure(rounds: int, calls: int, nbytes: int) -> dict[tuple[str, str], float]:
    """Median us per call, by (way, keeping: "on" or "off")."""
    count = max(1, nbytes // 4)
    x, out = np.ones(count, np.float32), np.empty(count, np.float32)
    runtimes = {"on": _runtime(True, x, out), "off": _runtime(False, x, out)}
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(rounds):
            for keeping, runtime in runtimes.items():
                ways: dict[str, Callable[[], object]] = {
                    "same": partial(runtime.all_reduce, 0, x, out=out),
                    "fresh": partial(_fresh, runtime, count, out),
                }
                for way, call in ways.items():
                    for _ in range(min(calls, 100)):  # (warm)
                        call()
                    began = time.perf_counter()
                    for _ in range(calls):
                        call()
                    elapsed = (time.perf_counter() - began) / calls * 1e6
                    times.setdefault((way, keeping), []).append(elapsed)
    finally:
        for runtime in runtimes.values():
            runtime.reset()
    return {key: statistics.median(values) for key, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collective.bench.studies.keeping", description=__doc__)
    parser.add_argument("--rounds", type=int, default=15, help="rounds with keeping on, and as many off")
    parser.add_argument("--calls", type=int, default=5000, help="all_reduces per round and way")
    parser.add_argument("--bytes", type=int, default=8, help="the message size (a multiple of 4; default 8)")
    args = parser.parse_args(argv)
    found = measure(args.rounds, args.calls, args.bytes)
    print(f"# all_reduce of {args.bytes} B with out, one peer: keeping on vs off (medians, us per call)")
    for way in ("same", "fresh"):
        on, off = found[(way, "on")], found[(way, "off")]
        print(f"{way:>6}: on {on:8.2f}  off {off:8.2f}  on - off {on - off:+7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
