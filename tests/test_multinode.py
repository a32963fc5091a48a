"""Multi-node jobs with real processes over real ZeroMQ sockets on 127.0.0.1."""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import collective as col
from tests.conftest import wait_until
from tests.processes import (
    WORKER,
    Proc,
    expect_peer_lost,
    finish_all,
    start_nodes,
    start_orchestrator,
    start_orchestrator_with_token,
)

pytestmark = pytest.mark.timeout(180)
_jobs = itertools.count()


def job_name() -> str:
    return f"test-{next(_jobs)}"


@pytest.mark.parametrize(
    ("global_strategy", "local_strategy"),
    [("centralized", "ring"), ("tree:1", "tree:2"), ("tree:2", "centralized"), ("ring", "tree:2")],
)
def test_three_nodes_of_two_peers_every_op_root_and_size(
    orchestrator: str, global_strategy: str, local_strategy: str
) -> None:
    strategies = {
        f"{scope}_{kind}_strategy": strategy
        for scope, strategy in (("global", global_strategy), ("local", local_strategy))
        for kind in ("all_reduce", "reduce", "broadcast")
    }
    nodes = start_nodes(orchestrator, job_name(), 3, 2, "matrix", **strategies)
    codes = finish_all(nodes, 150)
    for node, code in zip(nodes, codes, strict=True):
        assert code == 0, node.output()
        assert node.output().count("OK 312") == 1, node.output()  # 156 collectives x 2 peers


def test_two_jobs_at_the_same_time_on_one_orchestrator(orchestrator: str) -> None:
    first = start_nodes(orchestrator, job_name(), 2, 1, "matrix")
    second = start_nodes(orchestrator, job_name(), 2, 2, "matrix", global_all_reduce_strategy="tree:2")
    for node, code in zip(first + second, finish_all(first + second, 150), strict=True):
        assert code == 0, node.output()


# -- failures ------------------------------------------------------------------------------------


def test_a_node_killed_mid_collective_is_a_peer_lost_error_everywhere_at_once(
    orchestrator: str,
) -> None:
    """Its connections close with it: the survivors are told within half a second (not after the
    heartbeats' 2 s)."""
    nodes = start_nodes(orchestrator, job_name(), 3, 1, "loop", shm=0)  # three phases (see test_shm_executor)
    try:
        nodes[0].wait_for("READY", 60)
        nodes[1].kill()
        killed = time.monotonic()
        lost = "node 1 (peer 1) closed its connection"
        expect_peer_lost([nodes[0], nodes[2]], killed, 0.5, naming=lost)
    finally:
        finish_all(nodes, 30)


def test_local_peers_arriving_apart_share_one_deadline_and_one_outcome(orchestrator: str) -> None:
    nodes = start_nodes(orchestrator, job_name(), 2, 2, "staggered")
    for node, code in zip(nodes, finish_all(nodes, 60), strict=True):
        assert code == 0, node.output()
    lines = [line for node in nodes for _, line in node.lines if line.startswith(("TIMEOUT", "COMPLETED"))]
    assert sorted(line.split()[:2] for line in lines) == [["TIMEOUT", str(p)] for p in range(4)], lines


@pytest.mark.parametrize("receiving", ["receiving", "quiet"])
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "three-phases"])
def test_a_peer_of_another_node_that_finished_is_lost_at_once(
    orchestrator: str, shm: str, receiving: str
) -> None:
    """Its node stays (another peer there is busy): a receive from it, and a collective with it
    (through shared memory, or the three phases between nodes), waited for the whole timeout and
    raised CollectiveTimeout, not PeerLostError. ``quiet``: no peer of node 0 receives (the finish
    notice went through shared memory, where nobody looked)."""
    nodes = start_nodes(orchestrator, job_name(), 2, 2, "remote_finish", receiving, shm=shm)
    for node, code in zip(nodes, finish_all(nodes, 60), strict=True):
        assert code == 0, node.output()
    for peer in (0, 1) if receiving == "receiving" else (1,):
        _, line = nodes[0].wait_for(f"LOST {peer}", 1)
        assert float(line.split()[2]) < 3 and "peer 3 called finish()" in line, line  # (node 1 left at 4 s)


def test_a_message_sent_before_its_sender_left_is_received_after(orchestrator: str, tmp_path: Path) -> None:
    """Posted in shared memory, then the sender's process exited; read past the grace a node that
    left is given (the receive raised PeerLostError: nobody had looked at the queue)."""
    left = tmp_path / "left"
    nodes = start_nodes(orchestrator, job_name(), 2, 1, "sent_then_left", str(left))
    assert nodes[0].wait(60) == 0, nodes[0].output()
    left.touch()
    assert nodes[1].wait(60) == 0, nodes[1].output()
    nodes[1].wait_for("RECEIVED", 1)


def test_the_orchestrator_killed_is_a_peer_lost_error_on_every_node() -> None:
    proc, address = start_orchestrator()
    nodes = start_nodes(address, job_name(), 2, 2, "loop")
    try:
        nodes[0].wait_for("READY", 60)
        proc.kill()
        killed = time.monotonic()
        for node in nodes:
            when, line = node.wait_for("ERROR", 15)
            assert (
                line.startswith("ERROR PeerLostError")
                and f"the orchestrator at {address} stopped answering" in line
            )
            assert when - killed < 5.0
            assert node.wait(30) == 3
            assert node.output().count("ERROR PeerLostError") == 2  # both local peers
    finally:
        finish_all(nodes, 30)
        proc.kill()


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("shape", "shape: node 0 (peers 0-1) passed (5,), node 1 (peers 2-3) passed (4,)"),
        ("dtype", "dtype: node 0 (peers 0-1) passed float32, node 1 (peers 2-3) passed float64"),
        ("op", "op: node 0 (peers 0-1) passed max, node 1 (peers 2-3) passed sum"),
        ("root", "root: node 0 (peers 0-1) passed 0, node 1 (peers 2-3) passed 1"),
        ("collective", "node 0 (peers 0-1) passed reduce, node 1 (peers 2-3) passed all_reduce"),
    ],
)
def test_nodes_calling_differently_get_a_mismatch_everywhere_and_go_on(
    orchestrator: str, how: str, expected: str
) -> None:
    nodes = start_nodes(orchestrator, job_name(), 2, 2, "mismatch", how)
    codes = finish_all(nodes, 60)
    for node, code in zip(nodes, codes, strict=True):
        errors = [line for _, line in node.lines if line.startswith("ERROR")]
        assert code == 3 and len(errors) == 2, node.output()  # both peers: the mismatch, nothing else
        assert all(line.startswith("ERROR MismatchError") and expected in line for line in errors), (
            node.output()
        )


def test_a_mismatch_in_a_group_across_nodes_names_the_group_peers_of_each_node(orchestrator: str) -> None:
    """It named every peer of each node ('node 0 (peers 0-1)'), members of the group or not."""
    nodes = start_nodes(orchestrator, job_name(), 3, 2, "group_mismatch")
    for node, code in zip(nodes, finish_all(nodes, 60), strict=True):
        errors = [line for _, line in node.lines if line.startswith("ERROR")]
        assert code == 3 and len(errors) == (1 if node is not nodes[1] else 2), node.output()
        for line in errors:
            assert line.startswith("ERROR MismatchError"), line
            named = "node 0 (peer 1) passed (4,), node 1 (peers 2-3), node 2 (peer 5) passed (3,)"
            assert named in line, line


def test_an_orchestrator_that_is_not_there_is_a_timeout() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    started = time.monotonic()
    (node,) = start_nodes(f"127.0.0.1:{free}", job_name(), 2, 1, "matrix", timeout=1)[:1]
    assert node.wait(30) == 3
    assert "ERROR CollectiveTimeout" in node.output() and "no topology from the orchestrator" in node.output()
    assert time.monotonic() - started < 10


def test_a_data_service_port_in_use_is_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = col.CollectiveConfig(
            num_devices=1,
            num_nodes=2,
            global_address="127.0.0.1:9",
            node_address=f"127.0.0.1:{port}",
            data_service_port=port,
            timeout=1,
        )
        with (
            col.Runtime() as rt,
            pytest.raises(
                col.RegistrationError, match=rf"cannot listen on 127.0.0.1:{port}: address already in use"
            ),
        ):
            rt.register(0, "cpu", config)


def test_launch_runs_a_script_on_every_node() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "collective", "launch", "--nodes", "2", "--devices", "2", WORKER, "matrix"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "[node 0] OK 240" in result.stdout and "[node 1] OK 240" in result.stdout
    )  # 120 collectives x 2 peers


def test_launch_stops_the_others_when_a_node_fails(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"  # (node 0 sleeps until launch stops it: not an order)
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['COLLECTIVE_PEER_IDS'] == '1':\n"
        "    print('failing', flush=True); sys.exit(7)\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "collective", "launch", "--nodes", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 7 and "[node 1] failing" in result.stdout
    assert "node 1 exited with status 7; stopping the others" in result.stderr
    assert time.monotonic() - started < 20


# -- the job token -------------------------------------------------------------------------------


def test_nodes_holding_the_token_run_and_others_are_refused_at_once() -> None:
    proc, address = start_orchestrator_with_token("s3cret")
    try:
        good = start_nodes(address, job_name(), 2, 1, "matrix", token="s3cret")
        for node, code in zip(good, finish_all(good, 60), strict=True):
            assert code == 0, node.output()
        for token in ("wrong", None):
            started = time.monotonic()
            extra = {"token": token} if token else {}
            (refused,) = start_nodes(address, job_name(), 1, 1, "matrix", **extra)
            assert refused.wait(30) == 3
            assert "ERROR RegistrationError" in refused.output() and "handshake failed" in refused.output()
            assert time.monotonic() - started < 10, "refused quickly, not after the timeout"
            assert "s3cret" not in refused.output()
    finally:
        proc.terminate()
    assert "refused a connection" in proc.output() and "wrong or missing job token" in proc.output()


def test_a_node_failing_inside_a_step_fails_the_others_at_once(orchestrator: str) -> None:
    """Not a dead process (heartbeats go on): the node tells the others it gave up the step."""
    nodes = start_nodes(orchestrator, job_name(), 3, 1, "crash", timeout=60, shm=0)
    started = time.monotonic()
    codes = finish_all(nodes, 60)
    assert time.monotonic() - started < 30, "the others must not wait for their 60 s timeout"
    assert codes == [3, 3, 3]
    assert "ERROR MemoryError - simulated" in nodes[0].output()
    for node in nodes[1:]:
        assert (
            "ERROR PeerLostError" in node.output()
            and "node 0 gave up step 0: MemoryError: simulated" in node.output()
        )


# -- a suspended node ----------------------------------------------------------------------------


def _suspend(proc: Proc, seconds: float) -> None:
    os.kill(proc.process.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)  # (kept: the suspension under test lasts this long)
    finally:
        os.kill(proc.process.pid, signal.SIGCONT)


def test_a_node_suspended_for_less_than_the_orchestrators_threshold_goes_on(tmp_path: Path) -> None:
    """Suspended 3 s (more than its own 2 s threshold): it must not blame the orchestrator."""
    proc, address = start_orchestrator("--lost-after", "8")
    stop = tmp_path / "stop"
    nodes = start_nodes(address, job_name(), 2, 1, "until", str(stop), "0.05", shm=0)
    try:
        for node in nodes:
            node.wait_for("READY", 60)
        _suspend(nodes[1], 3.0)
        wait_until(  # the heartbeat thread noticed the gap (not counted) and checks with the orchestrator
            lambda: any("this node did not run for" in line for _, line in list(nodes[1].lines)),
            10,
            lambda: f"node 1 noticing its suspension; output:\n{nodes[1].output()}",
        )
        stop.touch()
        for node, code in zip(nodes, finish_all(nodes, 60), strict=True):
            assert code == 0, node.output()
        noticed = re.search(r"this node did not run for (\d+\.\d) s", nodes[1].output())
        assert noticed and float(noticed.group(1)) >= 2.5, nodes[1].output()
    finally:
        finish_all(nodes, 10)
        proc.terminate()


def test_a_node_suspended_past_the_orchestrators_threshold_says_so(tmp_path: Path) -> None:
    proc, address = start_orchestrator()
    nodes = start_nodes(address, job_name(), 2, 1, "until", str(tmp_path / "never"), "0.05", shm=0)
    try:
        for node in nodes:
            node.wait_for("READY", 60)
        _suspend(nodes[1], 3.5)
        _, line = nodes[1].wait_for("ERROR", 15)
        assert line.startswith("ERROR PeerLostError"), nodes[1].output()
        suspended = re.search(r"this node was suspended for (\d+\.\d) s", line)
        assert suspended and float(suspended.group(1)) >= 3.0, line
        assert "the orchestrator declared it lost (it stopped sending heartbeats (2s))" in line, line
        assert "the orchestrator at" not in line  # not blamed on the orchestrator
        _, line = nodes[0].wait_for("ERROR", 15)
        assert "node 1 (peer 1) stopped sending heartbeats" in line, nodes[0].output()
    finally:
        finish_all(nodes, 30)
        proc.terminate()
