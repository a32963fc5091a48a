"""The Shm executor: one-peer processes of one host run every collective through shared memory.

Real processes on 127.0.0.1 (tests/shm_worker.py), one peer each, meeting through an orchestrator;
every worker checks its results bit for bit and reports how many steps went through shared memory.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from collective.shm.chunks import Pieces
from tests.processes import Proc, expect_peer_lost, finish_all, node_env

pytestmark = pytest.mark.timeout(120)
WORKER = str(Path(__file__).with_name("shm_worker.py"))
_jobs = itertools.count()


def start(address: str, processes: int, *argv: str, **extra: object) -> list[Proc]:
    job = f"shm-{os.getpid()}-{next(_jobs)}"
    return [
        Proc([sys.executable, WORKER, *argv], node_env(address, job, rank, processes, 1, **extra))
        for rank in range(processes)
    ]


def errors_of(proc: Proc) -> list[str]:
    return [line for _, line in proc.lines if line.startswith("ERROR")]


@pytest.mark.parametrize("shm", ["1", "0"])
def test_big_endian_arrays_move_between_processes_and_a_long_double_is_refused_everywhere(
    orchestrator: str, shm: str
) -> None:
    """Over shared memory and (shm=0) over ZeroMQ: a '>f4' call was undecodable there (a
    MismatchError, a broadcast root alone succeeding, a send dropped and its recv timing out)."""
    procs = start(orchestrator, 2, "byte_order", shm=shm)
    for proc, code in zip(procs, finish_all(procs, 60), strict=True):
        assert code == 0, proc.output()
        _, line = proc.wait_for("OK", 1)
        _, _, _, steps = line.split()
        assert (int(steps) > 0) == (shm == "1"), line


def test_a_collective_after_a_process_finished_says_it_left(orchestrator: str, tmp_path: Path) -> None:
    """It said 'the shared memory of peer 1 cannot be mapped here: [Errno 2] No such file'. Peer 2,
    coming after peer 0 had failed and ended too, named peer 0 alone (seen in CI): now both."""
    procs = start(orchestrator, 3, "leaves", str(tmp_path))
    try:
        for ended, then in ((1, 0), (0, 2)):  # peer 0 comes once peer 1 ended, peer 2 once peer 0 did
            procs[ended].wait(60)
            (tmp_path / f"go-{then}").touch()
    finally:
        codes = finish_all(procs, 60)
    assert codes[1] == 0, procs[1].output()
    for proc, code, gone in zip(procs[::2], codes[::2], ("peer 1", "peers 0-1"), strict=True):
        (line,) = errors_of(proc)
        assert code == 3 and line.startswith("ERROR PeerLostError"), proc.output()
        assert re.search(rf"{gone}\)? left the job", line), line


def test_a_process_that_finished_and_exited_left_it_did_not_die(orchestrator: str, tmp_path: Path) -> None:
    """Its segment says it finished, but its pid was looked at first: 'peer 2 (process P) died'."""
    procs = start(orchestrator, 3, "leaves_after", str(tmp_path))
    try:
        procs[2].wait_for("FINISHING", 60)  # the others come once peer 2 is finishing
        for peer in (0, 1):
            (tmp_path / f"go-{peer}").touch()
    finally:
        codes = finish_all(procs, 60)
    assert codes[2] == 0, procs[2].output()
    for proc, code in zip(procs[:2], codes[:2], strict=True):
        (line,) = errors_of(proc)
        assert code == 3 and line.startswith("ERROR PeerLostError"), proc.output()
        assert "peer 2 left the job" in line and "died" not in line, line


def test_more_groups_than_channels_take_turns(orchestrator: str) -> None:
    """5 processes, every subset twice: each process is in 16 groups, its segment has 8 channels."""
    procs = start(orchestrator, 5, "groups")
    for proc, code in zip(procs, finish_all(procs, 100), strict=True):
        assert code == 0, proc.output()
        _, line = proc.wait_for("OK", 1)
        assert line.split()[1] == line.split()[3] == "32", line


@pytest.mark.parametrize(("extra", "how"), [("0", "calls"), ("2", "calls"), ("2", "persistent")])
def test_a_channel_evicted_by_one_member_is_found_anew_by_the_others(
    orchestrator: str, extra: str, how: str
) -> None:
    """Peer 0 evicts the channel of group [0, 1] and gives it to another group, which steps on:
    peer 1 held it; reading it on would hang (0 extra steps) or give that group's values (2), the
    same for uses of a persistent all_reduce (which repeat what their last step found)."""
    procs = start(orchestrator, 5, "evicted", extra, how)
    for proc, code in zip(procs, finish_all(procs, 100), strict=True):
        assert code == 0, proc.output()
        proc.wait_for("OK", 1)


@pytest.mark.parametrize("elements", ["16", "300000"])
def test_a_step_a_process_gave_up_before_it_had_a_channel_fails_for_the_others(
    orchestrator: str, elements: str, tmp_path: Path
) -> None:
    """Its next step's channel said the step had ended: the others summed the data another group had
    left in that channel (a silent wrong result), inline or in chunks."""
    procs = start(orchestrator, 5, "no_channel", elements, str(tmp_path))
    try:
        procs[0].wait_for("NOCHANNEL", 60)  # the others come once peer 0's call on G timed out
        for peer in range(1, 5):
            (tmp_path / f"go-{peer}").touch()
    finally:
        codes = finish_all(procs, 100)
    for proc, code in zip(procs, codes, strict=True):
        assert code == 0, proc.output()
    _, line = procs[0].wait_for("NOCHANNEL", 1)
    assert "no shared-memory channel of this process came free for group peers 0, 2, 4" in line, line
    for rank in (2, 4):
        _, line = procs[rank].wait_for("TOLD", 1)
        assert "peer 0 gave up" in line and "no shared-memory channel" in line, line


def test_a_group_waiting_for_an_absent_member_keeps_its_channel(orchestrator: str) -> None:
    """Every later group of peer 0 that needed a channel gave up G's: its release waited for peer 1
    until that group's timeout, naming peer 1 (no member), and the next group chose G again."""
    procs = start(orchestrator, 5, "absent")
    for proc, code in zip(procs, finish_all(procs, 100), strict=True):
        assert code == 0, proc.output()
    _, line = procs[0].wait_for("TIMEOUT", 1)
    assert "waited 0.5s for peer 1" in line, line
    _, line = procs[0].wait_for("OK", 1)
    assert line.split()[1] == "7", line  # peer 0's groups among the 11 of peers 0, 2, 3, 4


def test_a_step_given_up_fails_for_every_member_and_its_channel_waits_for_them(orchestrator: str) -> None:
    """A member still inside a step another gave up summed the data of the group that got the
    giver's channel (it had never looked that member's channel up, so gave it away)."""
    procs = start(orchestrator, 6, "gave_up")
    for proc, code in zip(procs, finish_all(procs, 100), strict=True):
        assert code == 0, proc.output()
    for rank in (0, 1, 2):
        _, line = procs[rank].wait_for("GAVE", 1)
        assert line.startswith("GAVE CollectiveTimeout") and "waited 0.5s for peer 1" in line, line


def test_a_group_that_never_mapped_its_members_gives_its_channel_up(
    orchestrator: str, tmp_path: Path
) -> None:
    """Its first step failed mapping a member that had left: every later eviction raised IndexError."""
    procs = start(orchestrator, 6, "unmapped", str(tmp_path))
    try:
        procs[1].wait(60)  # peer 0 comes once peer 1's process ended
        (tmp_path / "go-0").touch()
    finally:
        codes = finish_all(procs, 100)
    for proc, code in zip(procs, codes, strict=True):
        assert code == 0, proc.output()
    _, line = procs[0].wait_for("OK", 1)
    assert line.split()[1] == "15", line  # every group of peers 0, 2, 3, 4, 5 with peer 0


def test_two_groups_of_one_process_run_at_once_from_two_threads(orchestrator: str) -> None:
    procs = start(orchestrator, 3, "concurrent")
    for proc, code in zip(procs, finish_all(procs, 100), strict=True):
        assert code == 0, proc.output()


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("shape", "shape: peer 0 passed (5,), peers 1-2 passed (4,)"),
        ("dtype", "dtype: peer 0 passed float32, peers 1-2 passed float64"),
        ("op", "op: peer 0 passed max, peers 1-2 passed sum"),
        ("root", "root: peer 0 passed 0, peers 1-2 passed 1"),
        ("collective", "peer 0 passed reduce, peers 1-2 passed all_reduce"),
        ("broadcast", "exactly one peer (the root) must pass an array; peers 0-1 passed one"),
        ("invalid", "peer 0: unsupported dtype bool"),
    ],
)
def test_a_mismatch_is_the_same_error_on_every_process_and_the_job_goes_on(
    orchestrator: str, how: str, expected: str
) -> None:
    procs = start(orchestrator, 3, "mismatch", how)
    kind = "InvalidArgumentError" if how == "invalid" else "MismatchError"
    messages = set()
    for proc, code in zip(procs, finish_all(procs, 60), strict=True):
        (line,) = errors_of(proc)
        assert code == 3 and line.startswith(f"ERROR {kind}") and expected in line, proc.output()
        messages.add(line.split(" ", 3)[3])
        _, after = proc.wait_for("AFTER", 1)
        assert "'all_reduce'" in after  # the next collective ran, through shared memory
    assert len(messages) == 1, messages  # word for word the same everywhere


def test_a_process_killed_mid_spin_is_a_peer_lost_error_on_every_survivor(orchestrator: str) -> None:
    procs = start(orchestrator, 3, "loop")
    try:
        procs[0].wait_for("READY", 60)
        procs[1].kill()
        killed = time.monotonic()
        expect_peer_lost([procs[0], procs[2]], killed, 3.0, naming="peer 1")
    finally:
        finish_all(procs, 30)


def test_a_process_failing_inside_a_step_fails_the_others_at_once_and_the_job_goes_on(
    orchestrator: str,
) -> None:
    procs = start(orchestrator, 3, "crash", timeout=60)
    started = time.monotonic()
    codes = finish_all(procs, 60)
    assert time.monotonic() - started < 30, "the others must not wait for their 60 s timeout"
    assert codes == [0, 0, 0], [p.output() for p in procs]
    assert errors_of(procs[0]) == ["ERROR MemoryError - simulated"]
    for proc in procs[1:]:
        (line,) = errors_of(proc)
        assert line.startswith("ERROR PeerLostError") and "peer 0 gave up" in line and "MemoryError" in line
    assert all("AFTER" in proc.output() for proc in procs)


@pytest.mark.parametrize(("late", "early"), [(2, ""), (1, ""), (1, "early")])
def test_a_late_process_is_named_by_the_timeout_everywhere_and_the_job_goes_on(
    orchestrator: str, late: int, early: str
) -> None:
    """Peer 1 late: peer 0 named peers 1 and 2 (it had not looked peer 2's channel up yet). With only
    peer 0 timing out, peer 2, which had seen peer 0 come, completed the step the others failed."""
    procs = start(orchestrator, 3, "late", "2", str(late), early)
    for proc, code in zip(procs, finish_all(procs, 60), strict=True):
        assert code == 0, proc.output()
        _, line = proc.wait_for("TIMEOUT", 1)
        assert line.startswith(f"TIMEOUT [{late}]") and f"peer {late}" in line, line


def test_four_processes_on_two_cores_do_not_starve_each_other(orchestrator: str) -> None:
    procs = start(orchestrator, 4, "crowded", "300")
    started = time.monotonic()
    for proc, code in zip(procs, finish_all(procs, 90), strict=True):
        assert code == 0, proc.output()
    assert time.monotonic() - started < 60


def _rings(procs: list[Proc]) -> list[Path]:
    return [Path("/dev/shm") / proc.wait_for("RING", 60)[1].split()[1] for proc in procs]


def test_segments_are_private_and_gone_after_finish_and_after_sigkill_once_the_next_job_starts(
    orchestrator: str,
) -> None:
    procs = start(orchestrator, 2, "crowded", "10")
    rings = _rings(procs)
    assert all(ring.stat().st_mode & 0o777 == 0o600 for ring in rings if ring.exists())
    assert finish_all(procs, 60) == [0, 0]
    assert not any(ring.exists() for ring in rings), "removed at finish"

    procs = start(orchestrator, 2, "loop")
    rings = _rings(procs)
    procs[0].wait_for("READY", 60)
    for proc in procs:
        proc.kill()
    assert all(ring.exists() for ring in rings), "SIGKILL leaves them behind"
    procs = start(orchestrator, 2, "crowded", "10")
    _rings(procs)
    assert finish_all(procs, 60) == [0, 0]
    assert not any(ring.exists() for ring in rings), "the next job removed them"


def test_pieces_read_any_range_of_their_concatenation_without_packing_it() -> None:
    rng = np.random.default_rng(3)
    for _ in range(500):
        arrays = [rng.standard_normal(int(k)) for k in rng.integers(0, 6, int(rng.integers(1, 6)))]
        whole = np.concatenate(arrays)
        pieces = Pieces(arrays)
        lo = int(rng.integers(0, whole.size + 1))
        hi = int(rng.integers(lo, whole.size + 1))
        out = np.full(hi - lo, np.nan)
        pieces.copy(lo, hi, out)
        assert np.array_equal(out, whole[lo:hi])
        segments = pieces.segments(lo, hi)
        assert all(view.size and any(np.shares_memory(view, a) for a in arrays) for _, view in segments)
        offsets = [offset for offset, _ in segments]
        assert offsets == [sum(view.size for _, view in segments[:i]) for i in range(len(segments))]


def test_pieces_of_any_shape_pack_and_read_as_their_flattened_concatenation() -> None:
    rng = np.random.default_rng(4)
    arrays = [
        rng.standard_normal((4, 6)).T,
        np.array(2.5),
        rng.standard_normal(5),
        rng.standard_normal((3, 2)),
    ]
    whole = np.concatenate([a.reshape(-1) for a in arrays])
    packed = np.full(whole.size, np.nan)
    Pieces(arrays).pack(packed)
    assert np.array_equal(packed, whole)
    for lo, hi in [(0, whole.size), (3, 26), (24, 25), (25, 30), (7, 7)]:
        out = np.full(hi - lo, np.nan)
        Pieces(arrays).copy(lo, hi, out)
        assert np.array_equal(out, whole[lo:hi]), (lo, hi)
