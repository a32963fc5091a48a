"""``collective tune``: time every schedule across sizes on this layout and write a profile.

The sweep is ``collective bench``'s (local peers, ``--nodes`` processes, ``--hosts`` emulated
hosts), one job per schedule; each row becomes a point of that schedule's curve at the key the
runtime uses for the layout (collective.tuning.model.Key), and the curves go to a profile file
(collective.tuning.profile) that a job reads when COLLECTIVE_PROFILE names it. Threads time only
calls above the shared path's limit (4 MiB per peer): below it numpy arrays take no schedule.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import IO

from collective.algorithms.strategies import parse_strategy
from collective.bench import cli as bench
from collective.bench.jobs.hosts import unavailable
from collective.bench.ops import shapes
from collective.bench.report import format_size
from collective.bench.sweep import Case, Row, resolve_dtype
from collective.executors import DEFAULT_SHARE_BELOW
from collective.launch import Stopped, stop_status, stopped_by_signals
from collective.tuning.model import Curve, Figures, Key, candidates
from collective.tuning.profile import save

__all__ = ["TUNED_OPS", "add_arguments", "layout_key", "main", "run"]

TUNED_OPS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench.add_arguments(parser)
    parser.set_defaults(minbytes=128 << 10, maxbytes=64 << 20, stepfactor=4, warmup=2, iters=5)
    parser.add_argument(
        "-o",
        "--output",
        default="collective-profile.json",
        help="the profile to write (default collective-profile.json); run jobs with COLLECTIVE_PROFILE=FILE",
    )


def layout_key(kind: str, peers: int, nodes: int, hosts: int | None) -> Key | None:
    """Where the schedule of a job of ``hosts`` x ``nodes`` processes x ``peers`` threads runs (the
    runtime's collective.executors.schedule_key for the whole job); None: shared memory, no schedule."""
    hosts = hosts or 1
    if hosts == 1:
        if nodes == 1:
            return Key("inproc", kind, peers)
        return None if peers == 1 else Key("zmq", kind, nodes, 1, peers)
    if peers == 1:
        return Key("zmq", kind, hosts, hosts, nodes)  # (a host tier when nodes > 1)
    return Key("zmq", kind, hosts * nodes, hosts, peers)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str], out: IO[str]) -> int:
    with stopped_by_signals():
        try:
            return _run(args, parser, argv, out)
        except Stopped as stop:
            print(f"collective tune: stopped by signal {stop.signum}", file=sys.stderr)
            return stop_status(stop)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str], out: IO[str]) -> int:
    if args.backend != "collective" or args.compare:
        parser.error("argument --backend/--compare: collective tune times our schedules only")
    if args.link is not None and args.hosts is None:
        parser.error("argument --link: shapes the links of emulated hosts: give --hosts too")
    if args.hosts is not None and (reason := unavailable()) is not None:
        parser.error(f"argument --hosts: {reason}")
    if args.minbytes > args.maxbytes:
        parser.error(f"argument -b/--minbytes: {args.minbytes} is larger than -e/--maxbytes {args.maxbytes}")
    if (problem := bench.unwritable(args.output)) is not None:
        parser.error(f"argument --output: {problem}")
    args.peers = (4 if args.hosts is None else 1) if args.peers is None else args.peers
    if layout_key("all_reduce", args.peers, args.nodes, args.hosts) is None:
        parser.error(
            "processes of one host with one peer each run on shared memory, which has no schedule to "
            "choose: tune threads (--peers), several peers per process, or --hosts"
        )
    ops = [op for op in (args.op or TUNED_OPS) if op != "all"] or list(TUNED_OPS)
    unknown = [op for op in ops if op not in TUNED_OPS]
    if unknown:
        parser.error(
            f"argument --op: collective tune measures {', '.join(TUNED_OPS)}; not {', '.join(unknown)}"
        )
    try:
        dtype = resolve_dtype(args.dtype)
    except ImportError:
        parser.error("argument --dtype: bfloat16 needs ml_dtypes (pip install ml_dtypes)")
    world = bench.world_of(args)
    sizes = bench.sweep_sizes(args, dtype.itemsize)
    named = [str(parse_strategy(s)) for s in args.strategy or [] if s != "all"]
    threads = args.nodes == 1 and not args.hosts
    cases = [
        Case("collective", op, strategy, world, size, args.dtype, args.reduce_op, 0)
        for op in ops
        for strategy in (named or _candidates(op, args))
        for size in bench.moved_sizes(op, sizes, world, dtype.itemsize)
        if not threads or _input_bytes(op, size, world, dtype.itemsize) > DEFAULT_SHARE_BELOW
    ]
    if not cases:
        parser.error(
            f"argument -e/--maxbytes: threads run numpy arrays of up to {format_size(DEFAULT_SHARE_BELOW)} "
            f"on their fast paths, not a schedule: tune larger sizes"
        )
    print(
        f"# collective tune: {len(cases)} rows, sizes {format_size(sizes[0])} .. {format_size(sizes[-1])}, "
        f"{args.warmup} warm-up + {args.iters} timed iterations per row",
        file=out,
    )
    rows, interrupted = bench.measure_cases(cases, args, sys.stderr)
    if interrupted:
        print("# interrupted: no profile written", file=out)
        return interrupted
    wrong = sum(row.wrong for row in rows)
    if wrong:
        print(f"collective tune: {wrong} wrong result elements: no profile written", file=sys.stderr)
        return 1
    figures = figures_of(rows, args)
    save(figures, args.output, " ".join(argv))
    for (key, strategy), curve in sorted(figures.curves.items()):
        times = ", ".join(f"{format_size(b)} {t * 1e6:.0f} us" for b, t in curve.points)
        print(f"{key.kind:>15} {strategy:<12} {times}", file=out)
    print(f"# profile written to {args.output}: run jobs with COLLECTIVE_PROFILE={args.output}", file=out)
    return 0


def _candidates(op: str, args: argparse.Namespace) -> tuple[str, ...]:
    key = layout_key(op, args.peers, args.nodes, args.hosts)
    assert key is not None
    return candidates(op, key.participants)


def _input_bytes(op: str, size: int, peers: int, itemsize: int) -> int:
    """The bytes each peer passes in a bench row of ``size`` (nccl-tests' size: the whole buffer)."""
    return shapes(op, size // itemsize, peers).input * itemsize


def figures_of(rows: Sequence[Row], args: argparse.Namespace) -> Figures:
    """Every row as a point of its schedule's curve: (bytes each peer passes, median seconds)."""
    points: dict[tuple[Key, str], dict[int, float]] = {}
    for row in rows:
        case = row.case
        key = layout_key(case.op, args.peers, args.nodes, args.hosts)
        assert key is not None
        nbytes = _input_bytes(case.op, case.size, case.peers, resolve_dtype(case.dtype).itemsize)
        points.setdefault((key, case.strategy), {})[nbytes] = max(row.time_us * 1e-6, 1e-9)
    figures = Figures("profile")
    figures.curves = {where: Curve(tuple(sorted(found.items()))) for where, found in points.items()}
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="collective tune", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(
        args, parser, ["collective", "tune", *(argv if argv is not None else sys.argv[1:])], sys.stdout
    )
