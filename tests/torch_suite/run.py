"""Run PyTorch's distributed test suite (``DistributedTest._DistTestBase``) against a backend.

    python -m tests.torch_suite.run --backend gloo --world-size 2                 # torch's own run
    python -m tests.torch_suite.run --backend collective --world-size 2           # ours, as a plugin
    python -m tests.torch_suite.run --backend collective --world-size 2 --as-gloo # ours, gloo's tests
    ... [-k PATTERN]... [--only TEST]... [--json OUT] [--timeout S] [--logs DIR] [--list]

How: the suite ships in the torch wheel (``torch/testing/_internal/distributed/distributed_test.py``);
torch's ``test/distributed/test_distributed_spawn.py`` (not in the wheel) runs it for gloo by setting
``BACKEND``, ``WORLD_SIZE`` and ``TEMP_DIR`` and defining ``TestDistBackendWithSpawn(TestDistBackend,
DistributedTest._DistTestBase)``, whose setUp spawns WORLD_SIZE processes ("spawn" start method):
each inits the default group with ``BACKEND`` over a ``file://`` store and runs the one test.
This module does the same: it sets those variables (and ``COLLECTIVE_TORCH_SUITE_MODE``), imports
``tests.torch_suite.suite`` (the class; the spawned processes import it again by name, so what
it does at import holds in them too) and runs the selected tests one by one with unittest.

- ``--backend gloo``: torch's run, unchanged.
- ``--backend collective``: ``BACKEND=collective``; the suite module imports ``collective.torch``
  (registering the backend) and adds "collective" to ``DistTestCases.backend_feature["ddp"]``,
  ``["subgroup"]`` and ``["plugin"]`` before torch's suite is imported (its skip decorators read
  them at import). Tests gated on the name gloo are skipped, as for any third-party backend.
- ``--as-gloo``: ``BACKEND=gloo``, so the suite is imported as for gloo (the gloo-gated tests
  run), and in every process ``init_process_group``, ``new_group``, ``new_subgroups`` and
  ``new_subgroups_by_enumeration`` are wrapped (in ``torch.distributed.distributed_c10d`` and in
  every torch module that imported them by name) so that a group asked of gloo is created with
  ours. ``dist.get_backend()`` then says "collective": tests comparing it with "gloo" fail on the
  name alone (see the report).

Each test is bounded by torch's own wall-clock limit (``common_distributed.get_timeout``: 300 s,
more for a few; ``--timeout S`` caps it), past which torch terminates the processes; anything
still alive 10 s later is killed and reaped. The processes' output goes to one log per test
(``--logs DIR``, a temporary folder by default, removed at the end unless given). ``--json OUT``
writes the outcome of every test (passed, failed, errored, skipped; ``timed_out``), its seconds and
the first lines of its error. The exit status is 0 when no test failed or errored.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
import unittest
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

OUTCOMES = ("passed", "failed", "errored", "skipped")
PROCESS_RAISED = re.compile(r"Process (\d+) exited with error code \d+ and exception:\n")
TIMED_OUT = ("terminated or timed out", "Timing out after")
ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]


def exception_lines(text: str, limit: int = 6) -> list[str]:
    """The exception at the end of a traceback's text (its type and message), without the C++
    stack torch appends ("Exception raised from ...")."""
    lines = text.rstrip().splitlines()
    start = 0
    for i, line in enumerate(lines):
        if line.startswith('  File "'):
            start = i + 1
    while start < len(lines) and (lines[start].startswith("    ") or not lines[start].strip()):
        start += 1  # the source line of the last frame, and its ^^^ markers
    tail: list[str] = []
    for line in lines[start:]:
        if line.startswith("Exception raised from "):
            break
        if line.strip():
            tail.append(line.rstrip())
    return tail[:limit]


def error_summary(text: str) -> list[str]:
    """The first lines that say what went wrong: each process's exception ("Process 1: ...") when
    the spawned processes raised, else the exception of the test itself."""
    parts = PROCESS_RAISED.split(text)
    said: list[str] = []
    for rank, raised in zip(parts[1::2], parts[2::2], strict=True):
        said.extend(f"Process {rank}: {line}" for line in exception_lines(raised, 3))
    return said or exception_lines(text)


class Outcomes(unittest.TestResult):
    """Each test's outcome, seconds and error; the spawned processes' output in one log per test."""

    def __init__(self, logs: Path, progress: TextIO, total: int) -> None:
        super().__init__()
        self.logs = logs
        self.progress = progress
        self.total = total
        self.records: list[dict[str, Any]] = []
        self._started = 0.0
        self._current: dict[str, Any] = {}
        self._saved: tuple[int, int] | None = None

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        name = test._testMethodName
        sys.stdout.flush()
        sys.stderr.flush()
        with open(self.logs / f"{name}.log", "wb") as log:
            self._saved = (os.dup(1), os.dup(2))
            os.dup2(log.fileno(), 1)  # the spawned processes inherit these
            os.dup2(log.fileno(), 2)
        self._current = {"name": name, "outcome": "passed", "timed_out": False, "error": [], "detail": ""}
        self._started = time.monotonic()

    def stopTest(self, test: unittest.TestCase) -> None:
        super().stopTest(test)
        sys.stdout.flush()
        sys.stderr.flush()
        if self._saved is not None:
            os.dup2(self._saved[0], 1)
            os.dup2(self._saved[1], 2)
            os.close(self._saved[0])
            os.close(self._saved[1])
            self._saved = None
        record = {**self._current, "seconds": round(time.monotonic() - self._started, 2)}
        self.records.append(record)
        said = record["error"][0] if record["error"] else ""
        if record["outcome"] == "skipped":
            said = record["detail"]
        self.progress.write(
            f"[{len(self.records)}/{self.total}] {record['name']} {record['outcome'].upper()}"
            f"{' (timed out)' if record['timed_out'] else ''} {record['seconds']:.1f}s"
            f"{'  ' + said[:160] if said else ''}\n"
        )
        self.progress.flush()

    def _failed(self, outcome: str, test: unittest.TestCase, err: ExcInfo) -> None:
        text = self._exc_info_to_string(err, test)
        if self._current.get("outcome") in ("failed", "errored"):  # an error in tearDown as well
            self._current["detail"] += "\n" + text
            return
        self._current.update(
            outcome=outcome,
            error=error_summary(text),
            detail=text,
            timed_out=any(marker in text for marker in TIMED_OUT),
        )

    def addFailure(self, test: unittest.TestCase, err: ExcInfo) -> None:  # type: ignore[override]
        super().addFailure(test, err)
        self._failed("failed", test, err)

    def addError(self, test: unittest.TestCase, err: ExcInfo) -> None:  # type: ignore[override]
        super().addError(test, err)
        self._failed("errored", test, err)

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._current.update(outcome="skipped", detail=reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: ExcInfo) -> None:  # type: ignore[override]
        super().addExpectedFailure(test, err)

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._current.update(outcome="failed", error=["unexpected success"])


def selected(names: Sequence[str], patterns: Sequence[str], only: Sequence[str]) -> list[str]:
    """The test names that match: ``only`` exact names, ``patterns`` as unittest's -k (a glob when
    it has one of ``*?[``, else a substring); all of them without either."""
    if not patterns and not only:
        return list(names)
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise SystemExit(f"no such test in the suite: {', '.join(unknown)}")

    def matches(name: str) -> bool:
        if name in only:
            return True
        return any(
            fnmatch.fnmatchcase(name, p) if any(c in p for c in "*?[") else p in name for p in patterns
        )

    return [name for name in names if matches(name)]


def configure(
    backend: str, world_size: int, as_gloo: bool, timeout: float | None, start: str, temp: Path
) -> str:
    """The environment torch's run_test.py gives the suite, plus the suite module's mode."""
    mode = "as-gloo" if as_gloo else backend
    os.environ["BACKEND"] = "gloo" if as_gloo else backend
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["TEMP_DIR"] = str(temp)
    os.environ["INIT_METHOD"] = f"file://{temp}/init"  # run_test.py's file:// variant (more tests run)
    os.environ["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    os.environ["COLLECTIVE_TORCH_SUITE_MODE"] = mode
    os.environ["COLLECTIVE_TORCH_SUITE_START"] = start
    if timeout is not None:
        os.environ["COLLECTIVE_TORCH_SUITE_TIMEOUT"] = str(timeout)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # WORLD_SIZE processes share the cores
    return mode


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.torch_suite.run", description=__doc__.split("\n", 1)[0] if __doc__ else None
    )
    parser.add_argument("--backend", choices=("collective", "gloo"), required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--as-gloo", action="store_true", help="gloo's suite, groups created with ours")
    parser.add_argument("-k", dest="patterns", action="append", default=[], help="substring or glob")
    parser.add_argument("--only", action="append", default=[], help="an exact test name")
    parser.add_argument("--json", type=Path, help="write every test's outcome here")
    parser.add_argument(
        "--start",
        choices=("spawn", "fork"),
        default="spawn",
        help="how the processes of a test start: spawn (torch's way) or fork (faster)",
    )
    parser.add_argument("--timeout", type=float, help="cap on each test's wall-clock seconds")
    parser.add_argument("--logs", type=Path, help="keep the processes' output here, one log per test")
    parser.add_argument("--list", action="store_true", help="list the selected tests, run none")
    args = parser.parse_args(argv)
    if args.as_gloo and args.backend != "collective":
        parser.error("--as-gloo runs gloo's tests on --backend collective")
    if args.world_size < 2:
        parser.error("--world-size: at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    temp = Path(tempfile.mkdtemp(prefix="torch-suite-"))
    logs = args.logs or temp / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    progress = os.fdopen(os.dup(1), "w", buffering=1)
    started = time.monotonic()
    try:
        mode = configure(args.backend, args.world_size, args.as_gloo, args.timeout, args.start, temp)
        suite_module: Any = importlib.import_module("tests.torch_suite.suite")
        cls = suite_module.TestDistBackendWithSpawn
        names = selected(unittest.TestLoader().getTestCaseNames(cls), args.patterns, args.only)
        if args.list:
            progress.write("\n".join(names) + "\n")
            return 0
        progress.write(
            f"torch {suite_module.torch.__version__}: {len(names)} tests, mode {mode}, "
            f"world size {args.world_size}, {args.start}, logs in {logs}\n"
        )
        result = Outcomes(logs, progress, len(names))
        cls.setUpClass()
        try:
            for name in names:
                cls(name).run(result)
        finally:
            cls.tearDownClass()
        counts = {outcome: sum(r["outcome"] == outcome for r in result.records) for outcome in OUTCOMES}
        counts["timed_out"] = sum(r["timed_out"] for r in result.records)
        seconds = round(time.monotonic() - started, 1)
        progress.write(f"{mode} world size {args.world_size}: {counts} in {seconds} s\n")
        for record in result.records:
            if record["outcome"] in ("failed", "errored"):
                progress.write(f"  {record['outcome'].upper()} {record['name']}\n")
                progress.writelines(f"      {line[:300]}\n" for line in record["error"])
        if args.json:
            summary = {
                "backend": args.backend,
                "mode": mode,
                "world_size": args.world_size,
                "start": args.start,
                "torch": str(suite_module.torch.__version__),
                "seconds": seconds,
                "counts": counts,
                "tests": result.records,
            }
            args.json.write_text(json.dumps(summary, indent=1) + "\n")
        return 0 if counts["failed"] == counts["errored"] == 0 else 1
    finally:
        for child in multiprocessing.active_children():  # interrupted mid-test: none left behind
            child.kill()
            child.join()
        progress.close()
        shutil.rmtree(temp, ignore_errors=True)  # the logs too, unless --logs put them elsewhere


if __name__ == "__main__":
    sys.exit(main())
