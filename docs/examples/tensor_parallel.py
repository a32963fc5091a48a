"""Tensor parallelism: column- and row-parallel linear layers over a group, checked against one layer.

    collective launch --nodes 2 docs/examples/tensor_parallel.py --tiny
    collective launch --nodes 4 docs/examples/tensor_parallel.py --tp 2 --tiny   # two groups of 2
    torchrun --nproc-per-node 4 docs/examples/tensor_parallel.py

A Linear layer y = x W^T + b split over the T peers of a group (Megatron-LM's layout)::

    column-parallel: W split by rows (output features)    row-parallel: W split by columns (inputs)
        peer i: y_i = x W_i^T + b_i                           peer i: y = sum_i x_i W_i^T + b
        forward: no communication (y stays split)             forward: one all_reduce of the partial y
        backward: dx = sum_i dy_i W_i: one all_reduce         backward: dx_i = dy W_i: none

Chained, column-parallel then an elementwise activation then row-parallel (a transformer's MLP),
the hidden activations never leave their peer: one all_reduce in forward, one in backward. The
column-parallel backward starts its all_reduce of dx asynchronously and computes dW while it
runs, waiting only when dx must be returned.

The peers are cut into groups of ``--tp`` consecutive peers (default: one group of all); each
group works on its own batch. Every peer builds the unsharded layers from the same seed, runs
them on its group's batch, and checks its output, dx and its shards of dW and db against them:
the column-parallel layer alone (its output all-gathered), the row-parallel layer alone, and the
chained MLP. Exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

import collective as col

TOLERANCE = 1e-5
CALLS = {"forward": 0, "backward": 0}  # the group's collectives this peer ran, by pass


class ColumnParallel(torch.autograd.Function):
    """y_i = x W_i^T + b_i; backward all-reduces dx over the group, overlapping dW's computation."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, tp: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.tp = tp
        return x @ weight.T + bias

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        peer, group = ctx.tp
        work = col.all_reduce(peer, dy @ weight, op="sum", group=group, async_op=True)  # partial dx
        CALLS["backward"] += 1
        dweight, dbias = dy.T @ x, dy.sum(dim=0)  # while the all_reduce runs
        return work.wait(), dweight, dbias, None


class RowParallel(torch.autograd.Function):
    """y = sum_i x_i W_i^T + b: one all_reduce in forward; backward is local."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, tp: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        peer, group = tp
        CALLS["forward"] += 1
        return col.all_reduce(peer, x @ weight.T, op="sum", group=group) + bias

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        return dy @ weight, dy.T @ x, dy.sum(dim=0), None


class GatherColumns(torch.autograd.Function):
    """The column-parallel output made whole: all_gather in forward, each peer's slice of dy back."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, tp: Any, rank: int) -> torch.Tensor:
        peer, group = tp
        ctx.rank, ctx.width = rank, y.shape[-1]
        CALLS["forward"] += 1
        parts = col.all_gather(peer, y.contiguous(), group=group)  # (T, rows, width / T)
        return torch.cat(list(parts), dim=-1)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        return dy[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None, None


class Shard(torch.nn.Module):
    """This peer's shard of a Linear layer: ``dim`` 0 splits the outputs (column-parallel), 1 the inputs."""

    def __init__(self, full: torch.nn.Linear, dim: int, rank: int, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(full.weight.detach().chunk(size, dim=dim)[rank].clone())
        bias = full.bias.detach().chunk(size)[rank] if dim == 0 else full.bias.detach()
        self.bias = torch.nn.Parameter(bias.clone())
        self.dim, self.rank, self.size = dim, rank, size

    def expected(self, full: torch.nn.Linear) -> list[torch.Tensor]:
        """The unsharded layer's gradients, cut as this shard's are."""
        assert full.weight.grad is not None and full.bias.grad is not None
        bias = full.bias.grad.chunk(self.size)[self.rank] if self.dim == 0 else full.bias.grad
        return [full.weight.grad.chunk(self.size, dim=self.dim)[self.rank], bias]


def difference(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(
        float((g - w).abs().max()) / max(1.0, float(w.abs().max())) for g, w in zip(got, want, strict=True)
    )


def check(
    name: str,
    sharded: Any,
    unsharded: Any,
    layers: list[tuple[Shard, torch.nn.Linear]],
    x: torch.Tensor,
    target: torch.Tensor,
    x_part: Any = lambda g: g,
) -> tuple[str, float, dict[str, int]]:
    """Forward and backward of ``sharded`` and ``unsharded`` on ``x``, compared (``x_part``: the
    part of dx this peer gets)."""
    calls = dict(CALLS)
    x_sharded, x_full = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = sharded(x_sharded)
    torch.nn.functional.mse_loss(y, target).backward()
    y_full = unsharded(x_full)
    torch.nn.functional.mse_loss(y_full, target).backward()
    got, want = [y.detach(), x_part(x_sharded.grad)], [y_full.detach(), x_part(x_full.grad)]
    for shard, full in layers:
        got += [shard.weight.grad, shard.bias.grad]
        want += shard.expected(full)
    return name, difference(got, want), {k: CALLS[k] - calls[k] for k in CALLS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, help="peers per tensor-parallel group (default: all)")
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="small layers (CI)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.inputs, args.hidden, args.rows = 8, 16, 4
    torch.set_num_threads(1)

    peer = col.init()
    world = col.world_size()
    tp = args.tp or world
    if world % tp or args.inputs % tp or args.hidden % tp:
        print(
            f"tensor_parallel: --tp {tp} must divide the world ({world}), --inputs and --hidden",
            file=sys.stderr,
        )
        col.finish(peer)
        return 2
    first = peer - peer % tp
    group = col.new_group(range(first, first + tp))
    rank = group.rank(peer)
    torch.manual_seed(0)  # every peer builds the same unsharded layers
    up, down = torch.nn.Linear(args.inputs, args.hidden), torch.nn.Linear(args.hidden, args.inputs)
    generator = torch.Generator().manual_seed(1 + first)  # one batch per group
    x = torch.randn(args.rows, args.inputs, generator=generator)
    target = torch.randn(args.rows, args.inputs, generator=generator)
    target_hidden = torch.randn(args.rows, args.hidden, generator=generator)
    where = (peer, group)
    column, row = Shard(up, 0, rank, tp), Shard(down, 1, rank, tp)
    hidden = torch.randn(args.rows, args.hidden, generator=generator)

    def column_alone(v: torch.Tensor) -> torch.Tensor:
        return GatherColumns.apply(ColumnParallel.apply(v, column.weight, column.bias, where), where, rank)

    def row_alone(v: torch.Tensor) -> torch.Tensor:
        return RowParallel.apply(v.chunk(tp, dim=-1)[rank], row.weight, row.bias, where)

    def mlp(v: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(ColumnParallel.apply(v, column.weight, column.bias, where))
        return RowParallel.apply(h, row.weight, row.bias, where)

    def mlp_unsharded(v: torch.Tensor) -> torch.Tensor:
        return down(torch.tanh(up(v)))

    def mine(dx: torch.Tensor) -> torch.Tensor:  # row-parallel alone: dx of this peer's inputs
        return dx.chunk(tp, dim=-1)[rank]

    results = [
        check("column-parallel (output gathered)", column_alone, up, [(column, up)], x, target_hidden),
        check("row-parallel (input split)", row_alone, down, [(row, down)], hidden, target, mine),
    ]
    column, row = Shard(up, 0, rank, tp), Shard(down, 1, rank, tp)  # fresh gradients for the chain
    up.zero_grad()
    down.zero_grad()
    results.append(
        check("column -> tanh -> row (MLP)", mlp, mlp_unsharded, [(column, up), (row, down)], x, target)
    )

    failed = [name for name, error, _ in results if error > TOLERANCE]
    if peer == 0:
        print(
            f"tensor_parallel: {world} peers in groups of {tp}, Linear({args.inputs}, {args.hidden}) and "
            f"Linear({args.hidden}, {args.inputs}), {args.rows} rows per group"
        )
        for name, error, used in results:
            print(
                f"  {name:<36} collectives: forward {used['forward']}, backward {used['backward']};"
                f" max rel err vs unsharded {error:.1e}"
            )
    verdict = "FAILED: " + ", ".join(failed) if failed else "OK"
    print(f"tensor_parallel: peer {peer} (rank {rank} of group {group.members}): {verdict}", flush=True)
    col.finish(peer)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
