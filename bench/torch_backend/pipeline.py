"""A pipeline-parallel training step through our backend and through gloo, side by side in one run.

    python -m collective.bench.torch_backend.pipeline                       # 1F1B and GPipe, 2 stages
    python -m collective.bench.torch_backend.pipeline --microbatches 8 --width 256 --rounds 9

Two processes of this host each hold one stage of an MLP (torch.distributed.pipelining's
``PipelineStage``, built by hand with its shapes given) and run ``Schedule1F1B`` or
``ScheduleGPipe``: every micro-batch sends its activations forward and its gradients back with
send/recv, so the step time is bound by point-to-point latency. Each process makes the stage
twice with the same weights, on the default group (backend "collective") and on a gloo group of
the same ranks, and times ``--rounds`` steps of each (after a barrier; one untimed first); the
table gives the median per step and the ratio, and flags parameters that differ between the two.
gloo's group has a ``--gloo-timeout``, so a hang there ends (torch issue 132644 reports some in
pipelining's batched send/recv on gloo): the table then says so and times ours alone.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from collective.bench.torch_backend.ranks import run_ranks

__all__ = ["main"]

SCHEDULES = ("1F1B", "GPipe")


def _stage(pipelining: Any, torch: Any, module: Any, rank: int, args: argparse.Namespace, group: Any) -> Any:
    example = torch.empty(args.rows, args.width)  # (shapes given: no metadata inference)
    return pipelining.PipelineStage(
        module,
        rank,
        2,
        torch.device("cpu"),
        input_args=example,
        output_args=example,
        input_grads=example,
        output_grads=example,
        group=group,
    )


def _steps(run: Any, rank: int, rounds: int, inputs: list[Any], targets: list[Any], dist: Any) -> list[float]:
    """Seconds of each timed step (after one untimed)."""
    _, schedule, optimizer, group = run
    times = []
    for step in range(rounds + 1):
        x, y = inputs[step % len(inputs)], targets[step % len(targets)]
        dist.barrier(group=group)
        started = time.perf_counter()
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        optimizer.step()
        if step:
            times.append(time.perf_counter() - started)
    return times


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    dist.init_process_group("collective")
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.gloo_timeout))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(2 * args.depth)]
    mine = torch.nn.Sequential(*layers[rank * args.depth : (rank + 1) * args.depth])
    batch = args.microbatches * args.rows
    data = torch.Generator().manual_seed(1)
    inputs = [torch.randn(batch, args.width, generator=data) for _ in range(4)]
    targets = [torch.randn(batch, args.width, generator=data) for _ in range(4)]
    kinds = {"1F1B": pipelining.Schedule1F1B, "GPipe": pipelining.ScheduleGPipe}
    gloo_works = True
    for schedule_name in args.schedule:
        runs: dict[str, Any] = {}
        for name, group in (("collective", None), ("gloo", gloo)):
            module = copy.deepcopy(mine)
            stage = _stage(pipelining, torch, module, rank, args, group)
            loss = torch.nn.functional.mse_loss  # (every stage names it: else it runs forwards alone)
            schedule = kinds[schedule_name](stage, args.microbatches, loss_fn=loss)
            runs[name] = (module, schedule, torch.optim.SGD(module.parameters(), lr=0.01), group)
        ours = statistics.median(_steps(runs["collective"], rank, args.rounds, inputs, targets, dist))
        theirs, said = float("nan"), ""
        if gloo_works:
            try:
                theirs = statistics.median(_steps(runs["gloo"], rank, args.rounds, inputs, targets, dist))
            except RuntimeError as exc:  # (its timeout)
                gloo_works, said = False, f"  gloo: {str(exc).splitlines()[0][:120]}"
        same = gloo_works and all(
            torch.equal(a, b)
            for a, b in zip(runs["collective"][0].parameters(), runs["gloo"][0].parameters(), strict=True)
        )
        flag = torch.tensor([int(same)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # (ours: gloo's group may be broken now)
        if rank == 0:
            compared = "" if not gloo_works else ("" if flag.item() else "  PARAMETERS DIFFER")
            ratio = f"{ours * 1e3:>14.2f} {theirs * 1e3:>9.2f} {ours / theirs:>7.2f}"
            print(f"{schedule_name:>9} {ratio}{compared}{said}", flush=True)
    dist.destroy_process_group()


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m collective.bench.torch_backend.pipeline", description=__doc__
    )
    parser.add_argument("--schedule", action="append", choices=SCHEDULES, help="repeatable; default both")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2, help="Linear layers per stage")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--gloo-timeout", type=float, default=20, help="seconds before gloo's run is given up"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.schedule = args.schedule or list(SCHEDULES)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    given = list(sys.argv[1:] if argv is None else argv)
    rest = [a for i, a in enumerate(given) if a != "--schedule" and (i == 0 or given[i - 1] != "--schedule")]
    shape = f"{args.microbatches} micro-batches of {args.rows} x {args.width}"
    print(f"# 2 stages, {shape}; median of {args.rounds} steps", flush=True)
    print(f"{'schedule':>9} {'collective ms':>14} {'gloo ms':>9} {'ratio':>7}", flush=True)
    module = "collective.bench.torch_backend.pipeline"  # (each schedule in a pair of processes of its own:
    # what one leaves behind, say gloo's group after its timeout, never meets the next)
    return max(run_ranks(module, [*rest, "--schedule", schedule], 2) for schedule in args.schedule)


if __name__ == "__main__":
    sys.exit(main())
