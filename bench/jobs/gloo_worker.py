"""One rank of a torch.distributed benchmark (started by bench.jobs.multinode.run_gloo; not run by hand).

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
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from collective.bench.harness import Measurement
from collective.bench.sweep import Buffers, Case, row_from

REDUCE = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}
IN_PLACE = ("all_reduce", "reduce", "broadcast", "all_reduce_coalesced")  # gloo overwrites the input


def _function(*names: str) -> Any:
    """The first of ``names`` this torch has (it renamed the tensor collectives)."""
    return next(getattr(dist, name) for name in names if hasattr(dist, name))


def run_op(case: Case, rank: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
    """One iteration of ``case`` with gloo; the flat result (None where this rank gets none)."""
    op, n, root = case.op, case.peers, case.root
    redop = REDUCE[case.redop]
    if op == "all_reduce":
        dist.all_reduce(x, redop)
        return x
    if op == "reduce":
        dist.reduce(x, root, redop)
        return x if rank == root else None
    if op == "broadcast":
        dist.broadcast(x, root)
        return x
    if op == "all_gather":
        _function("all_gather_single", "all_gather_into_tensor")(out, x)
        return out
    if op == "reduce_scatter":
        _function("reduce_scatter_single", "reduce_scatter_tensor")(out, x, redop)
        return out
    if op == "all_to_all":
        dist.all_to_all_single(out, x)
        return out
    if op == "gather":
        dist.gather(x, list(out.view(n, -1)) if rank == root else None, root)
        return out if rank == root else None
    if op == "scatter":
        dist.scatter(out, list(x.view(n, -1)) if rank == root else None, root)
        return out
    if op == "sendrecv":
        sent = dist.isend(x, (rank + 1) % n)
        dist.recv(out, (rank - 1) % n)
        if sent is not None:
            sent.wait()
        return out
    if op == "all_reduce_coalesced":
        pieces = list(torch.tensor_split(x, min(26, max(1, x.numel()))))
        dist.all_reduce_coalesced(pieces, redop)
        return x
    dist.barrier()
    return out


def _tensor(values: np.ndarray) -> Any:
    """A tensor viewing ``values`` (bfloat16 too, which torch.from_numpy does not take)."""
    if values.dtype.name == "bfloat16":
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def _array(tensor: Any, dtype: np.dtype) -> Any:
    """The numpy view of a result (bfloat16 as ``dtype``, ml_dtypes' bfloat16)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(dtype)
    return tensor.numpy()


def measure(rank: int, case: Case, warmup: int, iterations: int) -> Measurement:
    buffers = Buffers(case, rank)
    inputs = [_tensor(x) for x in buffers.inputs]
    work = torch.empty_like(inputs[0])
    out = _tensor(buffers.out)
    times = torch.zeros(iterations, dtype=torch.float64)
    wrong = 0
    for i in range(warmup + iterations):
        x = inputs[i % 2]
        if case.op in IN_PLACE:
            work.copy_(x)
            x = work
        dist.barrier()
        started = time.perf_counter()
        result = run_op(case, rank, x, out)
        if (
            case.redop == "mean"
            and result is not None
            and case.op not in ("broadcast", "all_gather", "gather", "all_to_all", "scatter", "sendrecv")
        ):
            result.div_(case.peers) if result.is_floating_point() else result.floor_divide_(case.peers)
        if i >= warmup:
            times[i - warmup] = time.perf_counter() - started
        wrong += buffers.wrong(None if result is None else _array(result, buffers.out.dtype), i)
    dist.all_reduce(times, dist.ReduceOp.MAX)
    total_wrong = torch.tensor([wrong])
    dist.all_reduce(total_wrong)
    values = times.numpy()
    return Measurement(
        float(np.median(values)) * 1e6, float(values.min()) * 1e6, iterations, int(total_wrong[0])
    )


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as handle:  # (the plan's file)
        plan = json.load(handle)
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
                row = row_from(case, measured)
                print("ROW " + json.dumps(row.as_dict()), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
