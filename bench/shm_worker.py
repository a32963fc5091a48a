"""One rank of ``python -m collective.bench.shm_vs_gloo`` (started by it; not run by hand).

argv: SYSTEM PLAN, SYSTEM one of ours (a one-peer node of a job from COLLECTIVE_* variables; anew and
persistent: ours with calls made anew, or with persistent handles), gloo (torch.distributed from
RANK/WORLD_SIZE/MASTER_*), mpi (mpi4py under mpirun); PLAN is JSON
{"cases": [[op, size], ...], "budget": seconds, "warmup": n}. The same method for every system:
each iteration all ranks pass the system's barrier (untimed), each times its call, the slowest
rank's time counts; the row is the median (and the minimum) over the iterations. ``size`` follows
nccl-tests: bytes of the input per rank for all_reduce and broadcast, of the gathered output for
all_gather, of the input for reduce_scatter (each rank gets size / world). float32, sum, root 0;
results are checked once before timing. Rank 0 prints ``ROW <json>`` per case.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

Step = Callable[[], Any]


class System:
    """A system's collectives on float32 numpy buffers, plus its barrier and a max over ranks."""

    rank: int
    world: int

    def make(self, op: str, x: np.ndarray, out: np.ndarray) -> Step:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def max(self, values: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def checked(self, op: str, out: np.ndarray) -> None:
        """The results were checked; timing starts."""

    def close(self) -> None:
        """Leave the job."""


class Ours(System):
    def __init__(self) -> None:
        import collective as col

        self.col = col
        (self.peer,) = col.peer_ids_from_env()
        col.register(self.peer, "cpu", col.CollectiveConfig.from_env())
        self.rank, self.world = self.peer, col.world_size()

    def make(self, op: str, x: np.ndarray, out: np.ndarray) -> Step:
        col, peer = self.col, self.peer
        if op == "all_reduce":
            return lambda: col.all_reduce(peer, x, out=out)
        if op == "all_gather":
            gathered = out.reshape(self.world, -1)  # (one view: the same out each call, as a loop holds it)
            return lambda: col.all_gather(peer, x, out=gathered)
        if op == "reduce_scatter":
            return lambda: col.reduce_scatter(peer, x, out=out)
        root = peer == 0  # the root broadcasts from x in place, as gloo and MPI do
        return lambda: col.broadcast(peer, x if root else None, out=x if root else out)

    def barrier(self) -> None:
        self.col.barrier(self.peer)

    def max(self, values: np.ndarray) -> np.ndarray:
        result: np.ndarray = self.col.all_reduce(self.peer, values, "max")
        return result

    def close(self) -> None:
        self.col.finish(self.peer)


class Anew(Ours):
    """Ours with every call made anew (COLLECTIVE_REPEAT=0: a call that comes again on the same
    arrays is not kept), each call checked and agreed as the first one is."""

    def __init__(self) -> None:
        from collective.persistent.kept import REPEAT_VARIABLE

        os.environ[REPEAT_VARIABLE] = "0"
        super().__init__()


class Persistent(Ours):
    """Ours with persistent collectives (``col.all_reduce_init``...): each timed call is one use."""

    def make(self, op: str, x: np.ndarray, out: np.ndarray) -> Step:
        col, peer = self.col, self.peer
        given: np.ndarray | None = x
        target = out.reshape(self.world, -1) if op == "all_gather" else out
        if op == "broadcast":  # (the root broadcasts from x in place)
            given, target = (x, x) if peer == 0 else (None, out)
        made: Step = getattr(col, f"{op}_init")(peer, given, out=target)
        return made


class Gloo(System):
    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        self.torch, self.dist = torch, dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def make(self, op: str, x: np.ndarray, out: np.ndarray) -> Step:
        dist, tx, tout = self.dist, self.torch.from_numpy(x), self.torch.from_numpy(out)
        if op == "all_reduce":  # in place (gloo has no out-of-place all_reduce): x's values in out first
            tout.copy_(tx)
            return lambda: dist.all_reduce(tout)
        if op == "all_gather":
            return lambda: dist.all_gather_into_tensor(tout, tx)
        if op == "reduce_scatter":
            return lambda: dist.reduce_scatter_tensor(tout, tx)
        return lambda: dist.broadcast(tx if self.rank == 0 else tout, 0)

    def barrier(self) -> None:
        self.dist.barrier()

    def checked(self, op: str, out: np.ndarray) -> None:
        if op == "all_reduce":
            out.fill(np.inf)  # the fixed point of a repeated in-place sum (the reference harness's)

    def max(self, values: np.ndarray) -> np.ndarray:
        tensor = self.torch.from_numpy(values)
        self.dist.all_reduce(tensor, self.dist.ReduceOp.MAX)
        return values

    def close(self) -> None:
        self.dist.destroy_process_group()


class Mpi(System):
    def __init__(self) -> None:
        from mpi4py import MPI

        self.mpi, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()

    def make(self, op: str, x: np.ndarray, out: np.ndarray) -> Step:
        comm = self.comm
        if op == "all_reduce":  # (in place where x is out: a decode step's)
            return lambda: comm.Allreduce(self.mpi.IN_PLACE if x is out else x, out, op=self.mpi.SUM)
        if op == "all_gather":
            return lambda: comm.Allgather(x, out)
        if op == "reduce_scatter":
            return lambda: comm.Reduce_scatter_block(x, out, op=self.mpi.SUM)
        return lambda: comm.Bcast(x if self.rank == 0 else out, root=0)

    def barrier(self) -> None:
        self.comm.Barrier()

    def max(self, values: np.ndarray) -> np.ndarray:
        self.comm.Allreduce(self.mpi.IN_PLACE, values, op=self.mpi.MAX)
        return values

    def close(self) -> None:
        self.comm.Barrier()


def buffers(op: str, size: int, rank: int, world: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input, output, the expected output) for one rank."""
    count = max(1, size // 4)
    if op == "all_gather":
        per = max(1, count // world)
        x = np.full(per, rank + 1, np.float32)
        expected = np.repeat(np.arange(1, world + 1, dtype=np.float32), per)
        return x, np.empty(per * world, np.float32), expected
    if op == "reduce_scatter":
        per = max(1, count // world)
        x = np.full(per * world, rank + 1, np.float32)
        return x, np.empty(per, np.float32), np.full(per, world * (world + 1) / 2, np.float32)
    x = np.full(count, rank + 1, np.float32)
    expected = np.full(count, 1.0 if op == "broadcast" else world * (world + 1) / 2, np.float32)
    return x, np.empty(count, np.float32), expected


DECODE_CALLS = 64  # a decode step of a tensor-parallel model: 32 layers, 2 all_reduces each


def decode(system: System, x: np.ndarray, out: np.ndarray) -> Step:
    """One token of a tensor-parallel decode loop: each layer's activation made (x copied into
    ``out``, the same copy for every system) and all-reduced in place, ``DECODE_CALLS`` times."""
    reduce = system.make("all_reduce", out, out)

    def step() -> None:
        for _ in range(DECODE_CALLS):
            np.copyto(out, x)
            reduce()

    return step


def measure(system: System, op: str, size: int, budget: float, warmup: int) -> dict[str, Any]:
    x, out, expected = buffers(op, size, system.rank, system.world)
    step = decode(system, x, out) if op == "decode" else system.make(op, x, out)
    system.barrier()
    step()
    received = x if op == "broadcast" and system.rank == 0 else out
    wrong = int(np.count_nonzero(received != expected))
    system.checked(op, out)
    times: list[float] = []
    for _ in range(warmup):
        system.barrier()
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    estimate = system.max(np.array([float(np.median(times)) if times else 1e-3]))[0]
    iterations = int(min(2000, max(5, budget / max(estimate, 1e-7))))
    series = np.zeros(iterations)
    for i in range(iterations):
        system.barrier()
        started = time.perf_counter()
        step()
        series[i] = time.perf_counter() - started
    slowest = system.max(series)
    total_wrong = int(system.max(np.array([float(wrong)]))[0])
    return {
        "op": op,
        "size": size,
        "world": system.world,
        "median_us": float(np.median(slowest)) * 1e6,
        "min_us": float(slowest.min()) * 1e6,
        "iterations": iterations,
        "wrong": total_wrong,
    }


def main() -> int:
    name, plan = sys.argv[1], json.loads(sys.argv[2])
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(variable, "1")
    system: System = {"ours": Ours, "anew": Anew, "persistent": Persistent, "gloo": Gloo, "mpi": Mpi}[name]()
    try:
        for op, size in plan["cases"]:
            row = measure(system, op, size, plan["budget"], plan["warmup"])
            if system.rank == 0:
                print("ROW " + json.dumps({"system": name, **row}), flush=True)
    finally:
        system.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
