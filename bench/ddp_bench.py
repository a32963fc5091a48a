"""collective.ddp against the ways around it: one training step on 2 processes, side by side in one run.

    python -m collective.bench.ddp_bench [--rounds 5] [--steps 20] [--json FILE]

Two processes (torchrun's variables, ``col.init()``; gloo on a port of its own) train the same
MLP, each on its own rows of every batch, with SGD. One step is zero_grad, forward, backward, the
gradient sync, the optimizer step. The variants of the sync:

* ``none``: no communication (the replicas drift apart): the floor;
* ``naive``: one blocking ``col.all_reduce`` per parameter after backward;
* ``flat``: the gradients copied into one tensor, one ``col.all_reduce``, copied back;
* ``ddp``: ``collective.ddp.GradientSync`` with its default buckets (25 MiB), from the hooks;
* ``ddp-overlap``: ``GradientSync`` with ``--bucket-kib`` buckets (several per step, each started
  from the hooks while backward goes on);
* ``gloo-ddp``: ``torch.nn.parallel.DistributedDataParallel`` on the gloo backend (its defaults).

Models: ``mlp26`` (12 Linear(128, 128) layers and a head: 26 tensors, 198 K parameters, 64 rows
per process) and ``mlp1.3M`` (784 -> 1024 -> 512 -> 10: 6 tensors, 1.33 M parameters, 64 rows);
``overlap`` is ``mlp26`` with ``--overlap-rows`` rows per process, a backward long enough to hide
the sync; ``idle`` is ``mlp26`` whose backward also waits ``--idle-ms`` per layer with the CPU free
(as it is while an accelerator computes): on a machine whose every core computes, only the
second leaves the sync a CPU to run on. Before every step the processes meet at a barrier
(untimed); a step's time is the slower process's; each figure is the median over every timed
step of every round, the variants taking turns step by step (a slow moment of the machine hits
them all). The issue's targets are checked at the end.

``--hosts ab`` puts the two processes on two hosts as far as the runtime knows
(``COLLECTIVE_HOST_ID``): every collective of ours then crosses TCP, as between machines (gloo's
always does).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import collective as col
from collective.ddp import GradientSync, attach_torch
from collective.launch import free_port, stop_processes

VARIANTS = ("none", "naive", "flat", "ddp", "ddp-overlap", "gloo-ddp")
Step = Callable[[torch.Tensor, torch.Tensor], None]


SIZES = {"mlp26": [128] * 13 + [1], "mlp1.3M": [784, 1024, 512, 10]}  # layer widths


class Idle(torch.autograd.Function):
    """Identity; its backward sleeps: compute on an accelerator, during which the CPU is free."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class Sleeper(torch.nn.Module):
    def __init__(self, ms: float) -> None:
        super().__init__()
        self.seconds = ms / 1000

    def forward(self, x: torch.Tensor) -> Any:
        return Idle.apply(x, self.seconds)  # type: ignore[no-untyped-call]


def model_of(name: str, idle_ms: float = 0.0) -> torch.nn.Sequential:
    """The MLP ``name``; with ``idle_ms``, each layer's backward also waits that long, CPU idle."""
    torch.manual_seed(0)
    sizes = SIZES[name]
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        layers += [
            torch.nn.Linear(fan_in, fan_out),
            *([Sleeper(idle_ms)] if idle_ms else []),
            torch.nn.Tanh(),
        ]
    return torch.nn.Sequential(*layers[:-1])


def batch_of(name: str, rows: int, peer: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(peer)
    x = torch.randn((rows, SIZES[name][0]), generator=generator)
    return x, torch.randn((rows, SIZES[name][-1]), generator=generator)


def grads_of(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    grads = [param.grad for param in params]
    assert all(grad is not None for grad in grads), "every parameter has a gradient after backward"
    return [grad for grad in grads if grad is not None]


class Trainer:
    """One variant's replica of the model, its optimizer and its step."""

    def __init__(self, variant: str, base: torch.nn.Sequential, peer: int, bucket_kib: int) -> None:
        self.model = copy.deepcopy(base)
        self.peer = peer
        self.handles: list[Any] = []
        self.sync: GradientSync | None = None
        if variant.startswith("ddp"):
            bucket = bucket_kib << 10 if variant == "ddp-overlap" else 25 << 20
            self.sync = GradientSync(peer, dict(self.model.named_parameters()), bucket_bytes=bucket)
            self.handles = attach_torch(self.model, self.sync)
        self.net: torch.nn.Module = self.model
        if variant == "gloo-ddp":
            self.net = torch.nn.parallel.DistributedDataParallel(self.model)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.SGD(self.params, lr=0.01)
        self.reduce = {"naive": self._naive, "flat": self._flat}.get(variant)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(self.net(x), y).backward()  # type: ignore[no-untyped-call]
        if self.reduce is not None:
            self.reduce()
        if self.sync is not None:
            self.sync.wait()
        self.optimizer.step()

    def _naive(self) -> None:
        for grad in grads_of(self.params):
            col.all_reduce(self.peer, grad, op="mean", out=grad)

    def _flat(self) -> None:
        grads = grads_of(self.params)
        flat = torch.cat([g.reshape(-1) for g in grads])
        col.all_reduce(self.peer, flat, op="mean", out=flat)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def worker(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """One process: every (case, variant)'s step times in ms, the slower process's per step."""
    torch.set_num_threads(1)
    peer = col.init()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.gloo_port}",
        rank=peer,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    cases = {
        "mlp26": ("mlp26", 64, 0.0),
        "mlp1.3M": ("mlp1.3M", 64, 0.0),
        "overlap": ("mlp26", args.overlap_rows, 0.0),
        "idle": ("mlp26", 64, args.idle_ms),
    }
    times: dict[str, dict[str, list[float]]] = {case: {v: [] for v in VARIANTS} for case in cases}
    for _ in range(args.rounds):
        for case, (name, rows, idle_ms) in cases.items():
            base = model_of(name, idle_ms)
            x, y = batch_of(name, rows, peer)
            trainers = {variant: Trainer(variant, base, peer, args.bucket_kib) for variant in VARIANTS}
            steps: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
            for i in range(args.warmup + args.steps):
                for variant, trainer in trainers.items():  # the variants take turns, step by step
                    col.barrier(peer)
                    started = time.perf_counter()
                    trainer.step(x, y)
                    if i >= args.warmup:
                        steps[variant].append((time.perf_counter() - started) * 1e3)
            for variant, trainer in trainers.items():
                trainer.close()
                slower = col.all_reduce(peer, torch.tensor(steps[variant], dtype=torch.float64), op="max")
                times[case][variant] += slower.tolist()
    dist.destroy_process_group()
    col.finish(peer)
    return times


def run_processes(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Start 2 workers with torchrun's variables; rank 0's report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    port, gloo_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "collective.bench.ddp_bench",
        "--worker",
        "--gloo-port",
        str(gloo_port),
        "--rounds",
        str(args.rounds),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--bucket-kib",
        str(args.bucket_kib),
        "--overlap-rows",
        str(args.overlap_rows),
        "--idle-ms",
        str(args.idle_ms),
    ]
    envs = [
        dict(env, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for r in range(2)
    ]
    if args.hosts:  # each process on the host its letter names: different letters talk over TCP only
        for e, host in zip(envs, args.hosts, strict=True):
            e["COLLECTIVE_HOST_ID"] = host
    outputs = [subprocess.PIPE, subprocess.DEVNULL]  # rank 0 reports
    procs = [
        subprocess.Popen(argv, stdout=out, text=True, env=e) for out, e in zip(outputs, envs, strict=True)
    ]
    try:
        out, _ = procs[0].communicate(timeout=args.limit)
        procs[1].wait(60)
    finally:
        stop_processes(procs)
    if procs[0].returncode != 0 or procs[1].returncode != 0:
        raise SystemExit(f"ddp_bench: a worker failed (exit {procs[0].returncode}, {procs[1].returncode})")
    return dict(json.loads(out.strip().splitlines()[-1]))


def report(times: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> list[str]:
    """Median ms per step, the same over gloo DDP's and over no communication's, and the targets."""
    medians = {case: {v: statistics.median(t) for v, t in row.items()} for case, row in times.items()}
    lines = []
    for title, base, form in (
        ("ms per step", None, "{:13.2f}"),
        ("x gloo-ddp", "gloo-ddp", "{:12.2f}x"),
        ("x none", "none", "{:12.2f}x"),
    ):
        lines += ["", f"{title:<9}" + "".join(f"{v:>13}" for v in VARIANTS)]
        for case, row in medians.items():
            lines.append(
                f"{case:<9}" + "".join(form.format(row[v] / (row[base] if base else 1)) for v in VARIANTS)
            )
    m26, m13, over, idle = medians["mlp26"], medians["mlp1.3M"], medians["overlap"], medians["idle"]
    targets = [
        ("mlp26: ddp <= 1.0x gloo DDP", m26["ddp"] / m26["gloo-ddp"], 1.0),
        ("mlp1.3M: ddp <= 1.0x gloo DDP", m13["ddp"] / m13["gloo-ddp"], 1.0),
        ("mlp26: ddp <= 0.5x naive", m26["ddp"] / m26["naive"], 0.5),
        (
            f"overlap ({args.overlap_rows} rows): ddp-overlap <= 1.15x none (flat, no overlap: "
            f"{over['flat'] / over['none']:.2f}x)",
            over["ddp-overlap"] / over["none"],
            1.15,
        ),
        (
            f"idle ({args.idle_ms:g} ms idle backward per layer): ddp-overlap <= 1.15x none "
            f"(flat, no overlap: {idle['flat'] / idle['none']:.2f}x)",
            idle["ddp-overlap"] / idle["none"],
            1.15,
        ),
    ]
    lines.append("")
    for label, ratio, bound in targets:
        lines.append(f"target {label}: {ratio:.2f}x {'met' if ratio <= bound else 'NOT met'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collective.bench.ddp_bench", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-kib", type=int, default=256, help="buckets of the ddp-overlap variant")
    parser.add_argument("--overlap-rows", type=int, default=1024, help="rows per process of the overlap case")
    parser.add_argument("--idle-ms", type=float, default=0.5, help="idle backward per layer, idle case")
    parser.add_argument("--limit", type=float, default=1800, help="seconds the whole run may take")
    parser.add_argument(
        "--hosts", help="one letter per process naming its host (COLLECTIVE_HOST_ID): 'ab' times two hosts"
    )
    parser.add_argument("--json", help="write every step time here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hosts is not None and len(args.hosts) != 2:
        parser.error("--hosts names the host of each of the 2 processes, e.g. ab")
    if args.worker:
        times = worker(args)
        if os.environ["RANK"] == "0":
            print(json.dumps(times), flush=True)
        return 0
    print(
        f"# ddp_bench: 2 processes, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.rounds} rounds "
        f"x {args.steps} steps, median ms per step (the slower process's)",
        flush=True,
    )
    times = run_processes(args)
    for line in report(times, args):
        print(line)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "times": times}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
