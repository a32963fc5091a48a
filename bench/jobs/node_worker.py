"""One node of ``collective bench --nodes M`` (started by bench.jobs.multinode; not run by hand).

argv[1] is the path of a JSON plan: {"cases": [Case fields], "warmup": W, "iters": N, "timeout": T}. The
job comes from COLLECTIVE_* variables; each strategy runs as its own job (named after it), since
strategies are part of a job's config. Timing: every peer passes a barrier (``runtime.barrier``,
untimed: a kept call, as the call timed is; a new 1-element all_reduce each time, a general step,
left the timed call to run with the caches it had emptied: 11.9 us against 6.4, 2 processes,
8 B), times its call, checks its result (untimed); per iteration the slowest peer's time counts
(an all_reduce with max over the time series), and the row is the median.
Node 0's first peer prints one line ``ROW <json>`` per case.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np

from collective.bench.harness import Measurement
from collective.bench.sweep import Case, measure_peer, picked_by_auto, row_from, strategy_fields
from collective.config import CollectiveConfig
from collective.launch import peer_ids_from_env
from collective.runtime import Runtime


def measure(runtime: Runtime, peer: int, case: Case, warmup: int, iterations: int) -> Measurement:
    call, buffers = measure_peer(runtime, case, peer)
    times = np.zeros(iterations)
    wrong = 0
    for i in range(warmup + iterations):
        x = buffers.inputs[i % 2]
        runtime.barrier(peer)
        started = time.perf_counter()
        result = call(x, buffers.out)
        if i >= warmup:
            times[i - warmup] = time.perf_counter() - started
        wrong += buffers.wrong(result, i)
    slowest = runtime.all_reduce(peer, times, "max")
    total_wrong = int(runtime.all_reduce(peer, np.array([wrong], np.int64))[0])
    return Measurement(float(np.median(slowest)) * 1e6, float(slowest.min()) * 1e6, iterations, total_wrong)


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as handle:  # (the plan's file)
        plan = json.load(handle)
    cases = [Case(**fields) for fields in plan["cases"]]
    peers = peer_ids_from_env()
    failures: list[BaseException] = []
    for strategy in dict.fromkeys(case.strategy for case in cases):
        base = CollectiveConfig.from_env()
        strategies: dict[str, Any] = strategy_fields(strategy, ("global", "local"))
        config = CollectiveConfig.from_env(
            None, job=f"{base.job}-{strategy}", timeout=plan["timeout"], **strategies
        )
        runtime = Runtime()

        def run(
            peer: int, runtime: Runtime = runtime, config: CollectiveConfig = config, strategy: str = strategy
        ) -> None:
            try:
                runtime.register(peer, "cpu", config)
                for case in (c for c in cases if c.strategy == strategy):
                    measured = measure(runtime, peer, case, plan["warmup"], plan["iters"])
                    if peer == 0:
                        row = row_from(case, measured)
                        if strategy == "auto":
                            picked, figures = picked_by_auto(runtime, case)
                            row = replace(row, picked=picked, figures=figures)
                        print("ROW " + json.dumps(row.as_dict()), flush=True)
                runtime.finish(peer)
            except BaseException as exc:
                failures.append(exc)
                print(f"bench node: peer {peer} failed: {exc!r}", file=sys.stderr, flush=True)

        threads = [threading.Thread(target=run, args=(p,)) for p in peers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        runtime.close()
        if failures:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
