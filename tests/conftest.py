"""Fixtures and helpers: every peer thread is joined under a timeout, every runtime is closed."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import collective as col

JOIN_TIMEOUT = 30.0
# A job spanning several hosts measures its links as it starts (collective.tuning.probe); the
# tests that fake hosts on this one machine would pay for it in every job: test_tuning tests it.
os.environ.setdefault("COLLECTIVE_PROBE", "never")
# The settings of this test run that tests scrubbing COLLECTIVE_* from a child's environment keep.
RUN_SETTINGS = ("COLLECTIVE_PROBE", "COLLECTIVE_TRACE_DIR")
# Failing collectives dump the flight recorder (collective.trace): into one folder of this run,
# removed at its end (worker processes inherit the variable).
if "COLLECTIVE_TRACE_DIR" not in os.environ:
    os.environ["COLLECTIVE_TRACE_DIR"] = tempfile.mkdtemp(prefix="collective-test-trace-")
    atexit.register(shutil.rmtree, os.environ["COLLECTIVE_TRACE_DIR"], True)
# Runtime limits: "fused" is the default (small numpy arrays complete at the rendezvous, mid-size
# ones on the shared path, large ones over the strategy's schedule); "shared" turns fusing off;
# "linked" runs the configured strategy's schedule at every size.
PATHS: dict[str, dict[str, int]] = {
    "fused": {},
    "shared": {"fuse_below": 0},
    "linked": {"fuse_below": 0, "share_below": 0},
}


def wait_until(
    predicate: Callable[[], object], timeout: float, what: str | Callable[[], str], interval: float = 0.005
) -> None:
    """Poll ``predicate`` every ``interval`` seconds until it is true; after ``timeout`` seconds raise
    AssertionError naming ``what`` (a text, or a function giving one when the wait fails).

    The bounded wait for an event the test cannot be told of otherwise (a thread blocked in a
    rendezvous, a process past a point): never a sleep that hopes it happened meanwhile.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            said = what if isinstance(what, str) else what()
            raise AssertionError(f"not within {timeout:g} s: {said}")
        time.sleep(interval)


@contextlib.contextmanager
def orchestrator_log() -> Iterator[list[str]]:
    """The messages an orchestrator of this process logs (INFO and up) while the block runs: its
    registrations, a signal to wait for (a node has registered before the next one starts)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("collective.transport.orchestrator")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def registered(lines: list[str], job: str) -> int:
    """How many nodes of ``job`` the orchestrator said it registered."""
    said = f"job {job!r}: node at"
    return sum(1 for line in list(lines) if line.startswith(said) and " registered (" in line)


@pytest.fixture
def runtime() -> Iterator[col.Runtime]:
    """A private Runtime (default fast path for small arrays), closed after the test."""
    with col.Runtime() as rt:
        yield rt


@pytest.fixture(scope="module")
def orchestrator() -> Iterator[str]:
    """One orchestrator daemon (a process) per test module: it serves every job of the module, one
    after another and at once; its address. Modules that need an in-thread one define their own."""
    from tests.processes import start_orchestrator

    proc, address = start_orchestrator()
    try:
        yield address
    finally:
        proc.terminate()
        assert proc.process.returncode == 0, proc.output()


@pytest.fixture(params=list(PATHS))
def rt(request: pytest.FixtureRequest) -> Iterator[col.Runtime]:
    """A Runtime for each in-process path (see PATHS): errors and results must be the same on the
    fast paths and over the schedules. Modules that need another one define their own."""
    with col.Runtime(**PATHS[request.param]) as runtime:
        yield runtime


@pytest.fixture
def link_runtime() -> Iterator[col.Runtime]:
    """A Runtime that runs the strategies' algorithms for every size (no in-process fast path)."""
    with col.Runtime(fuse_below=0, share_below=0) as rt:
        yield rt


@pytest.fixture(autouse=True)
def _reset_default_runtime() -> Iterator[None]:
    yield
    col.reset()


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the ``collective`` command run with ``argv`` in this process."""
    from collective import cli

    try:
        status = cli.main(argv)
    except SystemExit as exit_:
        status = int(exit_.code or 0)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


class PeerFailed(AssertionError):
    pass


def run_peers(
    n: int, body: Callable[[int], Any], runtime: col.Runtime | None = None, timeout: float = JOIN_TIMEOUT
) -> list[Any]:
    """Run ``body(peer)`` in ``n`` threads; return results by peer, re-raising the first failure tagged.

    A thread still running after ``timeout`` fails the test (and the runtime is reset to free it).
    """
    outcomes = outcomes_of_peers(n, body, runtime, timeout)
    for peer, outcome in enumerate(outcomes):
        if isinstance(outcome, BaseException):
            raise PeerFailed(f"peer {peer} raised {outcome!r}") from outcome
    return outcomes


def outcomes_of_peers(
    n: int, body: Callable[[int], Any], runtime: col.Runtime | None = None, timeout: float = JOIN_TIMEOUT
) -> list[Any]:
    """Like run_peers, but returns each peer's result or the exception it raised."""
    outcomes: list[Any] = [None] * n

    def target(peer: int) -> None:
        try:
            outcomes[peer] = body(peer)
        except BaseException as exc:
            outcomes[peer] = exc

    threads = [
        threading.Thread(target=target, args=(peer,), name=f"peer-{peer}", daemon=True) for peer in range(n)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    stuck = [peer for peer, thread in enumerate(threads) if thread.is_alive()]
    if stuck:
        (runtime or col.default_runtime()).reset()
        for thread in threads:
            thread.join(5)
        raise PeerFailed(f"peers {stuck} still running after {timeout}s: a hang")
    return outcomes


def peer_input(
    peer: int, shape: tuple[int, ...], dtype: Any, seed: int = 0, small: bool = False
) -> np.ndarray:
    """Deterministic per-peer data; ``small`` keeps values in -3..3 so products stay exact."""
    rng = np.random.default_rng(seed * 1009 + peer)
    dt = np.dtype(dtype)
    if dt.kind in "iu" or small:
        low, high = (-3, 4) if small else (-100, 101)
        if dt.kind == "u":
            low = 0
        return np.asarray(rng.integers(low, high, size=shape)).astype(dt)
    values = np.asarray(rng.standard_normal(size=shape) * 10)
    if dt.kind == "c":
        values = np.asarray(values + 1j * rng.standard_normal(size=shape))
    return values.astype(dt)


def reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    """op over the inputs in the inputs' dtype (integers wrap as numpy does; mean floors for ints):
    the conformance matrix's one reference (tests/matrix.py)."""
    from tests.matrix import reduced

    return reduced(inputs, op)


def tolerance(dtype: Any, peers: int) -> float:
    """Relative tolerance for a reduction of ``peers`` floating arrays in ``dtype``."""
    name = np.dtype(dtype).name
    eps = {"float16": 2**-10, "bfloat16": 2**-7, "float32": 2**-23, "complex64": 2**-23}.get(name, 2**-52)
    return 4 * peers * eps


def assert_matches(actual: np.ndarray, expected: np.ndarray, peers: int) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.dtype.kind in "iu":
        np.testing.assert_array_equal(actual, expected)
    else:
        rtol = tolerance(expected.dtype, peers)
        a, e = actual.astype(np.complex128), expected.astype(np.complex128)
        scale = np.max(np.abs(e)) if e.size else 0.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale)
