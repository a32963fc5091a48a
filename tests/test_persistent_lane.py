"""Persistent uses between processes of a host run in their lane (collective.shm.group's
``ShmGroup.lane``, under ``Rendezvous.lane``): after a handle's first uses, a use is one function per
layer with what stays the same bound once, and the general step runs only for what is not the
common case. Its results are the general step's, whatever other calls of the group come between
uses, and every failure of a use is still named on every peer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.processes import Proc, expect_peer_lost, finish_all, node_env

WORKER = str(Path(__file__).with_name("lane_worker.py"))
KINDS = ["all_reduce", "mean", "all_gather", "reduce_scatter", "broadcast", "barrier", "kept"]


def start(orchestrator: str, job: str, mode: str, world: int = 2, **extra: str) -> list[Proc]:
    return [
        Proc([sys.executable, WORKER, mode], node_env(orchestrator, job, rank, world, 1, **extra))
        for rank in range(world)
    ]


def general_steps(proc: Proc) -> dict[str, tuple[int, bool, int]]:
    """What a worker said of each handle: (its uses, whether it found its lane, the general steps
    they ran: the first use's, the first in each of the group's two slots, and each use whose
    lane ended in the general wait: its short spin saw another process late, as a busy CPU makes
    it now and then)."""
    found = {}
    for _, line in proc.lines:
        if line.startswith("GENERAL "):
            _, name, uses, lane, steps = line.split()
            found[name] = (int(uses), lane == "1", int(steps))
    return found


def in_lane(found: dict[str, tuple[int, bool, int]]) -> int:
    """The uses that ran in their lane to the end."""
    return sum(uses - steps for uses, _, steps in found.values())


@pytest.mark.parametrize("world", [2, 3])
def test_every_kind_runs_its_uses_in_the_lane_with_the_general_steps_results(
    orchestrator: str, world: int
) -> None:
    procs = start(orchestrator, f"lane-uses-{world}", "uses", world)
    assert finish_all(procs, 60) == [0] * world, [proc.output() for proc in procs]
    for proc in procs:
        proc.wait_for(f"OK {24 * len(KINDS)}", 5)
        found = general_steps(proc)
        assert sorted(found) == sorted(KINDS), proc.output()
        assert all(lane for _, lane, _ in found.values()), found
        assert in_lane(found) > 0, found  # (0 without lanes; more processes than CPUs: they yield)


def test_a_use_that_reads_the_others_after_they_went_on_stays_in_its_lane(orchestrator: str) -> None:
    procs = start(orchestrator, "lane-behind", "behind", 2)
    assert finish_all(procs, 60) == [0, 0], [proc.output() for proc in procs]
    _, line = procs[1].wait_for("BEHIND", 5)
    assert line == "BEHIND 0", procs[1].output()  # (peer 0's uses wait for peer 1's: general waits)


def test_a_use_whose_step_the_group_let_go_finds_its_lane_again(orchestrator: str) -> None:
    """A group keeps what the last step of a bounded number of repeated calls found: past that,
    the handle whose step it let go runs a few general steps and then its lane again (not the
    general step for every use from then on)."""
    procs = start(orchestrator, "lane-evicted", "evicted", 2)
    assert finish_all(procs, 60) == [0, 0], [proc.output() for proc in procs]
    for proc in procs:
        _, line = proc.wait_for("EVICTED", 5)
        # (32 before: its lane bound the step let go; here 3-17, uses whose spin saw the other late
        # among them)
        assert int(line.split()[1]) < 32, proc.output()


def test_the_general_step_runs_every_use_without_shared_memory(orchestrator: str) -> None:
    """Between nodes (COLLECTIVE_SHM=0) no use has a lane; the same uses give the same results."""
    procs = start(orchestrator, "lane-noshm", "uses", 2, shm="0")
    assert finish_all(procs, 60) == [0, 0], [proc.output() for proc in procs]
    for proc in procs:
        proc.wait_for(f"OK {24 * len(KINDS)}", 5)
        assert general_steps(proc) == {name: (24, False, 0) for name in KINDS}  # (no shared-memory step)


def test_a_process_lost_while_the_others_use_their_lane_is_named_on_every_survivor(orchestrator: str) -> None:
    procs = start(orchestrator, "lane-lost", "lost", 2, timeout="30")
    left, _ = procs[1].wait_for("LEAVING", 60)
    expect_peer_lost([procs[0]], left, within=5, naming="peer 1")
    assert procs[1].wait(10) == 0
    assert all(general_steps(proc)["all_reduce"][1] for proc in procs), [p.output() for p in procs]


def test_a_free_met_by_a_use_in_its_lane_is_a_mismatch_on_every_peer(orchestrator: str) -> None:
    procs = start(orchestrator, "lane-freed", "freed", 2)
    assert finish_all(procs, 60) == [0, 0], [proc.output() for proc in procs]
    assert all(general_steps(proc)["all_reduce"][1] for proc in procs), [p.output() for p in procs]


def test_a_late_use_after_uses_in_the_lane_times_out_naming_the_late_peer_everywhere(
    orchestrator: str,
) -> None:
    procs = start(orchestrator, "lane-late", "late", 2)
    assert finish_all(procs, 60) == [0, 0], [proc.output() for proc in procs]
    for proc in procs:
        _, line = proc.wait_for("TIMEOUT", 5)
        assert "peer 1" in line and "0.5s" in line, line
