"""Five ways to average gradients across data-parallel peers, timed side by side and checked.

    collective launch --nodes 2 docs/examples/ddp_variants.py --tiny
    torchrun --nproc-per-node 2 docs/examples/ddp_variants.py

Every peer holds a replica of one MLP and trains it on its own rows of each global batch. After
``backward`` the gradients of the peers must be averaged; each variant does that differently:

* naive: one blocking ``all_reduce`` per parameter after backward (26 collectives per step on the
  default 12x128 model: the per-call latency is paid 26 times);
* flattened: every gradient copied into one flat tensor, one ``all_reduce``, copied back (one
  collective, two copies);
* overlapped: each parameter's ``all_reduce`` started asynchronously from its gradient hook while
  backward goes on, all waited on before the optimizer step;
* bucketed: ``collective.ddp.GradientSync``: gradients grouped into buckets in backward order, one
  asynchronous coalesced all-reduce per bucket, started from the hooks (overlap without 26 calls);
* accumulation: ``GradientSync`` over ``--micro`` micro-batches per step, all but the last
  backward inside ``torch_no_sync``: one sync per step, whatever the number of micro-batches.

Peers start from different random weights on purpose; ``broadcast_parameters`` gives every
replica peer 0's. A "no communication" row times the same step without any sync (the replicas
drift apart; it is the floor, not a result). Each variant then trains ``--steps`` steps from the
same weights and its final weights are compared with a single process training the same model on
the whole global batch (the average of the peers' gradients is the full batch's gradient). The
script prints every variant's median step time and exits 1 if any variant differs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

import collective as col
from collective.ddp import (
    DEFAULT_BUCKET_BYTES,
    GradientSync,
    attach_torch,
    broadcast_parameters,
    torch_no_sync,
)

TOLERANCE = 1e-5  # float32: the peers sum in another order than the single process


def mlp(width: int, depth: int) -> torch.nn.Sequential:
    """``depth`` Linear(width, width) + Tanh layers, a Linear(width, 1) head: 2 * depth + 2 tensors."""
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def global_batch(step: int, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every peer (each uses its own rows of it) and in the reference."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, width, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


class SGD:
    """Plain SGD (torch.optim.SGD does the same; its constructor costs each process a second of imports)."""

    def __init__(self, params: list[torch.Tensor], lr: float) -> None:
        self.params, self.lr = params, lr

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for param in self.params:
            param -= self.lr * param.grad


class Trainer:
    """One replica: its model, its rows of each batch, a plain SGD step."""

    def __init__(self, peer: int, world: int, args: argparse.Namespace, initial: list[torch.Tensor]) -> None:
        self.peer, self.world, self.args = peer, world, args
        self.model = mlp(args.width, args.depth)
        self.params = list(self.model.parameters())
        self.initial = initial
        self.optimizer = SGD(self.params, args.lr)

    def reset(self) -> None:
        with torch.no_grad():
            for param, value in zip(self.params, self.initial, strict=True):
                param.copy_(value)

    def backward(self, step: int, micro: int = 1, before_last: Callable[[], Any] | None = None) -> None:
        """This peer's gradient of the mean loss over its rows, in ``micro`` backward passes."""
        rows = self.args.batch
        x, y = global_batch(step, rows * self.world, self.args.width)
        x, y = x[self.peer * rows : (self.peer + 1) * rows], y[self.peer * rows : (self.peer + 1) * rows]
        self.optimizer.zero_grad()
        for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            context = before_last() if before_last is not None and i < micro - 1 else nullcontext()
            with context:
                loss = torch.nn.functional.mse_loss(self.model(xs), ys) / micro
                loss.backward()


# -- the variants: each runs one training step ------------------------------------------------------


def naive(t: Trainer, step: int) -> None:
    t.backward(step)
    for param in t.params:
        col.all_reduce(t.peer, param.grad, op="mean", out=param.grad)
    t.optimizer.step()


def flattened(t: Trainer, step: int) -> None:
    t.backward(step)
    grads = [param.grad for param in t.params]
    flat = torch.cat([g.reshape(-1) for g in grads])  # copy in
    col.all_reduce(t.peer, flat, op="mean", out=flat)
    offset = 0
    for grad in grads:  # copy out
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    t.optimizer.step()


class Overlapped:
    """One asynchronous all_reduce per parameter, started by its hook as soon as backward made it."""

    def __init__(self, t: Trainer) -> None:
        self.works: list[col.Work] = []
        self.handles = [p.register_post_accumulate_grad_hook(self.started) for p in t.params]
        self.peer = t.peer

    def started(self, param: torch.Tensor) -> None:
        self.works.append(col.all_reduce(self.peer, param.grad, op="mean", async_op=True, out=param.grad))

    def __call__(self, t: Trainer, step: int) -> None:
        t.backward(step)
        for work in self.works:  # only now: the optimizer needs the averaged gradients
            work.wait()
        self.works.clear()
        t.optimizer.step()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class Bucketed:
    """collective.ddp: buckets in backward order, one async coalesced all-reduce each."""

    def __init__(self, t: Trainer, micro: int = 1) -> None:
        named = dict(t.model.named_parameters())
        self.sync = GradientSync(t.peer, named, bucket_bytes=t.args.bucket_kib << 10)
        self.handles = attach_torch(t.model, self.sync)
        self.micro = micro

    def __call__(self, t: Trainer, step: int) -> None:
        t.backward(step, self.micro, before_last=lambda: torch_no_sync(self.sync))
        self.sync.wait()
        t.optimizer.step()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def local_only(t: Trainer, step: int) -> None:
    t.backward(step)
    t.optimizer.step()


# -- measuring and checking -------------------------------------------------------------------------


def run(
    t: Trainer, variant: Callable[[Trainer, int], None], expected: list[torch.Tensor]
) -> tuple[float, float]:
    """Median step time (slowest peer's, ms) over the timed steps, then the checked run's weights."""
    times = []
    t.reset()
    for step in range(t.args.warmup + t.args.timed):
        col.barrier(t.peer)  # every peer starts the step together: time the step, not the skew
        started = time.perf_counter()
        variant(t, step)
        if step >= t.args.warmup:
            times.append(time.perf_counter() - started)
    median = torch.tensor([statistics.median(times) * 1e3])
    slowest = float(col.all_reduce(t.peer, median, op="max")[0])
    t.reset()
    for step in range(t.args.steps):
        variant(t, step)
    return slowest, deviation(t.params, expected)


def reference(args: argparse.Namespace, world: int, initial: list[torch.Tensor]) -> list[torch.Tensor]:
    """One process, the whole global batch, the same SGD: the weights every variant must reach."""
    single = Trainer(0, 1, argparse.Namespace(**{**vars(args), "batch": args.batch * world}), initial)
    single.reset()
    for step in range(args.steps):
        local_only(single, step)
    return [p.detach().clone() for p in single.params]


def deviation(params: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """The largest |w - reference| relative to the reference's scale, over every parameter."""
    return max(
        float((p.detach() - e).abs().max()) / max(1.0, float(e.abs().max()))
        for p, e in zip(params, expected, strict=True)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=12, help="hidden layers (2 * depth + 2 tensors)")
    parser.add_argument("--batch", type=int, default=64, help="rows per peer per step")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches of the accumulation variant")
    parser.add_argument(
        "--bucket-kib", type=int, default=DEFAULT_BUCKET_BYTES >> 10, help="GradientSync buckets"
    )
    parser.add_argument("--steps", type=int, default=5, help="steps of the checked run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--timed", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--tiny", action="store_true", help="a small model and few steps (CI)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.width, args.depth, args.batch, args.bucket_kib = 16, 3, 8, 1
        args.warmup, args.timed, args.steps = 1, 3, 3
    torch.set_num_threads(args.threads)

    peer = col.init()
    world = col.world_size()
    torch.manual_seed(100 + peer)  # every replica starts elsewhere ...
    trainer = Trainer(peer, world, args, [])
    broadcast_parameters(peer, trainer.params)  # ... until it takes peer 0's weights
    trainer.initial = [p.detach().clone() for p in trainer.params]
    expected = reference(args, world, trainer.initial)

    n = len(trainer.params)
    rows = [
        ("no communication", *run(trainer, local_only, expected), 0, False),
        ("naive per-parameter", *run(trainer, naive, expected), n, True),
        ("flattened", *run(trainer, flattened, expected), 1, True),
    ]
    for name, make in [
        ("overlapped per-parameter", lambda: Overlapped(trainer)),
        ("bucketed (collective.ddp)", lambda: Bucketed(trainer)),
        (f"accumulation x{args.micro} (no_sync)", lambda: Bucketed(trainer, micro=args.micro)),
    ]:
        variant = make()  # its hooks live while it runs
        calls = n if isinstance(variant, Overlapped) else len(variant.sync.buckets)
        rows.append((name, *run(trainer, variant, expected), calls, True))
        variant.close()

    failed = [name for name, _, error, _, checked in rows if checked and error > TOLERANCE]
    if peer == 0:
        print(
            f"ddp_variants: {world} peers, MLP {args.depth}x{args.width} ({len(trainer.params)} tensors, "
            f"{sum(p.numel() for p in trainer.params):,} parameters), {args.batch} rows per peer, "
            f"median of {args.timed} steps (slowest peer)"
        )
        naive_ms = rows[1][1]
        print(f"  {'variant':<28} {'step ms':>9} {'vs naive':>9} {'collectives':>12} {'max rel err':>12}")
        for name, ms, error, calls, checked in rows:
            note = "" if checked else "  (not synced: the check must see it differ)"
            print(f"  {name:<28} {ms:9.2f} {ms / naive_ms:8.2f}x {calls:12d} {error:12.1e}{note}")
    verdict = "FAILED: " + ", ".join(failed) if failed else "OK"
    print(f"ddp_variants: peer {peer}: {verdict} (every variant vs the single-process reference)", flush=True)
    col.finish(peer)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
