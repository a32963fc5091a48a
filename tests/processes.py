"""Real processes for multi-node tests: an orchestrator daemon and node workers, always reaped."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

from collective.launch import node_environment

WORKER = str(Path(__file__).with_name("node_worker.py"))
READY = "collective orchestrator: listening on "


# Every launcher's variables (ours, Slurm's, Open MPI's, torchrun's): a child that is to see only
# the ones a test gives it starts from ``outside_launchers()``.
LAUNCHER_PREFIXES = ("COLLECTIVE_", "SLURM_", "OMPI_", "PMIX_", "TORCHELASTIC_")
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def outside_launchers(keep: Collection[str] = ()) -> dict[str, str]:
    """This process's environment without any launcher's variables, but those named in ``keep``."""
    return {
        k: v
        for k, v in os.environ.items()
        if k in keep or not (k.startswith(LAUNCHER_PREFIXES) or k in LAUNCHER_VARIABLES)
    }


_PR_SET_CHILD_SUBREAPER = 36  # (linux/prctl.h)


def _children() -> set[int]:
    """This process's children now, running or not yet reaped (from /proc)."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rpartition(")")[2].split()
            except OSError:
                continue  # (it ended meanwhile)
            if int(fields[1]) == me:
                found.add(int(entry))
    return found


@contextlib.contextmanager
def reaping_orphans(grace: float = 5.0) -> Iterator[None]:
    """While the block runs, a process orphaned by what it started (a daemon whose parent ended
    first: a Ray worker left by its raylet) becomes this process's child (Linux's child subreaper)
    rather than init's; when the block ends, each such child still running is ended (SIGTERM, then
    SIGKILL after ``grace`` seconds) and every one reaped. Elsewhere the block just runs."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        yield
        return
    before = _children()
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        adopted = _children() - before
        for pid in adopted:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while adopted:
            for pid in list(adopted):
                with contextlib.suppress(ChildProcessError):
                    if os.waitpid(pid, os.WNOHANG)[0] == 0:
                        if time.monotonic() < deadline:
                            continue
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                adopted.discard(pid)
            time.sleep(0.05)


def interruptible() -> None:
    """In a child before it runs: SIGINT as a terminal's Ctrl-C finds it (a shell's background job
    inherits SIGINT ignored, and Python then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Proc:
    """A child process whose output lines are collected, with the time each arrived."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            stdin=subprocess.DEVNULL,
            preexec_fn=interruptible,  # (Ctrl-C tests work where the test run itself ignores SIGINT)
        )
        self.lines: list[tuple[float, str]] = []
        self._seen = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._seen:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._seen.notify_all()

    def wait_for(self, prefix: str, timeout: float) -> tuple[float, str]:
        """The first line starting with ``prefix`` (AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._seen:
            while True:
                for when, line in self.lines:
                    if line.startswith(prefix):
                        return when, line
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.process.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no line starting with {prefix!r}; output:\n{self.output()}")
                self._seen.wait(min(remaining, 0.1))

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"process still running after {timeout}s; output:\n{self.output()}"
            ) from None
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self._reader.join(5)

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()
        self._reader.join(5)


def mapped(pid: int) -> str:
    """What process ``pid`` has mapped (/proc/pid/maps); "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


def met_in_shared_memory(pids: Collection[int]) -> bool:
    """Every process of ``pids`` (at least two) has mapped the shared-memory segments of every other
    (/dev/shm/collective-<pid>-*): they have run a collective together, past their start."""
    maps = {pid: mapped(pid) for pid in pids}
    return len(pids) > 1 and all(
        f"/dev/shm/collective-{other}-" in maps[pid] for pid in pids for other in pids if other != pid
    )


def ignores(pid: int, signum: int) -> bool:
    """Whether process ``pid`` ignores signal ``signum`` now (the SigIgn mask of /proc/pid/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), "0")
    return bool(int(mask, 16) >> (signum - 1) & 1)


def start_orchestrator(*extra: str, env: dict[str, str] | None = None) -> tuple[Proc, str]:
    proc = Proc([sys.executable, "-m", "collective", "-v", "orchestrator", "--port", "0", *extra], env)
    _, line = proc.wait_for(READY, 30)
    return proc, line[len(READY) :]


def start_orchestrator_with_token(token: str) -> tuple[Proc, str]:
    """An orchestrator that only admits nodes holding ``token`` (given in its environment)."""
    return start_orchestrator(env={**os.environ, "COLLECTIVE_TOKEN": token})


def node_env(address: str, job: str, rank: int, nodes: int, devices: int, **extra: Any) -> dict[str, str]:
    env = node_environment(address, job, rank, nodes, devices)
    env["COLLECTIVE_TIMEOUT"] = "20"
    env.update({f"COLLECTIVE_{key.upper()}": str(value) for key, value in extra.items()})
    return env


def start_nodes(address: str, job: str, nodes: int, devices: int, *argv: str, **extra: Any) -> list[Proc]:
    return [
        Proc([sys.executable, WORKER, *argv], node_env(address, job, rank, nodes, devices, **extra))
        for rank in range(nodes)
    ]


def expect_peer_lost(survivors: Iterable[Proc], killed: float, within: float, naming: str = "") -> None:
    """Every survivor reports a PeerLostError (whose message holds ``naming``) less than ``within``
    seconds after ``killed`` (a time.monotonic() reading), and exits with status 3."""
    for survivor in survivors:
        when, line = survivor.wait_for("ERROR", 15)
        assert line.startswith("ERROR PeerLostError") and naming in line, survivor.output()
        assert when - killed < within, f"noticed after {when - killed:.1f}s"
        assert survivor.wait(30) == 3


def finish_all(procs: list[Proc], timeout: float) -> list[int]:
    """Wait for every process (killing the rest if one overruns); their exit codes."""
    try:
        return [proc.wait(timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
