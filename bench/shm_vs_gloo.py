"""Same-host processes: our shared-memory collectives beside gloo and MPI, in one run.

    python -m collective.bench.shm_vs_gloo                       # the issue's targets
    python -m collective.bench.shm_vs_gloo --worlds 2 --ops all_reduce --sizes 8,1M,64M --repeats 3
    python -m collective.bench.shm_vs_gloo --worlds 2 --ops decode --sizes 16K --systems ours,persistent,gloo

For every world size, each system runs as that many processes on this machine (ours: one peer
per process, meeting through an orchestrator, its calls on the same arrays kept after the first
(collective.persistent.kept); ``anew``: ours with every call made anew (COLLECTIVE_REPEAT=0);
``persistent``: ours with persistent collectives, one handle per case; gloo: torch.distributed;
MPI: mpi4py under mpirun, where both are installed), the systems taking turns ``--repeats``
times. Every process times every case with the same method (bench/shm_worker.py); a table cell
is the median over the repeats of each run's median. Then the issue's targets are checked
against gloo (and MPI for the stretch), and ours and persistent against their own bounds:

* 2 processes, all_reduce, all_gather, reduce_scatter, broadcast: 8 B at most 0.1 x gloo's time,
  1 MiB at most 0.5 x, 64 MiB bus bandwidth at least 1.5 x gloo's (stretch: 8 B within 5 x MPI);
* 4 processes (on 2 cores here: oversubscribed), all_reduce: 8 B at most 0.5 x gloo's time,
  64 MiB bus bandwidth at least gloo's;
* 2 processes, all_reduce 8 B: ours at most 12 us, persistent at most 5 us and 5 x MPI's, 64 KiB
  persistent at most 1.5 x MPI's; 4 processes 8 B persistent at most 0.1 x gloo's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from collective.bench.jobs.multinode import collect_lines
from collective.bench.report import format_size, parse_size
from collective.launch import free_port, node_environment, start_orchestrator, stop_processes

__all__ = ["main"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def factor(op: str, world: int) -> float:
    """nccl-tests' bus bandwidth factor."""
    return {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0}.get(op, (world - 1) / world)


TARGETS = {  # (world, op, size) -> (what, bound): our time / gloo's at most ``bound``
    **{(2, op, 8): ("time", 0.1) for op in OPS},
    **{(2, op, 1 << 20): ("time", 0.5) for op in OPS},
    **{(2, op, 64 << 20): ("busbw", 1.5) for op in OPS},
    (4, "all_reduce", 8): ("time", 0.5),
    (4, "all_reduce", 64 << 20): ("busbw", 1.0),
}


CALL_TARGETS = {  # (world, op, size) -> (bound, what): ours (normal calls, kept) at most ``bound`` us
    (2, "all_reduce", 8): (12.0, "time <= 12 us"),
}


PERSISTENT_TARGETS = {  # (world, op, size) -> (against, bound, what): persistent / against at most bound
    (2, "all_reduce", 8): (("us", 5.0, "time <= 5 us"), ("mpi", 5.0, "time <= 5 x MPI")),
    (2, "all_reduce", 64 << 10): (("mpi", 1.5, "time <= 1.5 x MPI"),),
    (4, "all_reduce", 8): (("gloo", 0.1, "time <= 0.1 x gloo"),),
}


def available(system: str) -> bool:
    if system == "gloo":
        return importlib.util.find_spec("torch") is not None
    if system == "mpi":
        return importlib.util.find_spec("mpi4py") is not None and shutil.which("mpirun") is not None
    return True


def _worker(system: str, plan: str) -> list[str]:
    return [sys.executable, "-m", "collective.bench.shm_worker", system, plan]


def run_system(
    system: str,
    world: int,
    cases: list[tuple[str, int]],
    budget: float,
    timeout: float,
    rank_env: Callable[[int], dict[str, str]] | None = None,
) -> list[Any]:
    """One run of ``system`` with ``world`` processes over ``cases``: the rows rank 0 printed.
    ``rank_env(rank)``: more environment variables of our rank ``rank`` (e.g. its host's name)."""
    plan = json.dumps({"cases": cases, "budget": budget, "warmup": 3})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    processes: list[subprocess.Popen[str]] = []
    orchestrator = None
    try:
        if system in ("ours", "anew", "persistent"):
            orchestrator, address = start_orchestrator()
            job = f"shm-bench-{os.getpid()}-{world}"
            for rank in range(world):
                environment = node_environment(address, job, rank, world, 1, env)
                environment.update(rank_env(rank) if rank_env is not None else {})
                processes.append(_spawn(_worker(system, plan), environment))
        elif system == "gloo":
            port = str(free_port())
            for rank in range(world):
                environment = dict(
                    env,
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                    RANK=str(rank),
                    WORLD_SIZE=str(world),
                    GLOO_SOCKET_IFNAME="lo",
                )
                processes.append(_spawn(_worker(system, plan), environment))
        else:
            mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(world)]
            processes.append(_spawn(mpirun + _worker(system, plan), env))
        lines = collect_lines(processes, system, timeout)
        return [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
    finally:
        stop_processes([*processes, *([orchestrator] if orchestrator else [])])


def _spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def plan_of(args: argparse.Namespace) -> dict[int, list[tuple[str, int]]]:
    """world -> its cases: what the arguments name, else the issue's targets."""
    if args.ops or args.sizes or args.worlds:
        ops = args.ops.split(",") if args.ops else list(OPS)
        sizes = [parse_size(s) for s in (args.sizes or "8,1M,64M").split(",")]
        worlds = [int(w) for w in (args.worlds or "2").split(",")]
        return {world: [(op, size) for op in ops for size in sizes] for world in worlds}
    return {
        2: [(op, size) for op in OPS for size in (8, 1 << 20, 64 << 20)],
        4: [("all_reduce", 8), ("all_reduce", 64 << 20)],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", help="process counts, e.g. 2,4 (default: the targets' plan)")
    parser.add_argument("--ops", help=f"comma-separated, of {', '.join(OPS)}")
    parser.add_argument("--sizes", help="e.g. 8,1M,64M (bytes, nccl-tests' convention)")
    parser.add_argument(
        "--systems",
        default="ours,gloo,mpi",
        help="of ours,anew,persistent,gloo,mpi; default ours,gloo,mpi (those installed)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each system, taking turns (default 3)"
    )
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timed calls per case and run")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--json", metavar="FILE", help="also write every run's rows here")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if available(s)]
    missing = sorted(set(args.systems.split(",")) - set(systems))
    if missing:
        print(f"# not installed, skipped: {', '.join(missing)}", file=sys.stderr)
    plan = plan_of(args)
    samples: dict[tuple[str, int, str, int], list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for world, cases in plan.items():
            for system in systems:
                for row in run_system(system, world, cases, args.budget, args.timeout):
                    samples.setdefault((system, world, row["op"], row["size"]), []).append(row)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {"command": sys.argv, "rows": [r for rows in samples.values() for r in rows]},
                handle,
                indent=1,
            )
    return report(plan, systems, samples, args.repeats)


def report(
    plan: dict[int, list[tuple[str, int]]],
    systems: list[str],
    samples: dict[tuple[str, int, str, int], list[dict[str, Any]]],
    repeats: int,
) -> int:
    """Print the table and the targets; 1 if any result was wrong."""

    def median(system: str, world: int, op: str, size: int) -> float | None:
        rows = samples.get((system, world, op, size))
        return statistics.median(r["median_us"] for r in rows) if rows else None

    wrong = sum(r["wrong"] for rows in samples.values() for r in rows)
    print(
        f"# float32, sum, root 0; medians of {repeats} runs per system (each the median over iterations"
        " of the slowest process's time); busbw in GB/s"
    )
    header = f"{'procs':>5} {'op':>15} {'size':>8}" + "".join(
        f" {s + ' us':>11} {s + ' busbw':>11}" for s in systems
    )
    print(header + ("  ours/gloo" if "gloo" in systems and "ours" in systems else ""))
    verdicts = []
    for world, cases in plan.items():
        for op, size in cases:
            times = {s: median(s, world, op, size) for s in systems}
            line = f"{world:>5} {op:>15} {format_size(size):>8}"
            for system in systems:
                t = times[system]
                busbw = size / (t * 1e-6) / 1e9 * factor(op, world) if t else 0.0
                line += f" {t:>11.1f} {busbw:>11.3f}" if t else f" {'-':>11} {'-':>11}"
            ours, gloo, mpi = times.get("ours"), times.get("gloo"), times.get("mpi")
            if ours and gloo:
                line += f"  {ours / gloo:>8.2f}x"
                target = TARGETS.get((world, op, size))
                if target is not None:
                    what, bound = target
                    if what == "time":
                        verdicts.append(
                            (world, op, size, f"time <= {bound} x gloo", ours / gloo <= bound, ours / gloo)
                        )
                    else:
                        verdicts.append(
                            (world, op, size, f"busbw >= {bound} x gloo", gloo / ours >= bound, gloo / ours)
                        )
            if ours and mpi and size <= 8 and world == 2:
                verdicts.append((world, op, size, "stretch: time <= 5 x MPI", ours / mpi <= 5, ours / mpi))
            call_target = CALL_TARGETS.get((world, op, size))
            if ours and call_target is not None:
                bound, text = call_target
                verdicts.append((world, op, size, f"normal call {text}", ours <= bound, ours))
            kept = times.get("persistent")  # (persistent collectives' targets: at most 5 us, ...)
            for other, bound, text in PERSISTENT_TARGETS.get((world, op, size), ()):
                base = {"us": 1.0, "mpi": mpi, "gloo": gloo}[other]
                if kept and base:
                    ratio = kept / base
                    verdicts.append((world, op, size, f"persistent {text}", ratio <= bound, ratio))
            print(line)
    for world, cases in plan.items():  # (a decode step is one token: 64 all_reduces)
        for op, size in cases:
            tokens = {s: 1e6 / t for s in systems if op == "decode" and (t := median(s, world, op, size))}
            if tokens:
                said = ", ".join(f"{system} {rate:.0f}" for system, rate in tokens.items())
                print(f"# decode, {world} procs, {format_size(size)} per all_reduce: tokens/s {said}")
    for world, op, size, text, ok, value in verdicts:
        verdict = "met" if ok else "NOT met"
        print(f"# target {world} procs {op} {format_size(size)}: {text}: {verdict} ({value:.2f})")
    print(f"# wrong result elements: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
