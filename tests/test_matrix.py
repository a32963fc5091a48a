"""The executor conformance matrix (tests/matrix.py) over every execution path.

One table of cases and one numpy reference; each job runs the whole table on every peer and
checks every result bit for bit. Every job asserts: no failure, every peer checked exactly the
cases of its groups, and every step took the expected path, per group, as the executors' DEBUG
log tells it (``collective.executors``: "<label> of group <members>: <path>"), no path else.

* threads of one process (``col.Runtime``): "fused" (the default limits: mid-size steps go
  "shared" and steps past 4 MiB "linked"), "shared" (no fusing) and "linked" (every strategy for
  every kind), at 1, 2, 3 and 5 peers (not Tree(k) of at most k peers: Tree(k - 1)'s schedule);
* processes of one host, one peer each: "shm";
* nodes of several peers (3 x 2 threads) and one-peer processes without shared memory
  (COLLECTIVE_SHM=0): "three phases"; the global strategies rotate over the kinds in the jobs of
  several nodes, and each strategy runs for every kind on the cases that move over the link
  between nodes (steps past 64 KiB: smaller ones travel with the call exchange);
* one-peer processes on emulated hosts (COLLECTIVE_HOST_ID "aabb", "aab", and "abab", whose ranks
  are not numbered host by host): "host tier".

A group of one in a multi-process job runs through shared memory ("shm") wherever its process has
a ring segment; on "aab" the peers but rank 0 are one process per host: "three phases".
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import collective as col
from tests import matrix
from tests.conftest import run_peers
from tests.processes import Proc, finish_all, node_env

WORKER = str(Path(__file__).with_name("matrix_worker.py"))
FUSE_BELOW, SHARE_BELOW = 64 << 10, 4 << 20  # the default Runtime's limits (docs/architecture.md)
LIMITS: dict[str, dict[str, int]] = {
    "fused": {},
    "shared": {"fuse_below": 0},
    "linked": {"fuse_below": 0, "share_below": 0},
}
STRATEGIES: list[Any] = [col.Centralized(), col.Tree(1), col.Tree(2), col.Tree(3), col.Ring(), col.Direct()]
_FIELDS = [field.name for field in dataclasses.fields(col.CollectiveConfig)]
LOCAL_FIELDS = [name for name in _FIELDS if name.startswith("local_") and name.endswith("_strategy")]
GLOBAL_FIELDS = [name for name in _FIELDS if name.startswith("global_") and name.endswith("_strategy")]
_jobs = itertools.count()


def _same_tree_as_a_smaller_k(strategy: Any, peers: int) -> bool:
    """Whether Tree(k) of ``peers`` peers is Tree(k - 1)'s schedule: every non-root peer a child of
    the root already (peers <= k), so a job of it would run the same messages twice."""
    return isinstance(strategy, col.Tree) and strategy.arity > 1 and peers <= strategy.arity


@pytest.fixture
def paths_seen() -> Iterator[matrix.PathCounter]:
    """The executor path of every step logged while the test runs (threads of this process)."""
    counter = matrix.PathCounter()
    with counter.attached():
        yield counter


def _report(failures: list[str], limit: int = 40) -> str:
    """The first ``limit`` failures, one a line, for an assertion message."""
    shown = "\n".join(failures[:limit])
    return f"{len(failures)} failures:\n{shown}" + ("\n..." if len(failures) > limit else "")


# -- the table itself ------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 5, 6])
def test_the_table_covers_every_axis(world: int) -> None:
    """What every job below runs: a pruning of the table must not drop an axis."""
    cases = matrix.build_cases(world)
    assert {case.kind for case in cases} == set(matrix.SPECS)
    assert {case.members for case in cases} == set(matrix.group_shapes(world))
    assert len({case.label for case in cases}) == len(cases)
    for members in matrix.group_shapes(world):
        n = world if members is None else len(members)
        for kind, spec in matrix.SPECS.items():
            mine = [case for case in cases if case.kind == kind and case.members == members]
            if kind == "barrier":
                continue
            assert {case.out for case in mine} == set(spec.out_modes), kind
            assert {case.dtype for case in mine} == set(matrix.DTYPES), kind
            if spec.reduces:
                pairs = {(case.dtype, case.op) for case in mine}
                assert pairs >= {(d, op) for d in matrix.DTYPES for op in matrix.ops_of(d)}, kind
            if spec.rooted:
                assert {case.root for case in mine} == set(range(n)), kind
                for root in range(n):  # each root below and above 64 KiB
                    sizes = [case.spec.step_bytes(case, n)[0] for case in mine if case.root == root]
                    assert min(sizes) <= 64 << 10 < max(sizes), (kind, root)
            blocks = [case.block for case in mine]
            assert (0,) in blocks and (1,) in blocks and (17,) in blocks and any(len(b) > 1 for b in blocks)
            assert (() in blocks) == spec.zero_d, kind
            assert any(case.view for case in mine), kind
            largest = max(case.spec.step_bytes(case, n)[0] for case in mine)
            assert largest > 4 << 20, kind  # past every limit (1 MiB chunks, 4 MiB shared)
            if n > 1:
                assert (n - 1,) in blocks, kind  # fewer elements than peers
    assert {case.variant for case in cases} == {"", "mixed", "many"}  # coalesced lists of two dtypes


# -- threads of one process ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ThreadJob:
    """One Runtime's job of ``peers`` threads on ``path``'s limits, every local strategy ``strategy``."""

    path: str
    peers: int
    strategy: Any = None
    large: bool = False  # blocks past 1 MiB and 4 MiB too

    @property
    def id(self) -> str:
        return "-".join(
            [self.path, *([str(self.strategy)] if self.strategy else []), f"{self.peers}peers"]
        ) + ("-large" if self.large else "")

    def names(self) -> set[str]:
        """The paths its steps take: mid-size steps skip fusing, steps past 4 MiB take the link."""
        if self.path == "fused":
            return {"fused", "shared"} | ({"linked"} if self.large else set())
        if self.path == "shared":
            return {"shared"} | ({"linked"} if self.large else set())
        return {"linked"}


THREAD_JOBS = (
    [ThreadJob("fused", n, large=n >= 3) for n in (1, 2, 3, 5)]
    + [ThreadJob("shared", n, large=n == 3) for n in (1, 2, 3, 5)]
    + [ThreadJob("linked", 1, col.Ring())]
    + [
        ThreadJob("linked", n, s, large=n == 3)
        for s in STRATEGIES
        for n in (2, 3, 5)
        if not _same_tree_as_a_smaller_k(s, n)
    ]
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("job", THREAD_JOBS, ids=lambda job: job.id)
def test_threads_of_one_process(job: ThreadJob, paths_seen: matrix.PathCounter) -> None:
    """One Runtime, ``job.peers`` threads: every peer runs the table; then the paths are checked."""
    n = job.peers
    cases = matrix.build_cases(n, large=job.large)
    strategies = {name: job.strategy for name in LOCAL_FIELDS} if job.strategy else {}
    config = col.CollectiveConfig(num_devices=n, timeout=20, **strategies)

    with col.Runtime(**LIMITS[job.path]) as rt:

        def body(peer: int) -> matrix.Failures:
            rt.register(peer, "cpu", config)
            try:
                return matrix.run_table(rt, peer, n, cases)
            finally:
                rt.finish(peer)

        outcomes = run_peers(n, body, rt, timeout=100)
    failures = [failure for outcome in outcomes for failure in outcome]
    assert not failures, _report(failures)
    assert [o.checked for o in outcomes] == [matrix.cases_of_peer(cases, n, p) for p in range(n)]
    fuse, share = (
        LIMITS[job.path].get("fuse_below", FUSE_BELOW),
        LIMITS[job.path].get("share_below", SHARE_BELOW),
    )
    expected = matrix.routes(cases, n, range(n), lambda case: matrix.local_paths(case, n, fuse, share))
    assert set(paths_seen.paths()) == job.names(), paths_seen.paths()
    assert paths_seen.routes == expected, "steps per (group, path) differ from the limits' choice"
    assert not paths_seen.unread


# -- processes -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProcessJob:
    """One multi-process job: ``processes`` workers of ``devices`` peers each (``hosts``: one letter
    per process, its COLLECTIVE_HOST_ID), and the path each group shape must take."""

    name: str
    processes: int
    devices: int
    whole: str  # the path of the whole job's steps
    rest: str  # of the peers but rank 0 (matrix.group_shapes)
    one: str  # of the group of one (the last peer)
    hosts: str = ""
    env: tuple[tuple[str, str], ...] = ()  # COLLECTIVE_<KEY> variables: (key, value)
    profile: str = "full"  # the table (matrix.PROFILES)

    @property
    def world(self) -> int:
        return self.processes * self.devices

    def paths(self) -> dict[tuple[int, ...], str]:
        """The path of each group of the table, by its members."""
        whole, rest, one = matrix.group_shapes(self.world)
        assert whole is None and rest is not None and one is not None
        return {tuple(range(self.world)): self.whole, rest: self.rest, one: self.one}


GLOBAL_NAMES = ["centralized", "tree:1", "tree:2", "tree:3", "ring", "direct"]


def rotated(turn: int) -> tuple[tuple[str, str], ...]:
    """Each kind's global strategy from the list rotated by ``turn`` (jobs of different turns give
    each kind a different strategy)."""
    return tuple((name, GLOBAL_NAMES[(i + turn) % len(GLOBAL_NAMES)]) for i, name in enumerate(GLOBAL_FIELDS))


def every(strategy: str) -> tuple[tuple[str, str], ...]:
    """``strategy`` among the nodes for every kind."""
    return tuple((name, strategy) for name in GLOBAL_FIELDS)


NO_SHM = [
    ProcessJob(
        f"noshm-3-{s}",
        3,
        1,
        "three phases",
        "three phases",
        "three phases",
        env=(("shm", "0"), *every(s)),
        profile="past64k",
    )
    for s in GLOBAL_NAMES
    if s != "tree:3"  # (of 3 nodes: the schedule of tree:2, a root and its two children)
]
PROCESS_JOBS = [
    ProcessJob("shm-3", 3, 1, "shm", "shm", "shm"),
    ProcessJob("nodes-3x2", 3, 2, "three phases", "three phases", "shm", env=rotated(0)),
    ProcessJob("noshm-3", 3, 1, "three phases", "three phases", "three phases", env=(("shm", "0"),)),
    *NO_SHM,
    ProcessJob("hosts-aabb", 4, 1, "host tier", "host tier", "shm", "aabb", rotated(1)),
    ProcessJob("hosts-aab", 3, 1, "host tier", "three phases", "shm", "aab", rotated(2)),
    ProcessJob(
        "hosts-abab", 4, 1, "host tier", "host tier", "shm", "abab", rotated(3)
    ),  # ranks not host by host
]


@dataclasses.dataclass
class Output:
    """What one worker printed: its MATRIX counts, FAIL lines, steps per (members, path), errors."""

    checked: int = -1
    failures: list[str] = dataclasses.field(default_factory=list)
    routes: Counter[tuple[tuple[int, ...], str]] = dataclasses.field(default_factory=Counter)
    paths: Counter[str] = dataclasses.field(default_factory=Counter)
    errors: list[str] = dataclasses.field(default_factory=list)  # ERROR, UNREAD, a traceback


def parse(proc: Proc) -> Output:
    """Read a worker's output lines (tests/matrix_worker.py)."""
    found = Output()
    for _, line in proc.lines:
        word, _, rest = line.partition(" ")
        if word == "MATRIX":
            checked, failures = rest.split()
            found.checked = int(checked)
            assert int(failures) == sum(1 for _, ln in proc.lines if ln.startswith("FAIL ")), proc.output()
        elif word == "FAIL":
            found.failures.append(rest)
        elif word == "PATH":
            path, steps = rest.rsplit(" ", 1)
            found.paths[path] += int(steps)
        elif word == "GROUP":
            members, path_steps = rest.split(" ", 1)
            path, steps = path_steps.rsplit(" ", 1)
            found.routes[(tuple(int(p) for p in members.split(",")), path)] += int(steps)
        elif word in ("ERROR", "UNREAD", "Traceback"):
            found.errors.append(line)
    return found


def start(orchestrator: str, job: ProcessJob) -> list[Proc]:
    """Every worker of ``job``; one that fails to start kills those already started."""
    name = f"matrix-{os.getpid()}-{next(_jobs)}"
    procs: list[Proc] = []
    try:
        for rank in range(job.processes):
            host = {"host_id": job.hosts[rank]} if job.hosts else {}
            env = node_env(orchestrator, name, rank, job.processes, job.devices, **host, **dict(job.env))
            procs.append(Proc([sys.executable, WORKER, job.profile], env))
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    return procs


@pytest.mark.timeout(150)
@pytest.mark.parametrize("job", PROCESS_JOBS, ids=lambda job: job.name)
def test_processes(orchestrator: str, job: ProcessJob) -> None:
    """One job of real processes: every worker runs the table on its peers and reports."""
    procs = start(orchestrator, job)
    codes = finish_all(procs, 120)  # (reaps every one, killing those still running)
    world = job.world
    cases = matrix.build_cases(world, **matrix.PROFILES[job.profile])
    by_group = matrix.by_group(world, job.paths())
    outputs = [parse(proc) for proc in procs]
    raised = [rank for rank, out in enumerate(outputs) if out.errors]
    assert not raised, "\n".join(
        f"process {r} exited {codes[r]}:\n{procs[r].output()[-4000:]}" for r in raised
    )
    failures = [failure for out in outputs for failure in out.failures]
    assert not failures, _report(failures)
    for rank, (proc, code, out) in enumerate(zip(procs, codes, outputs, strict=True)):
        assert code == 0, f"process {rank} exited {code}:\n{proc.output()[-6000:]}"
        local = range(rank * job.devices, (rank + 1) * job.devices)
        assert out.checked == sum(matrix.cases_of_peer(cases, world, p) for p in local), proc.output()[-2000:]
        expected = matrix.routes(cases, world, local, by_group)
        assert set(out.paths) == {path for (_, path) in expected}, f"process {rank}: {out.paths}"
        assert out.routes == expected, f"process {rank}: steps per (group, path) {out.routes} != {expected}"
    seen = {path for (_, path) in matrix.routes(cases, world, range(world), by_group)}
    assert seen == {job.whole, job.rest, job.one}  # (the table ran on every group shape)
