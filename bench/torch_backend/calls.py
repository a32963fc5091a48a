"""The torch backend "collective" against gloo, call by call, in the same processes and the same run.

    python -m collective.bench.torch_backend.calls                 # send/recv round trip
    python -m collective.bench.torch_backend.calls --op all_reduce --dtype float16 --dtype bfloat16
    python -m collective.bench.torch_backend.calls --op pingpong --sizes 8,1024,1048576 --rounds 9
    python -m collective.bench.torch_backend.calls --op decode --sizes 16384   # per token

Two processes of this host (``--ranks``) init torch.distributed with our backend and make a gloo
group of the same ranks, and a group of ours made with COLLECTIVE_TORCH_REPEAT=0 (``repeat=0``:
an all_reduce repeated on the same tensor is checked and agreed anew, not run as its kept call).
Every round times each group in turn on the same tensor (``--iters`` calls back to back after a
barrier: a send/recv round trip between rank 0 and rank 1 for ``pingpong``, an all_reduce SUM
for ``all_reduce``); the table gives the median per call over the rounds, ours beside gloo's and
their ratio. ``--json FILE`` keeps every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from collective.bench.torch_backend.ranks import run_ranks

__all__ = ["main"]

SIZES = (8, 1024, 65536, 1 << 20)


def _time(call: Any, iters: int, dist: Any, group: Any) -> float:
    """Seconds per call, after a barrier of ``group``."""
    call()  # (warm: buffers, connections)
    dist.barrier(group=group)
    started = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - started) / iters


def _pingpong(dist: Any, rank: int, x: Any, group: Any) -> None:
    """A round trip between rank 0 and rank 1 (the others wait at the next barrier)."""
    if rank == 0:
        dist.send(x, 1, group=group)
        dist.recv(x, 1, group=group)
    elif rank == 1:
        dist.recv(x, 0, group=group)
        dist.send(x, 0, group=group)


def _all_reduce(dist: Any, rank: int, x: Any, group: Any) -> None:
    dist.all_reduce(x, group=group)
    x.fill_(1)  # (the same sums every call: no overflow, no infinities)


DECODE_CALLS = 64  # a decode step of a tensor-parallel model: 32 layers, 2 all_reduces each


def _decode(dist: Any, rank: int, x: Any, group: Any, activation: Any) -> None:
    """One token: every layer's two all_reduces of the activation, each copied in first."""
    for _ in range(DECODE_CALLS):
        x.copy_(activation)
        dist.all_reduce(x, group=group)


_CALLS: dict[str, Callable[..., None]] = {"pingpong": _pingpong, "all_reduce": _all_reduce, "decode": _decode}


def worker(args: argparse.Namespace) -> None:
    """One rank: every (op, dtype, size) case, both backends taking turns each round."""
    import torch
    import torch.distributed as dist

    from collective.torch import REPEAT_VARIABLE

    dist.init_process_group("collective")
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    os.environ[REPEAT_VARIABLE] = "0"
    anew = dist.new_group(backend="collective")
    del os.environ[REPEAT_VARIABLE]
    groups = {"collective": None, "repeat=0": anew, "gloo": gloo}
    rows: list[dict[str, Any]] = []
    for op in args.op:
        for dtype_name in args.dtype:
            dtype = getattr(torch, dtype_name)
            for size in args.sizes:
                count = max(1, size // torch.empty(0, dtype=dtype).element_size())
                x = torch.ones(count, dtype=dtype)
                iters = max(3, min(args.iters, (64 << 20) // max(size, 1)))
                iters = max(3, iters // DECODE_CALLS) if op == "decode" else iters
                figures: dict[str, list[float]] = {name: [] for name in groups}
                extra = (torch.full_like(x, 1.0 / (rank + 2)),) if op == "decode" else ()
                for _ in range(args.rounds):
                    for name, group in groups.items():
                        call = partial(_CALLS[op], dist, rank, x, group, *extra)
                        figures[name].append(_time(call, iters, dist, group))
                row = {
                    "op": op,
                    "dtype": dtype_name,
                    "bytes": count * x.element_size(),
                    **{name: statistics.median(values) for name, values in figures.items()},
                }
                rows.append(row)
                if rank == 0:
                    print(
                        f"{op:>10} {dtype_name:>9} {row['bytes']:>10} {row['collective'] * 1e6:>11.1f} "
                        f"{row['repeat=0'] * 1e6:>9.1f} {row['gloo'] * 1e6:>11.1f} "
                        f"{row['collective'] / row['gloo']:>7.2f}",
                        flush=True,
                    )
    if rank == 0 and args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    dist.destroy_process_group()


def _sizes(text: str) -> list[int]:
    return [int(value) for value in text.split(",")]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m collective.bench.torch_backend.calls", description=__doc__
    )
    parser.add_argument("--op", action="append", choices=tuple(_CALLS), help="repeatable; default pingpong")
    parser.add_argument("--dtype", action="append", help="torch dtype name (repeatable; default float32)")
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=list(SIZES),
        help="bytes, comma separated (default 8,1024,65536,1048576)",
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=200, help="calls per round (fewer for large sizes)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.op = args.op or ["pingpong"]
    args.dtype = args.dtype or ["float32"]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    argv = list(sys.argv[1:] if argv is None else argv)
    print(
        f"# {args.ranks} processes; us per call, median of {args.rounds} rounds (pingpong: a round "
        f"trip; decode: a token, {DECODE_CALLS} all_reduces)"
    )
    header = (
        f"{'op':>10} {'dtype':>9} {'bytes':>10} {'collective':>11} {'repeat=0':>9} {'gloo':>11} {'ratio':>7}"
    )
    print(header, flush=True)
    return run_ranks("collective.bench.torch_backend.calls", argv, args.ranks)


if __name__ == "__main__":
    sys.exit(main())
