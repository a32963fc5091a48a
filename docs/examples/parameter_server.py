"""Parameter servers: workers compute gradients, a server tier averages them and runs the optimizer.

    collective launch --nodes 3 docs/examples/parameter_server.py --tiny              # 2-tier
    collective launch --nodes 4 docs/examples/parameter_server.py --workers 2 --tiny  # 3-tier
    torchrun --nproc-per-node 5 docs/examples/parameter_server.py --workers 4

The layout follows from the world size: world = workers + 1 is the 2-tier layout, world =
workers + 2 the 3-tier one (``--workers`` defaults to world - 1). Peers 0 .. W-1 are workers.

2-tier (peer W: aggregator and optimiser in one)::

    server --broadcast (whole job)--> workers         the current weights
    workers --reduce(sum, root W)--> server           the gradients; server: / W, optimizer step

3-tier (peer W: the aggregator, peer W+1: the optimiser, outside the workers' group)::

    optimiser --send--> aggregator --broadcast (group of workers + aggregator)--> workers
    workers --gather (same group, root W)--> aggregator: mean of the workers' rows
    aggregator --send--> optimiser: optimizer step

The optimiser (SGD with momentum) is the only peer that holds optimizer state; workers hold no
weights of their own between steps. Every peer computes, on its own, a single process training
the same model on all workers' rows with the same optimizer, and compares the final weights (sent
to every peer at the end) with it; the script exits 1 if they differ.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import collective as col

TOLERANCE = 1e-5


def model(width: int) -> torch.nn.Sequential:
    torch.manual_seed(0)  # the server's initial weights; the workers take whatever it sends
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))


def rows_of(step: int, worker: int, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    x = torch.randn(rows, width, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def flat_grads(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    net.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(net(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


def flat_weights(net: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(net.parameters()).detach()


def load(net: torch.nn.Module, weights: torch.Tensor) -> None:
    torch.nn.utils.vector_to_parameters(weights, net.parameters())


class Optimiser:
    """The server's weights (flat) and SGD with momentum 0.9, as torch.optim.SGD computes it."""

    def __init__(self, width: int, lr: float) -> None:
        self.weights = flat_weights(model(width))
        self.velocity = torch.zeros_like(self.weights)
        self.lr = lr

    def apply(self, grad: torch.Tensor) -> torch.Tensor:
        """One step with an averaged flat gradient; the new weights."""
        self.velocity.mul_(0.9).add_(grad)
        self.weights = self.weights - self.lr * self.velocity
        return self.weights


def reference(args: argparse.Namespace) -> torch.Tensor:
    """One process, every worker's rows at once, the same optimizer."""
    single, net = Optimiser(args.width, args.lr), model(args.width)
    for step in range(args.steps):
        batches = [rows_of(step, w, args.rows, args.width) for w in range(args.workers)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        load(net, single.weights)
        single.apply(flat_grads(net, x, y))
    return single.weights


def two_tier(peer: int, args: argparse.Namespace) -> torch.Tensor:
    """Workers 0..W-1 and the server W: reduce up, broadcast down, on the whole job."""
    server = args.workers
    replica = model(args.width)
    optimiser = Optimiser(args.width, args.lr) if peer == server else None
    weights = optimiser.weights if optimiser else flat_weights(replica)
    for step in range(args.steps):
        weights = col.broadcast(peer, weights if optimiser else None, out=None if optimiser else weights)
        if optimiser is None:
            load(replica, weights)
            grad = flat_grads(replica, *rows_of(step, peer, args.rows, args.width))
            col.reduce(peer, grad, op="sum", root=server)
        else:
            total = col.reduce(peer, torch.zeros_like(weights), op="sum", root=server)
            weights = optimiser.apply(total / args.workers)
    return col.broadcast(peer, weights if optimiser else None, out=None if optimiser else weights)


def three_tier(peer: int, args: argparse.Namespace) -> torch.Tensor:
    """Workers 0..W-1, the aggregator W and the optimiser W+1; the optimiser is in no group of theirs."""
    aggregator, optimiser_peer = args.workers, args.workers + 1
    shape = flat_weights(model(args.width)).shape
    if peer == optimiser_peer:
        optimiser = Optimiser(args.width, args.lr)
        weights, grad = optimiser.weights, torch.empty(shape)
        for _ in range(args.steps):
            col.send(peer, weights, dst=aggregator, tag=1)
            weights = optimiser.apply(col.recv(peer, src=aggregator, tag=0, out=grad))
        col.send(peer, weights, dst=aggregator, tag=1)
        return weights
    workers = col.new_group(range(args.workers + 1))  # the workers and the aggregator
    replica = model(args.width)
    weights = torch.empty(shape)
    for step in range(args.steps + 1):
        if peer == aggregator:
            col.recv(peer, src=optimiser_peer, tag=1, out=weights)
            col.broadcast(peer, weights, group=workers)
        else:
            weights = col.broadcast(peer, None, group=workers, out=weights)
        if step == args.steps:  # the final weights
            break
        if peer == aggregator:
            rows = col.gather(peer, torch.zeros(shape), root=aggregator, group=workers)
            col.send(peer, rows[: args.workers].mean(dim=0), dst=optimiser_peer, tag=0)
        else:
            load(replica, weights)
            grad = flat_grads(replica, *rows_of(step, peer, args.rows, args.width))
            col.gather(peer, grad, root=aggregator, group=workers)
    return weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, help="worker peers (default: world - 1, the 2-tier layout)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=64, help="rows per worker per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--tiny", action="store_true", help="a small model and few steps (CI)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.width, args.rows, args.steps = 16, 8, 3
    torch.set_num_threads(1)

    peer = col.init()
    world = col.world_size()
    args.workers = world - 1 if args.workers is None else args.workers
    tiers = {args.workers + 1: 2, args.workers + 2: 3}.get(world)
    if tiers is None or args.workers < 1:
        if peer == 0:
            print(
                f"parameter_server: {world} peers cannot hold {args.workers} workers: world must be "
                f"workers + 1 (2-tier) or workers + 2 (3-tier)",
                file=sys.stderr,
            )
        col.finish(peer)
        return 2
    roles = ["worker"] * args.workers + (["server"] if tiers == 2 else ["aggregator", "optimiser"])
    started = time.perf_counter()
    final = (two_tier if tiers == 2 else three_tier)(peer, args)
    seconds = time.perf_counter() - started
    expected = reference(args)
    error = float((final - expected).abs().max()) / max(1.0, float(expected.abs().max()))
    ok = error <= TOLERANCE
    if peer == world - 1:
        layout = "workers + aggregator-optimiser" if tiers == 2 else "workers + aggregator + optimiser"
        print(
            f"parameter_server: {tiers}-tier ({args.workers} {layout}), {args.steps} steps of "
            f"{final.numel():,} parameters in {seconds * 1e3:.0f} ms"
        )
    print(
        f"parameter_server: peer {peer} ({roles[peer]}): {'OK' if ok else 'FAILED'} vs the single-process "
        f"reference (max rel err {error:.1e}, tolerance {TOLERANCE:g})",
        flush=True,
    )
    col.finish(peer)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
