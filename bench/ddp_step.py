"""DDP training step time on CPU: torch.distributed with our backend against gloo, side by side.

    python -m collective.bench.ddp_step                 # 2 processes, both models, 30 steps, 3 rounds
    python -m collective.bench.ddp_step --procs 2 --steps 30 --rounds 5 --json rows.json

Two seeded models (``MODELS``): ``mlp-1.3m`` (three Linear layers, 1,317,002 parameters in 6
tensors) and ``mlp-12x128`` (twelve 128-wide layers and an output layer: 26 tensors, 191,242
parameters). Each round trains every model ``--steps`` steps under each backend, alternating
which backend goes first; a step is zero_grad, forward, backward (DDP's bucketed all-reduce,
overlapped) and an SGD update, timed on every rank; a round's figure is the median over steps
of the slowest rank's time. The table reports the median over rounds, and the largest
difference between the two backends' final parameters (they start equal: DDP broadcasts rank
0's at construction, and rank 1 starts perturbed on purpose). ``repeat=0`` is our backend with
COLLECTIVE_TORCH_REPEAT=0 (DDP's bucket all_reduces checked and agreed anew every step, not run
as their kept calls), in the same rounds.

``train`` is shared with the tests (tests/torch_worker.py), which compare the parameters.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from collective.torch import REPEAT_VARIABLE as REPEAT

__all__ = ["MODELS", "build", "main", "train"]

MODELS = ("mlp-1.3m", "mlp-12x128")
BATCH = 64


def build(name: str) -> Any:
    """The seeded model ``name`` (the same parameters in every process)."""
    import torch
    from torch import nn

    torch.manual_seed(1234)
    if name == "mlp-1.3m":
        return nn.Sequential(
            nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 384), nn.ReLU(), nn.Linear(384, 10)
        )
    if name == "mlp-12x128":
        layers: list[Any] = [nn.Linear(64, 128), nn.ReLU()]
        for _ in range(11):
            layers += [nn.Linear(128, 128), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(128, 10))
    raise ValueError(f"unknown model {name!r}: one of {', '.join(MODELS)}")


def train(
    name: str,
    steps: int,
    rank: int,
    *,
    accumulate: int = 1,
    hook: Callable[..., Any] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> tuple[Any, list[float]]:
    """Train ``name`` under DDP in the default group; (its final parameters, flat; step seconds).

    ``accumulate`` > 1: every step runs that many micro-batches, all but the last in ``no_sync()``.
    ``hook``: a DDP comm hook (``register_comm_hook(None, hook)``). ``on_step(i)`` runs first in
    step i (the tests kill a rank there).
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    model = build(name)
    if rank == 1:
        with torch.no_grad():  # DDP must make the ranks equal at construction (broadcast from rank 0)
            for parameter in model.parameters():
                parameter.add_(0.5)
    ddp = DistributedDataParallel(model)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    features = model[0].in_features
    generator = torch.Generator().manual_seed(100 + rank)
    times: list[float] = []
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        batches = [
            (
                torch.randn(BATCH, features, generator=generator),
                torch.randint(0, 10, (BATCH,), generator=generator),
            )
            for _ in range(accumulate)
        ]
        started = time.perf_counter()
        optimizer.zero_grad()
        for i, (x, y) in enumerate(batches):
            with ddp.no_sync() if i < accumulate - 1 else contextlib.nullcontext():
                loss: Any = F.cross_entropy(ddp(x), y)
                loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, times


def _worker(backend: str, steps: int, out: str) -> int:
    """One rank: train every model, write (rank 0) the step times and parameters to ``out``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "collective":
        import collective.torch  # noqa: F401  registers the backend
    dist.init_process_group(backend)
    rank = dist.get_rank()
    record: dict[str, Any] = {}
    for name in MODELS:
        flat, times = train(name, steps, rank)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, dist.ReduceOp.MAX)
        record[name] = {"step_ms": statistics.median(slowest.tolist()[2:] or slowest.tolist()) * 1e3}
        if rank == 0:
            torch.save(flat, f"{out}.{name}.pt")
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(record, handle)
    dist.barrier()  # leave together: gloo aborted a rank torn down while its peer was still busy
    dist.destroy_process_group()
    return 0


# what each column runs: (torch backend, the variables it runs with)
VARIANTS = {"collective": ("collective", {}), "repeat=0": ("collective", {REPEAT: "0"}), "gloo": ("gloo", {})}


def _run(variant: str, procs: int, steps: int, out: str) -> dict[str, Any]:
    from collective.launch import free_port

    backend, variables = VARIANTS[variant]
    port = free_port()
    environ = dict(
        os.environ, WORLD_SIZE=str(procs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **variables
    )
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "collective.bench.ddp_step",
                "--worker",
                backend,
                "--steps",
                str(steps),
                out,
            ],
            env=dict(environ, RANK=str(rank), OMP_NUM_THREADS="1"),
        )
        for rank in range(procs)
    ]
    codes = [child.wait(600) for child in children]
    if any(codes):
        raise RuntimeError(f"{backend} ranks failed: exit codes {codes}")
    with open(out) as handle:
        record: dict[str, Any] = json.load(handle)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collective.bench.ddp_step", description=__doc__)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--worker", choices=("collective", "gloo"), help=argparse.SUPPRESS)  # (a backend)
    parser.add_argument("out", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        code = _worker(args.worker, args.steps, args.out)
        sys.stdout.flush()
        sys.stderr.flush()
        # (its work is written: a normal exit ran gloo's C++ teardown, which once aborted a rank
        # with "terminate called without an active exception" and failed the run)
        os._exit(code)
    import torch

    times: dict[tuple[str, str], list[float]] = {}
    diffs: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            order = list(VARIANTS) if round_ % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                record = _run(variant, args.procs, args.steps, os.path.join(folder, variant))
                for name in MODELS:
                    times.setdefault((name, variant), []).append(record[name]["step_ms"])
            for name, variant in itertools.product(MODELS, ("collective", "repeat=0")):
                ours = torch.load(os.path.join(folder, f"{variant}.{name}.pt"))
                theirs = torch.load(os.path.join(folder, f"gloo.{name}.pt"))
                diffs[name] = max(diffs.get(name, 0.0), float((ours - theirs).abs().max()))
    print(f"# DDP step time, {args.procs} processes, CPU, {args.steps} steps, median of {args.rounds} rounds")
    columns = f"{'gloo (ms)':>10} {'collective (ms)':>16} {'repeat=0 (ms)':>14} {'ratio':>7}"
    print(f"{'model':>12} {columns} {'max |param diff|':>17}")
    rows = []
    for name in MODELS:
        gloo = statistics.median(times[(name, "gloo")])
        ours = statistics.median(times[(name, "collective")])
        anew = statistics.median(times[(name, "repeat=0")])
        rounds = {variant: times[(name, variant)] for variant in VARIANTS}
        rows.append(
            {
                "model": name,
                "gloo_ms": gloo,
                "collective_ms": ours,
                "repeat0_ms": anew,
                "max_param_diff": diffs[name],
                "rounds": rounds,
            }
        )
        figures = f"{gloo:>10.2f} {ours:>16.2f} {anew:>14.2f} {ours / gloo:>6.2f}x"
        print(f"{name:>12} {figures} {diffs[name]:>17.2e}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {"command": sys.argv, "procs": args.procs, "steps": args.steps, "rows": rows},
                handle,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
