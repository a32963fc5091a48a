"""One node of ``collective bench --nodes M`` (started by bench.multinode; not run by hand).

argv[1] is a JSON plan: {"cases": [Case fields], "warmup": W, "iters": N, "timeout": T}. The
job comes from COLLECTIVE_* variables; each strategy runs as its own job (named after it), since
strategies are part of a job's config. Timing: every peer passes a barrier (a 1-element
all_reduce, untimed), times its call, checks its result (untimed); per iteration the slowest
peer's time counts (an all_reduce with max over the time series), and the row is the median.
Node 0's first peer prints one line ``ROW <json>`` per case.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import numpy as np

from collective.algorithms.ops import ReduceOp
from collective.bench.harness import Measurement
from collective.bench.sweep import Case, count_wrong, expected_value, input_value, resolve_dtype, row_from
from collective.config import CollectiveConfig
from collective.launch import peer_ids_from_env
from collective.runtime import Runtime

STRATEGY_FIELDS = ("all_reduce", "reduce", "broadcast")


def measure(runtime: Runtime, peer: int, case: Case, warmup: int, iterations: int) -> Measurement:
    dtype = resolve_dtype(case.dtype)
    count = case.size // dtype.itemsize
    inputs = [np.full(count, input_value(peer, parity), dtype) for parity in (0, 1)]
    expected = [expected_value(case, dtype, parity) for parity in (0, 1)]
    out = np.empty(count, dtype)
    op = ReduceOp.parse(case.redop)
    barrier = np.zeros(1, np.int8)
    times = np.zeros(iterations)
    wrong = 0
    should_have = case.op != "reduce" or peer == case.root
    for i in range(warmup + iterations):
        x = inputs[i % 2]
        runtime.all_reduce(peer, barrier)
        started = time.perf_counter()
        if case.op == "all_reduce":
            result = runtime.all_reduce(peer, x, op, out=out)
        elif case.op == "reduce":
            result = runtime.reduce(peer, x, op, case.root, out=out)
        else:
            result = runtime.broadcast(peer, x if peer == case.root else None, out=out)
        if i >= warmup:
            times[i - warmup] = time.perf_counter() - started
        wrong += count_wrong(result, expected[i % 2], should_have, count)
    slowest = runtime.all_reduce(peer, times, "max")
    total_wrong = int(runtime.all_reduce(peer, np.array([wrong], np.int64))[0])
    return Measurement(float(np.median(slowest)) * 1e6, float(slowest.min()) * 1e6, iterations, total_wrong)


def main() -> int:
    plan = json.loads(sys.argv[1])
    cases = [Case(**fields) for fields in plan["cases"]]
    peers = peer_ids_from_env()
    failures: list[BaseException] = []
    for strategy in dict.fromkeys(case.strategy for case in cases):
        base = CollectiveConfig.from_env()
        strategies: dict[str, Any] = {
            f"{scope}_{kind}_strategy": strategy for scope in ("global", "local") for kind in STRATEGY_FIELDS
        }
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
                        row = row_from(case, case.size // resolve_dtype(case.dtype).itemsize, measured)
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
