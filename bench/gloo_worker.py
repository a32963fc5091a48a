"""One rank of a torch.distributed benchmark (started by bench.multinode.run_gloo; not run by hand).

The plan's ``backend`` is ``gloo`` (the ``--compare gloo`` baseline) or ``collective`` (our
backend through torch.distributed, ``--backend torch``): the same code times both. The same
cases and the same method as our node benchmark: a barrier (untimed), the timed collective, a
result check (untimed); the slowest rank's time per iteration; the median. torch's collectives
work in place, so each iteration first copies the input into the buffer (untimed). gloo has no
mean: it is a sum followed by the division, both timed (for both backends).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from collective.bench.harness import Measurement
from collective.bench.sweep import Case, count_wrong, expected_value, input_value, resolve_dtype, row_from

OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
       "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}  # fmt: skip


def measure(rank: int, case: Case, warmup: int, iterations: int) -> Measurement:
    dtype = resolve_dtype(case.dtype)
    count = case.size // dtype.itemsize
    torch_dtype = getattr(torch, case.dtype)
    inputs = [torch.full((count,), input_value(rank, parity), dtype=torch_dtype) for parity in (0, 1)]
    expected = [expected_value(case, dtype, parity) for parity in (0, 1)]
    buffer = torch.empty(count, dtype=torch_dtype)
    times = torch.zeros(iterations, dtype=torch.float64)
    wrong = 0
    should_have = case.op != "reduce" or rank == case.root
    for i in range(warmup + iterations):
        buffer.copy_(inputs[i % 2])
        dist.barrier()
        started = time.perf_counter()
        if case.op == "all_reduce":
            dist.all_reduce(buffer, OPS[case.redop])
        elif case.op == "reduce":
            dist.reduce(buffer, case.root, OPS[case.redop])
        else:
            dist.broadcast(buffer, case.root)
        if case.redop == "mean" and case.op != "broadcast" and should_have:
            buffer.div_(case.peers) if dtype.kind == "f" else buffer.floor_divide_(case.peers)
        if i >= warmup:
            times[i - warmup] = time.perf_counter() - started
        result = buffer.numpy() if should_have else None
        wrong += count_wrong(result, expected[i % 2], should_have, count)
    dist.all_reduce(times, dist.ReduceOp.MAX)
    total_wrong = torch.tensor([wrong])
    dist.all_reduce(total_wrong)
    values = times.numpy()
    return Measurement(
        float(np.median(values)) * 1e6, float(values.min()) * 1e6, iterations, int(total_wrong[0])
    )


def main() -> int:
    plan = json.loads(sys.argv[1])
    backend = plan.get("backend", "gloo")
    system = "gloo" if backend == "gloo" else "torch"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if backend == "collective":
        import collective.torch  # noqa: F401  registers the backend

    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=plan["timeout"]))
    try:
        for fields in plan["cases"]:
            case = Case(**{**fields, "system": system, "strategy": system, "peers": world})
            measured = measure(rank, case, plan["warmup"], plan["iters"])
            if rank == 0:
                row = row_from(case, case.size // resolve_dtype(case.dtype).itemsize, measured)
                print("ROW " + json.dumps(row.as_dict()), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
