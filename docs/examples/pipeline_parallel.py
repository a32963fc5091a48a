"""Pipeline parallelism: 4 stages, a 1F1B schedule over micro-batches, checked against one process.

    collective launch --nodes 4 docs/examples/pipeline_parallel.py --tiny
    torchrun --nproc-per-node 4 docs/examples/pipeline_parallel.py

One peer per stage (the world size is the number of stages). The model is a tied-weight
autoencoder: stage 0 embeds (tanh(x E^T + b)), the middle stages are Linear + tanh, the last stage
decodes with the same E (h E + c) and computes the loss against x. Activations go forward and
their gradients backward with ``send``/``recv`` (``send`` is eager: it never waits for the receiver).

1F1B (PipeDream-Flush): stage s runs S - s - 1 forwards to fill the pipeline, then alternates one
forward and one backward, then drains the remaining backwards, so at most S - s micro-batches'
activations are alive on stage s (GPipe keeps all M)::

    stage 0  F0 F1 F2 F3          B0    F4 B1    F5 B2 ...
    stage 3           F0 B0 F1 B1 F2 B2 ...

E lives on stage 0 and on the last stage; its two gradients are summed by an ``all_reduce`` over
the group of those two peers, started asynchronously as soon as the stage's last backward is done.
The stage updates its other parameters meanwhile and waits for the sum only to update E.

Every peer computes the unpipelined model on the whole batch with the same SGD steps and
compares its stage's gradients (the last step's) and weights with it; exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.nn.functional as F

import collective as col

TOLERANCE = 1e-5
ACTIVATION, GRADIENT = 0, 1  # send/recv tags; each (src, dst, tag) is delivered in order


def full_model(stages: int, dim: int, hidden: int) -> dict[str, torch.Tensor]:
    """Every parameter of the unpipelined model, from one seed (every peer builds the same)."""
    torch.manual_seed(0)
    embed = torch.nn.Linear(dim, hidden)
    params = {"embed.weight": embed.weight, "embed.bias": embed.bias}
    for k in range(1, stages - 1):
        layer = torch.nn.Linear(hidden, hidden)
        params |= {f"mid{k}.weight": layer.weight, f"mid{k}.bias": layer.bias}
    params["head.bias"] = torch.zeros(dim)
    return {name: p.detach().clone().requires_grad_() for name, p in params.items()}


def stage_forward(stage: int, stages: int, p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    if stage == 0:
        return torch.tanh(F.linear(h, p["embed.weight"], p["embed.bias"]))
    if stage == stages - 1:
        return h @ p["embed.weight"] + p["head.bias"]  # the tied decoder
    return torch.tanh(F.linear(h, p[f"mid{stage}.weight"], p[f"mid{stage}.bias"]))


def stage_params(stage: int, stages: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if stage == 0:
        names = ["embed.weight", "embed.bias"]
    elif stage == stages - 1:
        names = ["embed.weight", "head.bias"]  # a copy of E, kept equal by summing the gradients
    else:
        names = [f"mid{stage}.weight", f"mid{stage}.bias"]
    return {name: full[name].detach().clone().requires_grad_() for name in names}


def micro_batches(step: int, count: int, rows: int, dim: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step)
    return list(torch.randn(count * rows, dim, generator=generator).chunk(count))


class Stage:
    """One stage's part of the 1F1B schedule: its forwards and backwards over the micro-batches."""

    def __init__(
        self, peer: int, stages: int, params: dict[str, torch.Tensor], args: argparse.Namespace
    ) -> None:
        self.peer, self.stages, self.params, self.args = peer, stages, params, args
        self.alive: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (input, output)
        self.most_alive = 0

    def forward(self, i: int, batches: list[torch.Tensor]) -> None:
        s, last = self.peer, self.peer == self.stages - 1
        if s == 0:
            h = batches[i]
        else:
            h = col.recv(s, src=s - 1, tag=ACTIVATION, out=torch.empty(self.args.rows, self.args.hidden))
            h.requires_grad_()
        out = stage_forward(s, self.stages, self.params, h)
        if last:
            out = F.mse_loss(out, batches[i]) / len(batches)  # the mean over micro-batches
        else:
            col.send(s, out.detach(), dst=s + 1, tag=ACTIVATION)
        self.alive[i] = (h, out)
        self.most_alive = max(self.most_alive, len(self.alive))

    def backward(self, i: int) -> None:
        s = self.peer
        h, out = self.alive.pop(i)
        if s == self.stages - 1:
            out.backward()
        else:
            out.backward(col.recv(s, src=s + 1, tag=GRADIENT, out=torch.empty_like(out)))
        if s > 0:
            col.send(s, h.grad, dst=s - 1, tag=GRADIENT)

    def step(self, batches: list[torch.Tensor]) -> None:
        """One 1F1B pass over every micro-batch (gradients accumulate into the parameters)."""
        m = len(batches)
        warmup = min(self.stages - self.peer - 1, m)
        for i in range(warmup):
            self.forward(i, batches)
        for i in range(m - warmup):
            self.forward(warmup + i, batches)
            self.backward(i)
        for i in range(m - warmup, m):
            self.backward(i)


def sgd(params: dict[str, torch.Tensor], names: list[str], lr: float) -> None:
    with torch.no_grad():
        for name in names:
            grad = params[name].grad
            assert grad is not None
            params[name] -= lr * grad


def train(peer: int, stages: int, args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], int]:
    """The pipelined training: this stage's parameters after ``--steps`` steps, and its peak activations."""
    params = stage_params(peer, stages, full_model(stages, args.dim, args.hidden))
    stage = Stage(peer, stages, params, args)
    tied = col.new_group([0, stages - 1])  # the two holders of E
    for step in range(args.steps):
        for p in params.values():
            p.grad = None
        stage.step(micro_batches(step, args.micro, args.rows, args.dim))
        others = [name for name in params if name != "embed.weight"]
        if "embed.weight" in params:  # started now; waited on only when E is updated
            e = params["embed.weight"]
            work = col.all_reduce(peer, e.grad, op="sum", group=tied, async_op=True, out=e.grad)
            sgd(params, others, args.lr)
            work.wait()
            sgd(params, ["embed.weight"], args.lr)
        else:
            sgd(params, others, args.lr)
    return params, stage.most_alive


def reference(stages: int, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The unpipelined model, one process, the whole batch, the same SGD steps."""
    params = full_model(stages, args.dim, args.hidden)
    for step in range(args.steps):
        for p in params.values():
            p.grad = None
        x = torch.cat(micro_batches(step, args.micro, args.rows, args.dim))
        h = x
        for s in range(stages):
            h = stage_forward(s, stages, params, h)
        F.mse_loss(h, x).backward()
        sgd(params, list(params), args.lr)
    return params


def difference(got: Any, want: Any) -> float:
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--tiny", action="store_true", help="small layers (CI)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.dim, args.hidden, args.rows, args.micro, args.steps = 8, 16, 2, 6, 2
    torch.set_num_threads(1)

    peer = col.init()
    stages = col.world_size()
    if stages < 2:
        print("pipeline_parallel: needs at least 2 peers (one per stage)", file=sys.stderr)
        col.finish(peer)
        return 2
    params, most_alive = train(peer, stages, args)
    expected = reference(stages, args)
    errors = {
        name: (difference(p.grad, expected[name].grad), difference(p.detach(), expected[name].detach()))
        for name, p in params.items()
    }
    error = max(max(pair) for pair in errors.values())
    ok = error <= TOLERANCE and most_alive <= stages - peer
    if peer == 0:
        print(
            f"pipeline_parallel: {stages} stages, 1F1B over {args.micro} micro-batches of {args.rows} "
            f"rows, {args.steps} steps; E tied between stages 0 and {stages - 1}"
        )
    verdict = "OK" if ok else "FAILED"
    print(
        f"pipeline_parallel: stage {peer}: {verdict}: gradients and weights vs unpipelined, max rel err "
        f"{error:.1e}; at most {most_alive} micro-batches in flight (1F1B bound {stages - peer})",
        flush=True,
    )
    col.finish(peer)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
