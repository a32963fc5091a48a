"""``collective bench``: sweep ops x strategies x sizes on local peers and print nccl-tests tables."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import IO

from collective.algorithms.strategies import parse_strategy
from collective.bench.jobs.hosts import EmulatedHosts, link_bytes_per_second, unavailable
from collective.bench.jobs.multinode import run_gloo, run_nodes, torch_available
from collective.bench.ops import OPS, ROOTED, TRIVIAL_OPS, moved_bytes
from collective.bench.plot import MISSING as PLOT_MISSING
from collective.bench.plot import plot_rows
from collective.bench.report import (
    format_size,
    parse_size,
    print_auto_check,
    print_summary,
    print_table,
    write_json,
)
from collective.bench.sweep import Case, Row, resolve_dtype, run_case
from collective.errors import ConfigError
from collective.executors import DEFAULT_SHARE_BELOW
from collective.launch import Stopped, seconds_argument, stop_status, stopped_by_signals
from collective.trace import RECORDER, recorder
from collective.trace.analyze import load_dumps
from collective.trace.chrome import write as write_chrome_trace
from collective.transport.wire import SMALL_BYTES

__all__ = [
    "add_arguments",
    "main",
    "measure_cases",
    "moved_sizes",
    "run",
    "sweep_sizes",
    "unwritable",
    "world_of",
]

ALL_STRATEGIES = ("auto", "centralized", "tree:2", "ring", "direct")
DTYPES = (
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
)
REDUCE_OPS = ("sum", "mean", "max", "min", "prod")
DEFAULT_OPS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")


def _op(text: str) -> str:
    value = text.strip().lower().replace("-", "_")
    if value != "all" and value not in OPS:
        raise argparse.ArgumentTypeError(f"unknown op {text!r}: use one of {', '.join(OPS)}, or all")
    return value


def _strategy(text: str) -> str:
    if text.strip().lower() == "all":
        return "all"
    try:
        return str(parse_strategy(text))
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rate(text: str) -> str:
    try:
        link_bytes_per_second(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip().lower()


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return int(text)


def _factor(text: str) -> int:
    if not text.isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2, got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--op",
        type=_op,
        action="append",
        help=f"{', '.join(OPS)} or all (repeatable; default: {', '.join(DEFAULT_OPS)})",
    )
    parser.add_argument(
        "--strategy",
        type=_strategy,
        action="append",
        help="auto, centralized, tree:K, ring, direct or all (repeatable; default: all, with tree:2; "
        "auto's rows show what it picked)",
    )
    parser.add_argument("--peers", type=_positive, help="local peers (threads) per node, default 4")
    parser.add_argument(
        "--nodes",
        type=_positive,
        default=1,
        help="nodes (processes on this machine, with an orchestrator); default 1",
    )
    parser.add_argument(
        "--hosts",
        type=_positive,
        help="emulated hosts (network namespaces on a bridge; needs root): --nodes processes in each, "
        "--peers local peers per process (default 1)",
    )
    parser.add_argument(
        "--link",
        metavar="RATE",
        type=_rate,
        help="with --hosts: every host's link, both ways, at RATE (e.g. 100mbit, 1gbit; default unshaped)",
    )
    parser.add_argument(
        "-b", "--minbytes", type=_size, default=8, help="smallest size per peer, e.g. 8, 1K (default 8)"
    )
    parser.add_argument(
        "-e", "--maxbytes", type=_size, default=16 << 20, help="largest size per peer (default 16M)"
    )
    parser.add_argument(
        "-f", "--stepfactor", type=_factor, default=2, help="size multiplier between rows (default 2)"
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--reduce-op", choices=REDUCE_OPS, default="sum")
    parser.add_argument("--root", default="0", help="root peer of reduce and broadcast, or all (default 0)")
    parser.add_argument(
        "-w", "--warmup", type=_count, default=5, help="untimed iterations per row (default 5)"
    )
    parser.add_argument(
        "-n", "--iters", type=_positive, default=20, help="timed iterations per row (default 20)"
    )
    parser.add_argument(
        "--alloc",
        action="store_true",
        help="let every call allocate its result (default: reuse an out= buffer, as nccl-tests does)",
    )
    parser.add_argument(
        "--backend",
        choices=("collective", "torch"),
        default="collective",
        help="collective: our API (default); torch: torch.distributed with our backend beside gloo, "
        "one process per rank (--nodes N processes; default 2 and 4)",
    )
    parser.add_argument(
        "--compare",
        choices=("trivial", "gloo"),
        help="also time a baseline: the trivial barrier-and-sum (one process) or torch.distributed's gloo",
    )
    parser.add_argument("--json", metavar="FILE", help="write every row, the machine and the command as JSON")
    parser.add_argument(
        "--plot", metavar="FILE.png", help="draw bus bandwidth and time against size (needs matplotlib)"
    )
    parser.add_argument(
        "--trace",
        metavar="DIR",
        help="keep every call in the flight recorder: each process's dumps and a Chrome trace "
        "(DIR/trace.json, for Perfetto) go in DIR",
    )
    parser.add_argument(
        "--timeout",
        type=seconds_argument,
        default=120.0,
        help="seconds one collective may take (default 120)",
    )


def sweep_sizes(args: argparse.Namespace, itemsize: int) -> list[int]:
    """The message sizes (bytes) the sweep runs: ``-b`` to ``-e`` by ``-f``, each rounded down to a
    whole number of ``itemsize``-byte elements, none twice (``-b 0``: one empty row, then on)."""
    sizes: list[int] = []
    size = args.minbytes
    while size <= args.maxbytes:
        rounded = size - size % itemsize
        if not sizes or rounded != sizes[-1]:
            sizes.append(rounded)
        size = size * args.stepfactor if size else itemsize  # (-b 0: one empty row, then on)
    return sizes


def moved_sizes(op: str, sizes: list[int], peers: int, itemsize: int) -> list[int]:
    """The sizes ``op`` moves for the asked ``sizes`` (ops split into blocks round them)."""
    return list(dict.fromkeys(moved_bytes(op, size, peers, itemsize) for size in sizes))


def _roots(parser: argparse.ArgumentParser, text: str, peers: int) -> list[int]:
    if text.strip().lower() == "all":
        return list(range(peers))
    if not text.isdigit() or int(text) >= peers:
        parser.error(f"argument --root: must be a peer id in 0..{peers - 1} or 'all', got {text!r}")
    return [int(text)]


class Progress:
    """A one-line progress bar on stderr, only when it is a terminal."""

    def __init__(self, total: int, stream: IO[str]) -> None:
        self.total, self.done, self.stream = total, 0, stream
        self.enabled = stream.isatty()

    def step(self, label: str) -> None:
        if self.enabled:
            filled = 30 * self.done // max(1, self.total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {label:<40}")
            self.stream.flush()
        self.done += 1

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 80 + "\r")
            self.stream.flush()


def unwritable(path: str) -> str | None:
    """Why a result file cannot be written at ``path`` (None if it can)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path} is a directory: name a file"
    if not os.path.isdir(folder):
        return f"no directory {folder} to write {os.path.basename(path)} into"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{path} cannot be written (permissions)"
    return None


def run(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str], out: IO[str]) -> int:
    """Run the sweep described by ``args``; return the exit status (1 if any result was wrong, 128 +
    the signal when Ctrl-C, SIGTERM or SIGHUP stopped it: the rows measured are still printed)."""
    if args.trace:
        try:
            os.makedirs(args.trace, exist_ok=True)
        except OSError as exc:
            parser.error(f"argument --trace: cannot make {args.trace}: {exc.strerror}")
        if (problem := unwritable(os.path.join(args.trace, "trace.json"))) is not None:
            parser.error(f"argument --trace: {problem}")
    with stopped_by_signals(), tracing(args.trace, out):
        try:
            return _run(args, parser, argv, out)
        except Stopped as stop:  # (outside the sweep: writing its results, say)
            print(f"collective bench: stopped by signal {stop.signum}", file=sys.stderr)
            return stop_status(stop)


TRACE_CALLS = 200_000  # the flight recorder's ring under --trace (each process, each job)


@contextlib.contextmanager
def tracing(folder: str | None, out: IO[str]) -> Iterator[None]:
    """Under ``--trace DIR``: every process of the run dumps each job's calls into DIR as the job
    ends (COLLECTIVE_TRACE_EVERY_JOB), with a ring that holds a whole sweep's; afterwards the
    dumps become DIR/trace.json. This process's settings are put back after."""
    if not folder:
        yield
        return
    names = (recorder.DIR_VARIABLE, recorder.EVERY_JOB_VARIABLE, recorder.SIZE_VARIABLE)
    saved, size = {name: os.environ.get(name) for name in names}, RECORDER.size
    os.environ.update(dict(zip(names, (folder, "1", str(max(size, TRACE_CALLS))), strict=True)))
    RECORDER.size = max(size, TRACE_CALLS)
    RECORDER.fresh()  # (calls before this run are not its)
    try:
        yield
        RECORDER.dump_job("collective bench")  # (this process's last job: in-process rows)
    finally:
        RECORDER.size = size
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    dumps, _ = load_dumps(folder)
    target = os.path.join(folder, "trace.json")
    calls = write_chrome_trace(dumps, target)
    print(
        f"# flight recorder: {len(dumps)} dumps in {folder}; Chrome trace of {calls} calls: {target}",
        file=out,
    )


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str], out: IO[str]) -> int:
    if args.minbytes > args.maxbytes:
        parser.error(f"argument -b/--minbytes: {args.minbytes} is larger than -e/--maxbytes {args.maxbytes}")
    for option, path in (("--json", args.json), ("--plot", args.plot)):  # (not once the sweep is over)
        if path and (problem := unwritable(path)) is not None:
            parser.error(f"argument {option}: {problem}")
    if args.link is not None and args.hosts is None:
        parser.error("argument --link: shapes the links of emulated hosts: give --hosts too")
    if args.hosts is not None and args.backend == "torch":
        parser.error("argument --hosts: runs our API beside --compare gloo; --backend torch does not apply")
    if args.hosts is not None and (reason := unavailable()) is not None:
        parser.error(f"argument --hosts: {reason}")
    if args.backend == "torch":
        return run_torch(args, parser, argv, out)
    args.peers = (4 if args.hosts is None else 1) if args.peers is None else args.peers
    if args.compare == "trivial" and (args.nodes > 1 or args.hosts):
        parser.error(
            "argument --compare: the trivial baseline runs in one process; with --nodes use --compare gloo"
        )
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error(f"argument --plot: {PLOT_MISSING}")
    if args.compare == "gloo" and not torch_available():
        parser.error(
            "argument --compare: gloo needs torch (pip install torch==2.13.0 installs the CPU build)"
        )
    ops = (
        list(DEFAULT_OPS) if not args.op else list(OPS) if "all" in args.op else list(dict.fromkeys(args.op))
    )
    if "sendrecv" in ops and args.peers * args.nodes < 2:
        if args.op and "all" in args.op:  # (every op that one peer has)
            ops.remove("sendrecv")
        else:
            parser.error("argument --op: sendrecv needs at least 2 peers")
    if args.compare == "trivial" and not set(ops) & set(TRIVIAL_OPS):
        parser.error(f"argument --compare: the trivial baseline has {', '.join(TRIVIAL_OPS)} only")
    chosen = args.strategy or ["all"]
    strategies = list(ALL_STRATEGIES) if "all" in chosen else list(dict.fromkeys(chosen))
    try:
        itemsize = resolve_dtype(args.dtype).itemsize
    except ImportError:
        parser.error("argument --dtype: bfloat16 needs ml_dtypes (pip install ml_dtypes)")
    world = world_of(args)
    sizes = sweep_sizes(args, itemsize)
    roots = _roots(parser, args.root, world)
    systems = ([args.compare] if args.compare else []) + strategies
    cases = [
        Case(
            system if system in ("trivial", "gloo") else "collective",
            op,
            system,
            world,
            size,
            args.dtype,
            args.reduce_op,
            root,
            args.alloc and system not in ("trivial", "gloo"),
        )
        for op in ops
        for system in systems
        if system != "trivial" or op in TRIVIAL_OPS
        for size in moved_sizes(op, sizes, world, itemsize)
        for root in (roots if op in ROOTED else [0])
    ]
    where = (
        f"{args.peers} local peers" if args.nodes == 1 else f"{args.nodes} nodes x {args.peers} local peers"
    )
    if args.hosts:
        link = f"links shaped to {args.link}" if args.link else "unshaped links"
        where = f"{args.hosts} emulated hosts x {args.nodes} processes x {args.peers} local peers, {link}"
    print(
        f"# collective bench: {where}, {args.dtype}, sizes {format_size(sizes[0])} .. "
        f"{format_size(sizes[-1])}, {args.warmup} warm-up + {args.iters} timed iterations per row",
        file=out,
    )
    started = time.monotonic()
    rows, interrupted = measure_cases(cases, args, sys.stderr)
    order = {case: i for i, case in enumerate(cases)}
    rows.sort(key=lambda row: order[row.case])
    baseline = {(r.case.op, r.case.size, r.case.root): r for r in rows if r.case.system == args.compare}
    rate = link_bytes_per_second(args.link) if args.link else None
    for _, block in _blocks(rows):
        versus = baseline if args.compare and block[0].case.system != args.compare else None
        print_table(block, versus, out, rate)
    if interrupted:
        print("\n# interrupted: the rows above are what was measured", file=out)
    print_summary(rows, out, DEFAULT_SHARE_BELOW if _in_process(args) else SMALL_BYTES)
    print_auto_check(rows, out)
    wrong = sum(row.wrong for row in rows)
    print(f"\n# {len(rows)} rows in {time.monotonic() - started:.1f} s; wrong elements: {wrong}", file=out)
    if args.json:
        write_json(args.json, rows, argv)
    if args.plot and rows:
        plot_rows(rows, args.plot, f"collective bench: {where}, {args.dtype}")
        print(f"# plot written to {args.plot}", file=out)
    if wrong:
        print(f"collective bench: {wrong} wrong result elements (see the #wrong column)", file=sys.stderr)
        return 1
    return interrupted


def run_torch(
    args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str], out: IO[str]
) -> int:
    """``--backend torch``: dist.* through our backend and through gloo, side by side, per world size."""
    if args.compare == "trivial" or args.peers is not None or args.strategy or args.alloc:
        parser.error(  # (checked first: a wrong command line is wrong with or without torch)
            "argument --backend torch: runs torch.distributed, one process per rank (--nodes N), beside "
            "gloo: --peers, --strategy, --alloc and --compare trivial do not apply"
        )
    if not torch_available():
        parser.error(
            "argument --backend torch: needs torch (pip install torch==2.13.0 installs the CPU build)"
        )
    ops = (
        list(DEFAULT_OPS) if not args.op else list(OPS) if "all" in args.op else list(dict.fromkeys(args.op))
    )
    try:
        itemsize = resolve_dtype(args.dtype).itemsize
    except ImportError:
        parser.error("argument --dtype: bfloat16 needs ml_dtypes (pip install ml_dtypes)")
    sizes = sweep_sizes(args, itemsize)
    worlds = [args.nodes] if args.nodes > 1 else [2, 4]
    print(
        f"# collective bench --backend torch: torch.distributed, backend 'collective' vs 'gloo', "
        f"{' and '.join(map(str, worlds))} processes, {args.dtype}, sizes {format_size(sizes[0])} .. "
        f"{format_size(sizes[-1])}, {args.warmup} warm-up + {args.iters} timed iterations per row",
        file=out,
    )
    started, rows = time.monotonic(), []
    for world in worlds:
        roots = _roots(parser, args.root, world)
        cases = {
            system: [
                Case(system, op, system, world, size, args.dtype, args.reduce_op, root)
                for op in ops
                for size in moved_sizes(op, sizes, world, itemsize)
                for root in (roots if op in ROOTED else [0])
            ]
            for system in ("gloo", "torch")
        }
        try:
            measured = {
                system: run_gloo(cases[system], world, args.warmup, args.iters, args.timeout, backend)
                for system, backend in (("gloo", "gloo"), ("torch", "collective"))
            }
        except KeyboardInterrupt as stop:
            print("\n# interrupted", file=out)
            return stop_status(stop)
        baseline = {(r.case.op, r.case.size, r.case.root): r for r in measured["gloo"]}
        for op in ops:
            for system in ("gloo", "torch"):
                block = [r for r in measured[system] if r.case.op == op]
                print_table(block, baseline if system == "torch" else None, out)
        rows += measured["gloo"] + measured["torch"]
    wrong = sum(row.wrong for row in rows)
    print(f"\n# {len(rows)} rows in {time.monotonic() - started:.1f} s; wrong elements: {wrong}", file=out)
    if args.json:
        write_json(args.json, rows, argv)
    if args.plot and rows:
        plot_rows(rows, args.plot, f"collective bench --backend torch, {args.dtype}")
        print(f"# plot written to {args.plot}", file=out)
    return 1 if wrong else 0


def world_of(args: argparse.Namespace) -> int:
    """Peers of the sweep: local peers x processes (per host) x emulated hosts."""
    return int(args.peers * args.nodes * (args.hosts or 1))


def _in_process(args: argparse.Namespace) -> bool:
    """Whether our cases run in this process (no nodes, no emulated hosts)."""
    return bool(args.nodes == 1 and not args.hosts)


def measure_cases(cases: list[Case], args: argparse.Namespace, stream: IO[str]) -> tuple[list[Row], int]:
    """Rows for every case (as many as were measured before a stop) and the stop's exit status (0: none)."""
    rows: list[Row] = []
    local = [c for c in cases if c.system != "gloo" and _in_process(args)]
    batches = [c for c in cases if c not in local]
    progress = Progress(len(local) + (1 if batches else 0), stream)
    try:
        for case in local:
            progress.step(f"{case.op} {case.strategy} {format_size(case.size)}")
            rows.append(run_case(case, args.warmup, args.iters, args.timeout))
        nodes_cases = [c for c in batches if c.system == "collective"]
        gloo_cases = [c for c in batches if c.system == "gloo"]
        if nodes_cases or gloo_cases:
            progress.step(f"{len(batches)} rows in child processes")
        with EmulatedHosts(args.hosts, args.link) if args.hosts else contextlib.nullcontext() as hosts:
            if nodes_cases:
                rows.extend(
                    run_nodes(
                        nodes_cases, args.nodes, args.peers, args.warmup, args.iters, args.timeout, hosts
                    )
                )
            if gloo_cases:
                world = world_of(args)
                rows.extend(run_gloo(gloo_cases, world, args.warmup, args.iters, args.timeout, hosts=hosts))
    except KeyboardInterrupt as stop:
        progress.close()
        return rows, stop_status(stop)
    progress.close()
    return rows, 0


def _blocks(rows: list[Row]) -> list[tuple[tuple[str, str], list[Row]]]:
    """Rows grouped by (strategy or baseline, op), in the order they first appear."""
    blocks: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        blocks.setdefault((row.case.strategy, row.case.op), []).append(row)
    return list(blocks.items())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="collective bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(
        args, parser, ["collective", "bench", *(argv if argv is not None else sys.argv[1:])], sys.stdout
    )
