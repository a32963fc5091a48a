"""The ``collective`` command: ``bench``, ``tune``, ``trace``, ``orchestrator``, ``launch`` and ``demo``.

Exit status: 0 success, 1 a failed run (wrong results, a collective error), 2 bad arguments,
130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Sequence

import numpy as np

import collective
from collective import launch

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    """``args.peers`` threads all-reduce a small array with every strategy and print what they got."""
    for strategy in ("centralized", "tree:2", "ring", "direct"):
        config = collective.CollectiveConfig(
            num_devices=args.peers, local_all_reduce_strategy=strategy, timeout=30
        )
        results: dict[int, np.ndarray] = {}
        errors: list[BaseException] = []

        def peer(
            peer_id: int,
            config: collective.CollectiveConfig = config,
            results: dict[int, np.ndarray] = results,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                collective.register(peer_id, "cpu", config)
                results[peer_id] = collective.all_reduce(
                    peer_id, np.arange(4, dtype=np.float32) * (peer_id + 1)
                )
                collective.finish(peer_id)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=peer, args=(p,)) for p in range(args.peers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        if errors or len(results) != args.peers:
            print(
                f"demo failed with {strategy}: {errors[0] if errors else 'peers did not finish'}",
                file=sys.stderr,
            )
            return 1
        total = args.peers * (args.peers + 1) // 2
        print(
            f"{strategy:>12}: peer 0 sent {np.arange(4) * 1.0}, every peer got {results[0]} "
            f"(= {total} x peer 0's array)"
        )
    return 0


def _trace(args: argparse.Namespace, chrome: argparse.ArgumentParser) -> int:
    from collective.trace import analyze
    from collective.trace import chrome as chrome_trace

    if args.reading == "analyze":
        return analyze.main(args.dir, sys.stdout)
    if not os.path.isdir(args.dir):
        chrome.error(f"no directory {args.dir}")
    dumps, problems = analyze.load_dumps(args.dir)
    for problem in problems:
        print(f"# skipped {problem}", file=sys.stderr)
    if not dumps:
        chrome.error(f"no flight recorder dumps in {args.dir}")
    calls = chrome_trace.write(dumps, args.output)
    print(
        f"# {calls} calls of {len(dumps)} processes written to {args.output}: open it in https://ui.perfetto.dev"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # (the output piped into a reader that left, as head does: no traceback)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (nor at exit's flush)
        return 1


def _main(argv: Sequence[str] | None) -> int:
    from collective.bench import cli as bench_cli
    from collective.bench import tune

    parser = argparse.ArgumentParser(
        prog="collective", description="Collective communication for numpy, CuPy, torch and JAX arrays."
    )
    parser.add_argument("--version", action="version", version=f"collective {collective.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level on stderr")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser(
        "bench", help="microbenchmarks across ops, strategies and sizes", description=bench_cli.__doc__
    )
    bench_cli.add_arguments(bench)
    tuner = commands.add_parser(
        "tune",
        help="time every schedule on this layout and write a profile for COLLECTIVE_PROFILE",
        description=tune.__doc__,
    )
    tune.add_arguments(tuner)
    tracer = commands.add_parser(
        "trace", help="read flight recorder dumps: analyze, or convert to a Chrome trace"
    )
    reading = tracer.add_subparsers(dest="reading", required=True)
    analyzer = reading.add_parser("analyze", help="merge the dumps of every process and name the culprit")
    analyzer.add_argument("dir", help="the folder of dumps (COLLECTIVE_TRACE_DIR)")
    chrome = reading.add_parser("chrome", help="write the dumps as a Chrome trace (Perfetto)")
    chrome.add_argument("dir", help="the folder of dumps (COLLECTIVE_TRACE_DIR)")
    chrome.add_argument(
        "-o", "--output", default="trace.json", help="the trace to write (default trace.json)"
    )
    demo = commands.add_parser("demo", help="a few peers all-reduce a small array with every strategy")
    demo.add_argument("--peers", type=int, default=4, help="local peers (threads), default 4")
    orchestrator = commands.add_parser("orchestrator", help="run the orchestrator daemon of multi-node jobs")
    launch.add_orchestrator_arguments(orchestrator)
    launcher = commands.add_parser("launch", help="run a script as a multi-node job on this machine")
    launch.add_launch_arguments(launcher)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if args.command == "demo":
        if args.peers < 1:
            demo.error(f"argument --peers: must be >= 1, got {args.peers}")
        return _demo(args)
    if args.command == "orchestrator":
        return launch.serve_orchestrator(args)
    if args.command == "launch":
        return launch.launch(args, launcher)
    if args.command == "trace":
        return _trace(args, chrome)
    if args.command == "tune":
        return tune.run(
            args, tuner, ["collective", *(argv if argv is not None else sys.argv[1:])], sys.stdout
        )
    return bench_cli.run(
        args, bench, ["collective", *(argv if argv is not None else sys.argv[1:])], sys.stdout
    )


if __name__ == "__main__":
    sys.exit(main())
