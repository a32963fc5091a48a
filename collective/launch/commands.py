"""``collective orchestrator`` and ``collective launch``: run a multi-node job on this machine.

``launch`` starts an orchestrator (unless one is given) and N node processes of a command (a
Python script, ``-m module``, or any program), each with the environment
``CollectiveConfig.from_env()`` reads plus ``COLLECTIVE_NODE_RANK`` and ``COLLECTIVE_PEER_IDS``
(the peer ids that node owns, see ``peer_ids_from_env``). With one peer per node it also sets
torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so
one script runs under either launcher (``col.init()`` reads them). It streams the nodes' output
prefixed by node and exits with the first failing node's status, stopping the others; on Ctrl-C it
stops every node quietly and exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any

from collective.config import address_problem, job_problem
from collective.errors import ConfigError, RegistrationError

__all__ = [
    "Stopped",
    "add_launch_arguments",
    "add_orchestrator_arguments",
    "free_port",
    "launch",
    "node_environment",
    "peer_ids_from_env",
    "seconds_argument",
    "serve_orchestrator",
    "start_orchestrator",
    "stop_processes",
    "stop_status",
    "stopped_by_signals",
]

READY_PREFIX = "collective orchestrator: listening on "
STOP_GRACE = 5.0
INTERRUPT_GRACE = 3.0  # for a node to unwind after SIGINT


def peer_ids_from_env(environ: Mapping[str, str] | None = None) -> list[int]:
    """This node's peer ids from COLLECTIVE_PEER_IDS (e.g. "2,3"), which ``collective launch`` sets.

    Raises ConfigError naming the variable when it is unset, empty or not a list of distinct
    integers >= 0 (set it yourself when starting nodes by hand).
    """
    text = (os.environ if environ is None else environ).get("COLLECTIVE_PEER_IDS")
    if text is None or not text.strip():
        raise ConfigError(
            "COLLECTIVE_PEER_IDS is not set: it names this node's peer ids, e.g. COLLECTIVE_PEER_IDS=2,3 "
            "(collective launch sets it; set it on every node started by hand)"
        )
    try:
        peers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        peers = []
    if not peers or min(peers) < 0 or len(set(peers)) != len(peers):
        raise ConfigError(
            f"COLLECTIVE_PEER_IDS={text!r} is not a comma-separated list of distinct peer ids >= 0"
        )
    return peers


def node_environment(
    address: str,
    job: str,
    rank: int,
    nodes: int,
    devices: int,
    base: dict[str, str] | None = None,
    master_port: int | None = None,
) -> dict[str, str]:
    """The environment of node ``rank`` of a job on this machine (what ``launch`` gives each node).

    With one peer per node, torchrun's variables too (``master_port``: the MASTER_PORT to give).
    """
    env = dict(os.environ if base is None else base)
    if devices == 1:
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(nodes),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(nodes),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(master_port or free_port()),
        )
    env.update(
        COLLECTIVE_NUM_DEVICES=str(devices),
        COLLECTIVE_NUM_NODES=str(nodes),
        COLLECTIVE_GLOBAL_ADDRESS=address,
        COLLECTIVE_NODE_ADDRESS="127.0.0.1:0",
        COLLECTIVE_DATA_SERVICE_PORT="0",
        COLLECTIVE_JOB=job,
        COLLECTIVE_NODE_RANK=str(rank),
        COLLECTIVE_PEER_IDS=",".join(str(rank * devices + d) for d in range(devices)),
    )
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_orchestrator(
    host: str = "127.0.0.1", wrap: Sequence[str] = ()
) -> tuple[subprocess.Popen[str], str]:
    """An orchestrator daemon on a free port of ``host``: (the process, its address). ``wrap``
    prefixes its command (``ip netns exec NS``: it runs inside an emulated host)."""
    process = subprocess.Popen(
        [*wrap, sys.executable, "-m", "collective", "orchestrator", "--host", host, "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # Ctrl-C reaches launch alone
        env={**os.environ, "COLLECTIVE_STOP_WITH_PARENT": str(os.getpid())},  # (if killed outright)
    )
    assert process.stdout is not None
    try:
        line = process.stdout.readline()
    except BaseException:  # Ctrl-C while it starts: it stops too
        stop_processes([process])
        raise
    if not line.startswith(READY_PREFIX):
        process.kill()
        process.wait()
        raise RuntimeError(f"the orchestrator did not start (it printed {line!r})")
    return process, line[len(READY_PREFIX) :].strip()


def stop_processes(processes: Sequence[subprocess.Popen[Any]], groups: bool = False) -> None:
    """SIGTERM, then SIGKILL after a grace period; reap all. With ``groups`` (each process leads
    its own session, as launch starts the nodes): SIGINT first, so Python programs unwind and run
    their exit handlers (their shared memory is removed: SIGTERM skips that), and every signal goes
    to the whole process group, so what a process started (a shell's children, say) stops with it,
    even once the process itself has ended.
    """
    if groups:
        _signal(processes, signal.SIGINT, groups)
        _reaped(processes, INTERRUPT_GRACE)
    _signal(processes, signal.SIGTERM, groups)
    if not _reaped(processes, STOP_GRACE) or groups:
        _signal(processes, signal.SIGKILL, groups)  # (a group's leftovers too)
        _reaped(processes, STOP_GRACE)


def _signal(processes: Sequence[subprocess.Popen[Any]], signum: int, groups: bool) -> None:
    for process in processes:
        if groups:  # (a group outlives its leader while members are left: its id stays theirs)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signum)
        elif process.poll() is None:
            process.send_signal(signum)


def _reaped(processes: Sequence[subprocess.Popen[Any]], seconds: float) -> bool:
    """Wait up to ``seconds`` for every process to end; whether all did."""
    deadline = time.monotonic() + seconds
    for process in processes:
        try:
            process.wait(max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return True


# -- orchestrator ---------------------------------------------------------------------------------


def _port(text: str) -> int:
    if not text.strip().isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535 (0: a free one), got {text!r}")
    return int(text)


def seconds_argument(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def add_orchestrator_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=_port, default=0, help="port to listen on; 0 picks a free one (default)"
    )
    parser.add_argument(
        "--lost-after",
        type=seconds_argument,
        default=None,
        help="seconds without heartbeats before a node is lost (default 2)",
    )


def _first_failed(nodes: list[subprocess.Popen[str]]) -> tuple[int, int] | None:
    """(rank, exit status) of the first node that exited with an error, if any."""
    for rank, node in enumerate(nodes):
        code = node.poll()
        if code not in (None, 0):
            return rank, code
    return None


def serve_orchestrator(args: argparse.Namespace) -> int:
    """Run the daemon until SIGINT or SIGTERM; print the address it listens on first."""
    from collective.transport.logs import nonblocking_logging
    from collective.transport.orchestrator import LOST_AFTER, Orchestrator

    token = os.environ.get("COLLECTIVE_TOKEN", "").strip() or None  # never on the command line (as from_env)
    try:
        orchestrator = Orchestrator(args.host, args.port, args.lost_after or LOST_AFTER, token)
    except RegistrationError as exc:  # a host it cannot listen on, a port in use
        print(f"collective orchestrator: {exc}", file=sys.stderr)
        return 2
    previous = {
        sig: signal.signal(sig, lambda *_: orchestrator.stop()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    if (parent := os.environ.get("COLLECTIVE_STOP_WITH_PARENT", "")).isdecimal():
        orchestrator.stop_with_parent(int(parent))
    try:
        print(f"{READY_PREFIX}{orchestrator.address}", flush=True)
        with nonblocking_logging():  # stderr may be a pipe nobody reads: the service never waits on it
            orchestrator.serve()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


# -- launch ---------------------------------------------------------------------------------------


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, required=True, help="node processes to start")
    parser.add_argument("--devices", type=int, default=1, help="local peers (threads) per node (default 1)")
    parser.add_argument(
        "--orchestrator", metavar="HOST:PORT", help="an orchestrator to use (default: start one)"
    )
    parser.add_argument("--job", help="the job name (default: unique per launch)")
    parser.add_argument("--timeout", type=seconds_argument, help="COLLECTIVE_TIMEOUT for the nodes")
    parser.add_argument(  # (everything after -m is the module's: its own options too)
        "-m", dest="module", nargs=argparse.REMAINDER, help="-m MODULE [ARGS]: run a module (as python -m)"
    )
    parser.add_argument(
        "program",
        nargs=argparse.REMAINDER,
        help="what every node runs: a Python script and its arguments, or any program and its arguments",
    )


def node_command(module: str | None, command: list[str]) -> list[str]:
    """The argv of a node: python for ``-m module`` or a script, the program itself otherwise."""
    if module is not None:
        return [sys.executable, "-m", module, *command]
    if command[0].endswith(".py"):
        return [sys.executable, *command]
    return command


def _orchestrator_address(text: str, parser: argparse.ArgumentParser) -> str:
    if (problem := address_problem(text, lowest_port=1)) is not None:
        parser.error(f"argument --orchestrator: {problem}")
    return text


def _pump(
    stream: IO[str],
    prefix: str,
    sink: IO[str],
    lock: threading.Lock,
    quiet: threading.Event,
    broken: threading.Event,
) -> None:
    for line in stream:  # (read to the end once quiet: a node must not block on a full pipe)
        with lock:
            if not quiet.is_set() and not broken.is_set():
                try:
                    sink.write(f"{prefix}{line}" if line.endswith("\n") else f"{prefix}{line}\n")
                    sink.flush()
                except (BrokenPipeError, ValueError):  # its reader left (``| head``): the job stops
                    broken.set()


def _reader_left(sink: IO[str]) -> int:
    """141 (128 + SIGPIPE: a shell's status for a writer whose reader left), once what is left of
    ``sink``'s buffer, and what interpreter exit flushes, goes nowhere."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sink.fileno())
    return 128 + signal.SIGPIPE


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a batch system's stop, a closed terminal): unwinds as Ctrl-C does."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def stop_status(stop: KeyboardInterrupt) -> int:
    """The exit status of a command stopped by ``stop``: 128 + its signal, as a shell reports it."""
    return 128 + (stop.signum if isinstance(stop, Stopped) else signal.SIGINT)


@contextlib.contextmanager
def _handled(signums: Sequence[int], handler: Any) -> Iterator[None]:
    """``handler`` for ``signums`` in the block (in the main thread; elsewhere signals stay as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _signals_held() -> contextlib.AbstractContextManager[None]:
    """Ctrl-C, SIGTERM and SIGHUP ignored in the block (launch is stopping its nodes already)."""
    return _handled((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), signal.SIG_IGN)


def stopped_by_signals() -> contextlib.AbstractContextManager[None]:
    """SIGTERM and SIGHUP raise Stopped in the main thread (so what a command started stops first)."""

    def stop(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    return _handled((signal.SIGTERM, signal.SIGHUP), stop)


def launch(args: argparse.Namespace, parser: argparse.ArgumentParser, out: IO[str] = sys.stdout) -> int:
    """Start the job; return 0 when every node succeeded, else the first failing node's status."""
    if args.nodes < 1 or args.devices < 1:
        parser.error("argument --nodes/--devices: must be >= 1")
    if args.orchestrator is not None:
        _orchestrator_address(args.orchestrator, parser)
    if args.job is not None and (problem := job_problem(args.job)) is not None:
        parser.error(f"argument --job: {problem}")
    if args.module is not None:  # "-m module [args]": the module's arguments were taken with it
        if not args.module or args.module[0].startswith("-"):
            parser.error("argument -m: expected a module name")
        rest = args.program[1:] if args.program[:1] == ["--"] and len(args.module) == 1 else args.program
        args.module, args.program = args.module[0], [*args.module[1:], *rest]  # (argparse stops at --)
    elif args.program[:1] == ["--"]:  # "launch --nodes 2 -- prog ...": the separator is no program
        args.program = args.program[1:]
    if not args.program and args.module is None:
        parser.error("nothing to run: give a script, -m module, or a program (and its arguments)")
    if args.module is None and args.program[0].endswith(".py") and not os.path.isfile(args.program[0]):
        parser.error(f"no such script {args.program[0]!r}")
    with stopped_by_signals():
        return _run(args, out)


def _run(args: argparse.Namespace, out: IO[str]) -> int:
    orchestrator = None
    lock = threading.Lock()
    quiet: list[threading.Event] = []  # per node: set when launch stops it (its tracebacks are noise)
    nodes: list[subprocess.Popen[str]] = []
    pumps: list[threading.Thread] = []
    broken = threading.Event()  # the output's reader left
    try:
        address = args.orchestrator
        if address is None:
            orchestrator, address = start_orchestrator()
        job = args.job if args.job is not None else f"launch-{os.getpid()}-{int(time.time() * 1000)}"
        started = f"collective launch: job {job!r}, orchestrator {address}, {args.nodes} node(s)"
        print(started, file=sys.stderr)
        master_port = free_port()
        for rank in range(args.nodes):
            env = node_environment(address, job, rank, args.nodes, args.devices, master_port=master_port)
            if args.timeout is not None:
                env["COLLECTIVE_TIMEOUT"] = str(args.timeout)
            try:
                process = subprocess.Popen(
                    node_command(args.module, args.program),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    errors="backslashreplace",  # (a byte that is no UTF-8 must not stop its pump)
                    env=env,
                    start_new_session=True,  # Ctrl-C reaches launch alone; it stops the nodes itself
                )
            except OSError as exc:
                print(f"collective launch: cannot run {args.program}: {exc}", file=sys.stderr)
                return 127
            nodes.append(process)
            quiet.append(threading.Event())
            assert process.stdout is not None
            pumped = (process.stdout, f"[node {rank}] ", out, lock, quiet[-1], broken)
            pump = threading.Thread(target=_pump, args=pumped, daemon=True)
            pump.start()
            pumps.append(pump)
        while (failed := _first_failed(nodes)) is None and any(node.poll() is None for node in nodes):
            if broken.is_set():  # as a pipeline's writer whose reader left: stopped, quietly
                return _reader_left(out)
            time.sleep(0.05)
        if failed is None:
            failed = _first_failed(nodes)  # (the last live node may have failed since the last look)
        for pump in pumps if failed is None else ():  # (their last output, written or refused)
            pump.join(5)
        if failed is None:
            return _reader_left(out) if broken.is_set() else 0
        rank, code = failed
        with lock:
            how = f"exited with status {code}" if code > 0 else f"was killed by signal {-code}"
            message = f"collective launch: node {rank} {how}; stopping the others"
            print(message, file=sys.stderr)
        return code if code > 0 else 128 - code  # killed by signal N: 128 + N, as a shell reports it
    except KeyboardInterrupt as stop:  # Ctrl-C (130), or Stopped by SIGTERM / SIGHUP
        return stop_status(stop)
    finally:
        with _signals_held():  # a second Ctrl-C or SIGTERM must not cut the stopping short
            for node, silent in zip(nodes, quiet, strict=True):
                if node.poll() is None:  # (one that ended has its last words, a traceback say, shown)
                    silent.set()
            stop_processes(nodes, groups=True)
            for pump in pumps:
                pump.join(5)
            if orchestrator is not None:
                stop_processes([orchestrator])
