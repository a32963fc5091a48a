"""The host tier: a multi-node job whose hosts each run several of its processes (one peer each).

Real processes on 127.0.0.1 (tests/shm_worker.py), with ``COLLECTIVE_HOST_ID`` naming the host each
one runs on: processes of one named host meet in shared memory, the hosts' leaders over ZeroMQ.
Every worker checks its results bit for bit and reports its shared-memory steps.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import time
from pathlib import Path

import pytest

from tests.processes import Proc, expect_peer_lost, finish_all, node_env

pytestmark = pytest.mark.timeout(120)
WORKER = str(Path(__file__).with_name("shm_worker.py"))
_jobs = itertools.count()


def start(address: str, hosts: str, *argv: str) -> list[Proc]:
    """One process per letter of ``hosts`` ("aab": two on host a, one on host b)."""
    job = f"tier-{os.getpid()}-{next(_jobs)}"
    return [
        Proc([sys.executable, WORKER, *argv], node_env(address, job, rank, len(hosts), 1, host_id=host))
        for rank, host in enumerate(hosts)
    ]


def errors_of(proc: Proc) -> list[str]:
    return [line for _, line in proc.lines if line.startswith("ERROR")]


@pytest.mark.parametrize("hosts", ["aab", "abb", "abc"])
def test_groups_on_several_hosts_run_at_once_from_two_threads(orchestrator: str, hosts: str) -> None:
    """The whole job and the pair of peers 0 and 1 at once, from two threads of each process."""
    procs = start(orchestrator, hosts, "concurrent")
    for proc, code in zip(procs, finish_all(procs, 100), strict=True):
        assert code == 0, proc.output()


@pytest.mark.parametrize("hosts", ["aab", "abb"])
@pytest.mark.parametrize(
    ("how", "kind", "expected"),
    [
        ("shape", "MismatchError", "shape: "),
        ("collective", "MismatchError", "peers called different collectives"),
        ("broadcast", "MismatchError", "exactly one peer (the root) must pass an array"),
        ("root", "MismatchError", "root: "),
        ("invalid", "InvalidArgumentError", "peer 0: unsupported dtype bool"),
    ],
)
def test_a_mismatch_on_one_host_or_between_hosts_fails_every_process_and_the_job_goes_on(
    orchestrator: str, hosts: str, how: str, kind: str, expected: str
) -> None:
    """Peer 0 differs: found on its own host (aab) or only among the hosts' leaders (abb)."""
    procs = start(orchestrator, hosts, "mismatch", how)
    for proc, code in zip(procs, finish_all(procs, 60), strict=True):
        (line,) = errors_of(proc)
        assert code == 3 and line.startswith(f"ERROR {kind}") and expected in line, proc.output()
        assert re.search(r"peers? 0\b", line), line  # names the one that differs
        assert set(re.findall(r"#(\d+)", line)) == {"2"}, line  # the caller's number, not a step's
        proc.wait_for("AFTER", 1)  # the next collective ran, and was right


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("sources", "node 0 (peers 0-1), node 2 (peer 2) passed one"),
        ("out", "node 0 (peers 0-1) passed (7,)"),
    ],
)
def test_a_host_disagreeing_through_a_process_that_does_not_lead_it_names_the_host_s_processes(
    orchestrator: str, how: str, expected: str
) -> None:
    """Peer 1 (on host a after peer 0, its leader) passed a second source or a wrong out: the
    hosts' leaders named host a's call "node 0 (peer 0)", the one process there that did nothing."""
    procs = start(orchestrator, "aab", "mismatch", how)
    for proc, code in zip(procs, finish_all(procs, 60), strict=True):
        (line,) = errors_of(proc)
        assert code == 3 and line.startswith("ERROR MismatchError") and expected in line, proc.output()
        proc.wait_for("AFTER", 1)


@pytest.mark.parametrize("victim", [1, 2, 3])
def test_a_killed_process_is_a_peer_lost_error_on_every_host_within_seconds(
    orchestrator: str, victim: int
) -> None:
    """Peer 1: a host's other process; 2: the other host's leader; 3: its other process."""
    procs = start(orchestrator, "aabb", "loop")
    try:
        procs[0].wait_for("READY", 60)  # (peer 0's 20th all_reduce: every process runs the loop)
        procs[victim].kill()
        killed = time.monotonic()
        expect_peer_lost([proc for rank, proc in enumerate(procs) if rank != victim], killed, 3.0)
    finally:
        finish_all(procs, 30)


def test_a_leader_failing_in_shared_memory_fails_the_other_hosts_at_once_and_the_job_goes_on(
    orchestrator: str,
) -> None:
    """Peer 0 (host a's leader) raises MemoryError inside its host's step; its host's other
    process and the other host hear of it without waiting for their 60 s timeout."""
    procs = start(orchestrator, "aab", "crash")
    started = time.monotonic()
    codes = finish_all(procs, 60)
    assert time.monotonic() - started < 30
    assert codes == [0, 0, 0], [p.output() for p in procs]
    assert errors_of(procs[0]) == ["ERROR MemoryError - simulated"]
    for proc in procs[1:]:
        (line,) = errors_of(proc)
        assert line.startswith("ERROR PeerLostError") and "MemoryError" in line, line
    assert all("AFTER" in proc.output() for proc in procs)


@pytest.mark.parametrize("hosts", ["aab", "abb", "abc"])
def test_a_late_process_is_named_by_the_timeout_everywhere_itself_included(
    orchestrator: str, hosts: str
) -> None:
    """Peer 2 comes 3 s late to a call with a 1 s timeout (past the others' 1 s grace): every
    process's CollectiveTimeout names it, on its host (found in shared memory), on the others
    (found by the leaders), and its own when it comes (the others' verdict is waiting for it)."""
    procs = start(orchestrator, hosts, "late", "3")
    for proc, code in zip(procs, finish_all(procs, 60), strict=True):
        assert code == 0, proc.output()
        _, line = proc.wait_for("TIMEOUT", 1)
        assert line.startswith("TIMEOUT [2]") and "peer 2" in line, line


@pytest.mark.parametrize("hosts", ["aab", "abc"])
def test_a_process_coming_just_before_the_others_give_up_is_a_timeout_everywhere(
    orchestrator: str, hosts: str
) -> None:
    """Peer 2 comes 1.75 s late to a call with a 1 s timeout: the others give up at 2 s (timeout
    and grace), too soon to be sure its call reaches them, so it does not join the step and every
    process raises the same CollectiveTimeout (it used to be a race: at the edge, some completed
    the step and some did not)."""
    procs = start(orchestrator, hosts, "late", "1.75")
    for proc, code in zip(procs, finish_all(procs, 60), strict=True):
        assert code == 0, proc.output()
        _, line = proc.wait_for("TIMEOUT", 1)
        assert line.startswith("TIMEOUT [2]") and "peer 2" in line, line


@pytest.mark.parametrize("hosts", ["ab", "aabb"])
@pytest.mark.parametrize("how", ["same", "differ"])
def test_a_coalesced_call_of_thousands_of_arrays_is_checked_across_hosts(
    orchestrator: str, hosts: str, how: str
) -> None:
    """3000 arrays: their list travels between hosts as its first 4 and a digest of all, so a
    difference deep in the list is still a MismatchError everywhere."""
    procs = start(orchestrator, hosts, "many", how)
    for proc, code in zip(procs, finish_all(procs, 60), strict=True):
        assert code == 0, proc.output()
        mismatch = [line for _, line in proc.lines if line.startswith("MISMATCH")]
        assert len(mismatch) == (1 if how == "differ" else 0), proc.output()
        assert how == "same" or "parts: " in mismatch[0], mismatch


def test_groups_whose_host_tiers_hold_the_same_processes_keep_apart(orchestrator: str) -> None:
    """Hosts aabb: the job and the group of peers 0-2 both meet peers 0 and 1 in shared memory."""
    procs = start(orchestrator, "aabb", "overlap")
    for proc, code in zip(procs, finish_all(procs, 60), strict=True):
        assert code == 0, proc.output()


def test_a_leader_failing_in_its_global_phase_fails_every_host_at_once_and_the_job_goes_on(
    orchestrator: str,
) -> None:
    procs = start(orchestrator, "aabb", "lead_fails")
    started = time.monotonic()
    codes = finish_all(procs, 60)
    assert time.monotonic() - started < 20, "nobody may wait for its 30 s timeout"
    assert codes == [0, 0, 0, 0], [p.output() for p in procs]
    assert errors_of(procs[0]) == ["ERROR MemoryError - simulated"]
    for proc in procs[1:]:
        (line,) = errors_of(proc)
        assert line.startswith("ERROR PeerLostError") and "MemoryError" in line, line
    assert all("AFTER" in proc.output() for proc in procs)
