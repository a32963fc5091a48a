"""A job on several hosts whose hosts run several of its processes: the host tier beside the flat
multi-node path and gloo, in one run.

    python -m collective.bench.studies.host_tier [--hosts aabb] [--sizes 8,64K,1M,16M] [--repeats 3]

Every process runs on this machine; ``COLLECTIVE_HOST_ID`` gives each the host a letter of
``--hosts`` names, so processes of one letter may share memory and those of different letters
talk over TCP only, as on separate machines. Three systems take turns ``--repeats`` times:

* ``tier``: ours, each host's processes meeting in shared memory, their leaders over ZeroMQ
  (collective.executors.host_tier);
* ``flat``: ours without shared memory between processes (``COLLECTIVE_SHM=0``): every process a
  node of the ZeroMQ phase, as every multi-node job ran before the host tier;
* ``gloo``: torch.distributed's gloo with the same number of processes (it has no notion of hosts
  here: it is the reference a user would compare with).

A cell is the median over the repeats of each run's median (the slowest process's time per call,
bench/shm_worker.py's method). The figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from collective.bench.report import format_size, parse_size
from collective.bench.shm_vs_gloo import available, factor, run_system

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", default="aabb", help="one letter per process: its host (default aabb)")
    parser.add_argument("--ops", default="all_reduce,broadcast,all_gather", help="comma-separated")
    parser.add_argument("--sizes", default="8,64K,1M,16M", help="bytes, nccl-tests' convention")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each system, taking turns")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timed calls per case and run")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    args = parser.parse_args(argv)
    hosts, world = args.hosts, len(args.hosts)
    cases = [(op, parse_size(size)) for op in args.ops.split(",") for size in args.sizes.split(",")]
    variants: dict[str, tuple[str, Any]] = {
        "tier": ("ours", lambda rank: {"COLLECTIVE_HOST_ID": hosts[rank]}),
        "flat": ("ours", lambda rank: {"COLLECTIVE_HOST_ID": hosts[rank], "COLLECTIVE_SHM": "0"}),
    }
    if available("gloo"):
        variants["gloo"] = ("gloo", None)
    samples: dict[tuple[str, str, int], list[float]] = {}
    wrong = 0
    for _ in range(args.repeats):
        for name, (system, rank_env) in variants.items():
            for row in run_system(system, world, cases, args.budget, args.timeout, rank_env):
                samples.setdefault((name, row["op"], row["size"]), []).append(row["median_us"])
                wrong += row["wrong"]
    names = list(variants)
    print(
        f"# {world} processes on hosts {hosts}; float32, sum, root 0; medians of {args.repeats} runs; "
        "busbw in GB/s"
    )
    print(
        f"{'op':>12} {'size':>6}"
        + "".join(f" {n + ' us':>10} {n + ' busbw':>11}" for n in names)
        + "  tier/flat"
        + ("  tier/gloo" if "gloo" in names else "")
    )
    for op, size in cases:
        times = {n: statistics.median(samples[(n, op, size)]) for n in names if (n, op, size) in samples}
        line = f"{op:>12} {format_size(size):>6}"
        for n in names:
            t = times.get(n)
            line += (
                f" {t:>10.1f} {size / (t * 1e-6) / 1e9 * factor(op, world):>11.3f}"
                if t
                else f" {'-':>10} {'-':>11}"
            )
        if "tier" in times and "flat" in times:
            line += f"  {times['tier'] / times['flat']:>8.2f}x"
        if "tier" in times and "gloo" in times:
            line += f"  {times['tier'] / times['gloo']:>8.2f}x"
        print(line)
    print(f"# wrong result elements: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
