"""``col.init()`` under every launcher's variables, and ``collective launch``: real processes on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import collective as col
from collective.launch import free_port
from collective.launch.bootstrap import init
from collective.launch.launchers import first_host, launched_from
from tests.conftest import RUN_SETTINGS, wait_until
from tests.processes import Proc, finish_all, ignores

pytestmark = pytest.mark.timeout(120)

WORKER = str(Path(__file__).with_name("init_worker.py"))
CLEAN = {
    k: v
    for k, v in os.environ.items()
    if k in RUN_SETTINGS or not k.startswith(("COLLECTIVE_", "SLURM_", "OMPI_"))
}
CLEAN = {k: v for k, v in CLEAN.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def torchrun(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def slurm(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": str(world),
        "SLURM_LOCALID": str(rank),
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_ID": "77",
        "MASTER_PORT": str(port),
    }


def open_mpi(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(world),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(port),
    }


@pytest.mark.parametrize("variables", [torchrun, slurm, open_mpi], ids=lambda f: f.__name__)
def test_init_under_each_launcher(variables: Callable[[int, int, int], dict[str, str]]) -> None:
    world, port = 3, free_port()
    procs = [
        Proc([sys.executable, WORKER], {**CLEAN, "COLLECTIVE_TIMEOUT": "30", **variables(rank, world, port)})
        for rank in range(world)
    ]
    for proc, code in zip(procs, finish_all(procs, 90), strict=True):
        assert code == 0, proc.output()
    for rank, proc in enumerate(procs):
        assert f"OK {rank} {world}" in proc.output(), proc.output()


def test_rank_0_dying_while_the_others_register_is_a_peer_lost_error_within_seconds() -> None:
    """Rank 0 hosts the orchestrator: the others waited the whole timeout, then reported the
    missing rank as if the orchestrator were still there."""
    port = free_port()
    procs = [
        Proc([sys.executable, WORKER], {**CLEAN, "COLLECTIVE_TIMEOUT": "60", **torchrun(r, 3, port)})
        for r in (0, 1)
    ]
    procs[1].wait_for("job 'init-", 30)  # "waiting 3s for the other nodes": it has heard the orchestrator
    procs[0].kill()
    killed = time.monotonic()
    assert procs[1].wait(30) != 0
    assert time.monotonic() - killed < 10, procs[1].output()
    assert "PeerLostError: the orchestrator at" in procs[1].output(), procs[1].output()
    procs[0].wait(10)


def _workers(world: int, *args: str, timeout: str = "30") -> list[Proc]:
    """``world`` processes of tests/init_worker.py given ``args``, under torchrun's variables."""
    port = free_port()
    env = lambda rank: {**CLEAN, "COLLECTIVE_TIMEOUT": timeout, **torchrun(rank, world, port)}  # noqa: E731
    return [Proc([sys.executable, WORKER, *args], env(rank)) for rank in range(world)]


def test_a_group_of_one_host_goes_on_when_rank_0_leaves_with_the_orchestrator() -> None:
    """docs/failures.md: a group whose processes share a host goes on without the orchestrator. One
    member raised 'the orchestrator ... stopped answering' while the other got its result."""
    procs = _workers(3, "orchestrator_leaves")
    for proc, code in zip(procs, finish_all(procs, 90), strict=True):
        assert code == 0, proc.output()
    for rank in (1, 2):
        assert f"PAIR OK {rank}" in procs[rank].output(), procs[rank].output()


def test_rank_0_ending_first_serves_the_orchestrator_to_the_others_until_they_finish() -> None:
    """Rank 0's process ended with its orchestrator: the others logged that the orchestrator
    stopped answering, in a run that ended well (and a job across hosts would have failed)."""
    procs = _workers(3, "late_finish")
    for proc, code in zip(procs, finish_all(procs, 90), strict=True):
        assert code == 0, proc.output()
    for rank in (1, 2):
        output = procs[rank].output()
        assert f"LATE OK {rank}" in output and "stopped answering" not in output, output
    assert "serves the job's orchestrator to the ranks still running" in procs[0].output()


def test_rank_0_crashing_does_not_serve_the_orchestrator_on() -> None:
    """A rank 0 that ended without finish() (a crash, Ctrl-C) waited for the others while its own
    node lived on: they waited their whole timeout for it, and it for them."""
    procs = _workers(2, "rank_0_crashes", timeout="60")
    started = time.monotonic()
    codes = finish_all(procs, 90)
    assert time.monotonic() - started < 30, [p.output() for p in procs]
    assert codes == [1, 0] and "LOST 1" in procs[1].output(), [p.output() for p in procs]
    assert "serves the job's orchestrator" not in procs[0].output()


@pytest.mark.parametrize(("how", "mib"), [("finish", 64), ("exit", 32)])
def test_what_a_process_sent_arrives_though_it_leaves_at_once(how: str, mib: int) -> None:
    """Its sockets closed without lingering: after finish() the message was dropped (2 in 3 runs at
    64 MiB); ending without finish() crashed in libzmq (every run at 32 MiB)."""
    procs = _workers(2, how, str(mib))
    for proc, code in zip(procs, finish_all(procs, 90), strict=True):
        assert code == 0, proc.output()
    assert "RECEIVED 1" in procs[1].output(), procs[1].output()


def test_launch_sets_the_torchrun_variables_and_init_reads_them() -> None:
    proc = Proc(
        [sys.executable, "-m", "collective", "launch", "--nodes", "3", "--timeout", "30", WORKER], CLEAN
    )
    assert proc.wait(90) == 0, proc.output()
    for rank in range(3):
        assert f"[node {rank}] OK {rank} 3 {rank}" in proc.output(), proc.output()
    assert "orchestrator 127.0.0.1:" in proc.output() and "job 'launch-" in proc.output()


def test_launch_runs_modules_and_other_programs() -> None:
    module = Proc(
        [sys.executable, "-m", "collective", "launch", "--nodes", "2", "-m", "tests.init_worker"], CLEAN
    )
    assert module.wait(90) == 0, module.output()
    assert "[node 1] OK 1 2" in module.output()
    program = Proc(
        [
            sys.executable,
            "-m",
            "collective",
            "launch",
            "--nodes",
            "2",
            "sh",
            "-c",
            "echo rank=$RANK of $WORLD_SIZE",
        ],
        CLEAN,
    )
    assert program.wait(60) == 0, program.output()
    assert "[node 1] rank=1 of 2" in program.output()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--orchestrator", "nohost", "x.py"], "must be 'host:port'"),
        (["--orchestrator", "h:99999", "x.py"], "must be 'host:port'"),
        (["--orchestrator", "a b:1234", "x.py"], "must be 'host:port'"),  # these three ran the nodes,
        (["--orchestrator", "h:\uff11\uff12", "x.py"], "must be 'host:port'"),  # which crashed or
        (["--orchestrator", "127.0.0.1:29500:1", "x.py"], "must be 'host:port'"),  # timed out
        (["--timeout", "nan", "x.py"], "finite number of seconds > 0"),
        (["--timeout", "0", "x.py"], "finite number of seconds > 0"),
        (["missing.py"], "no such script"),
        ([], "nothing to run"),
    ],
)
def test_launch_refuses_bad_arguments(argv: list[str], expected: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "collective", "launch", "--nodes", "2", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=CLEAN,
    )
    assert result.returncode == 2 and expected in result.stderr, result.stderr


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
    except OSError:
        return False


def _segments(pids: list[int]) -> list[str]:
    """The shared-memory segments of processes ``pids``."""
    prefixes = tuple(f"collective-{pid}-" for pid in pids)
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefixes)]


def _pids(proc: Proc, word: str) -> list[int]:
    return [int(line.split()[-1]) for _, line in proc.lines if f"] {word} " in line]


@pytest.mark.parametrize(
    ("signum", "twice"), [(signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGTERM, True)]
)
def test_sigterm_or_sighup_to_launch_stops_its_nodes_and_what_they_started(
    tmp_path: Path, signum: int, twice: bool
) -> None:
    """launch died at once and its nodes (and orchestrator) ran on (a batch system's stop, a closed
    terminal); now it stops them, and what each started, and exits 128 + the signal. ``twice``: a
    node that ignores SIGINT keeps launch stopping for a while, and a second SIGTERM then cut the
    stopping short (launch died with a traceback, everything left running)."""
    script = tmp_path / "waits.py"  # (its sleeps hold the nodes until launch stops them: not an order)
    script.write_text(
        ("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n" if twice else "")
        + "import os, subprocess, time\nchild = subprocess.Popen(['sleep', '60'])\n"
        "print('node', os.getpid(), flush=True)\nprint('child', child.pid, flush=True)\ntime.sleep(60)\n"
    )
    launch = Proc([sys.executable, "-m", "collective", "launch", "--nodes", "2", str(script)], CLEAN)
    for rank in range(2):
        launch.wait_for(f"[node {rank}] child", 30)
    pids = _pids(launch, "node") + _pids(launch, "child")
    assert len(pids) == 4 and all(map(_running, pids)), launch.output()
    launch.process.send_signal(signum)
    if twice:  # once launch is stopping its nodes (it ignores the signal meanwhile), the same again
        wait_until(lambda: ignores(launch.process.pid, signum), 10, "launch stopping its nodes")
        launch.process.send_signal(signum)
    assert launch.wait(30) == 128 + signum, launch.output()
    assert "Traceback" not in launch.output(), launch.output()
    wait_until(lambda: not any(map(_running, pids)), 10, lambda: str([pid for pid in pids if _running(pid)]))


def test_a_failed_node_stops_what_others_started_and_ctrl_c_leaves_no_shared_memory(tmp_path: Path) -> None:
    """launch signalled the nodes alone: a node's own children (a shell's, here) lived on; and a
    node stopped by SIGTERM left its shared memory in /dev/shm (exit handlers skipped)."""
    started = tmp_path / "started"  # rank 1 fails once rank 0 started its child (else none to stop)
    shell = [
        "sh",
        "-c",
        f'if [ "$RANK" = 1 ]; then for i in $(seq 300); do [ -e {started} ] && break; sleep 0.02; done; '
        f'exit 3; fi; sleep 61 & echo "child $!"; touch {started}; wait',
    ]
    failing = Proc([sys.executable, "-m", "collective", "launch", "--nodes", "2", *shell], CLEAN)
    assert failing.wait(30) == 3, failing.output()
    children = _pids(failing, "child")
    assert children, failing.output()
    wait_until(lambda: not any(map(_running, children)), 10, failing.output)

    script = tmp_path / "blocked.py"  # every node waits in a barrier that rank 0 (sleeping) never enters
    script.write_text(
        "import os, time, collective as col\npeer = col.init()\nprint('node', os.getpid(), flush=True)\n"
        "time.sleep(60) if peer == 0 else col.barrier(peer)\n"
    )
    launch = Proc([sys.executable, "-m", "collective", "launch", "--nodes", "3", str(script)], CLEAN)
    for rank in range(3):
        launch.wait_for(f"[node {rank}] node", 30)
    nodes = _pids(launch, "node")
    assert _segments(nodes), os.listdir("/dev/shm")
    launch.process.send_signal(signal.SIGINT)
    assert launch.wait(30) == 130, launch.output()
    assert "Traceback" not in launch.output(), launch.output()
    assert not _segments(nodes), _segments(nodes)


def test_ctrl_c_stops_every_node_quietly(tmp_path: Path) -> None:
    script = tmp_path / "sleepy.py"  # (its sleep holds the nodes until Ctrl-C: not an order)
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    launch = Proc([sys.executable, "-m", "collective", "launch", "--nodes", "2", str(script)], CLEAN)
    for rank in range(2):
        launch.wait_for(f"[node {rank}] started", 30)
    launch.process.send_signal(signal.SIGINT)
    started = time.monotonic()
    assert launch.wait(30) == 130
    assert time.monotonic() - started < 10
    assert "Traceback" not in launch.output() and "lost sys.stderr" not in launch.output(), launch.output()


# -- the environment, read ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "found no launcher variables"),
        ({"RANK": "1"}, "WORLD_SIZE not set"),
        (
            {"RANK": "3", "WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "RANK=3 contradicts WORLD_SIZE=3",
        ),
        ({"RANK": "x", "WORLD_SIZE": "3"}, "RANK='x' is not a rank"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "set MASTER_ADDR and MASTER_PORT"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT is not"),
        ({"SLURM_PROCID": "0"}, "SLURM_NTASKS not set"),
        ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "2"}, "contradicts OMPI_COMM_WORLD_SIZE=2"),
        ({"COLLECTIVE_PEER_IDS": "2,3", "COLLECTIVE_NUM_DEVICES": "2"}, "one peer per process"),
        ({**torchrun(1, 2, 9), "COLLECTIVE_GLOBAL_ADDRESS": "orchestra"}, "ADDRESS must be 'host:port'"),
        ({**torchrun(1, 2, 9), "COLLECTIVE_GLOBAL_ADDRESS": "h:0"}, "ADDRESS must be 'host:port'"),
    ],
)
def test_missing_or_contradictory_variables_are_named(env: dict[str, str], expected: str) -> None:
    with pytest.raises(col.ConfigError, match=expected):
        launched_from(env)


def test_what_each_launcher_says() -> None:
    run = launched_from({**torchrun(2, 4, 1234), "TORCHELASTIC_RUN_ID": "abc"})
    assert (run.source, run.rank, run.world, run.master, run.job) == (
        "torchrun",
        2,
        4,
        ("127.0.0.1", 1234),
        "abc.0",
    )
    run = launched_from(
        {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_JOB_ID": "5"}
    )
    assert (run.master, run.job) == (("gpu07", 29500), "slurm-5.0")
    named = {"COLLECTIVE_GLOBAL_ADDRESS": "10.0.0.1:7", "PMIX_NAMESPACE": "p@1"}
    run = launched_from({**open_mpi(1, 2, 99), **named})
    assert (run.source, run.orchestrator, run.job) == ("Open MPI", "10.0.0.1:7", "ompi-p@1")
    assert first_host("a1,b2") == "a1" and first_host("n[3-4,9]") == "n3"


def test_each_job_has_its_own_name_and_one_name() -> None:
    """Jobs on one orchestrator are told apart by name: two mpirun jobs (no name of their own) sharing
    it were merged, silently (each computed with the other's processes); a torchrun restart read the
    previous attempt's orchestrator address; MASTER_ADDR=localhost and 127.0.0.1 made two jobs."""
    again = {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "2"}
    restarted = launched_from({**torchrun(0, 2, 1234), **again})
    assert restarted.job == "r.2"
    static = {**torchrun(0, 2, 1234), **again, "TORCHELASTIC_RUN_ID": "none"}  # --master-port: no run id
    assert launched_from(static).job == "init-127.0.0.1:1234.2"
    mpi = {**open_mpi(1, 2, 99), "COLLECTIVE_GLOBAL_ADDRESS": "10.0.0.1:7"}
    assert launched_from({**mpi, "OMPI_MCA_orte_ess_jobid": "1234"}).job == "ompi-1234"
    assert launched_from({**mpi, "COLLECTIVE_JOB": "mine"}).job == "mine"
    for unnamed in (mpi, {**torchrun(1, 2, 99), "COLLECTIVE_GLOBAL_ADDRESS": "10.0.0.1:7"}):
        with pytest.raises(col.ConfigError, match="nothing names this job: set COLLECTIVE_JOB"):
            launched_from(unnamed)
    hosts = ("localhost", "127.0.0.1")
    spelled = [launched_from({**torchrun(1, 2, 99), "MASTER_ADDR": host}).job for host in hosts]
    assert spelled == ["init-127.0.0.1:99"] * 2


def test_slurm_meets_at_the_first_host_of_the_step() -> None:
    """A step on part of the allocation (srun -w, --relative): its task 0 is not on the job's first host."""
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "a1,b[1-2]"}
    assert launched_from({**env, "SLURM_STEP_NODELIST": "b[1-2]"}).master == ("b1", 29500)
    assert launched_from(env).master == ("a1", 29500)
    blank = {**env, "SLURM_JOB_NODELIST": " ", "SLURM_NODELIST": "c3"}
    assert launched_from(blank).master == ("c3", 29500)


def test_init_twice_and_init_after_register_are_refused() -> None:
    env = {**CLEAN, **torchrun(0, 1, free_port()), "COLLECTIVE_TIMEOUT": "20"}
    with col.Runtime() as rt:
        assert init(rt, environ=env) == 0
        assert rt.world_size() == 1
        np.testing.assert_array_equal(rt.all_reduce(0, np.ones(3)), np.ones(3))
        with pytest.raises(col.RegistrationError, match="init\\(\\) was already called"):
            init(rt, environ=env)
        np.testing.assert_array_equal(rt.all_reduce(0, np.ones(3)), np.ones(3))  # still usable
        rt.finish(0)
    with col.Runtime() as rt:
        rt.register(0, "cpu", col.CollectiveConfig(num_devices=1))
        with pytest.raises(col.RegistrationError, match="registered with register"):
            init(rt, environ={**CLEAN, **torchrun(0, 1, free_port())})


def test_init_under_torchruns_agent_store() -> None:
    """torchrun's agent serves a store on MASTER_PORT: rank 0 publishes the orchestrator there."""
    torch_distributed = pytest.importorskip("torch.distributed")
    port = free_port()
    agent = torch_distributed.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    env = {**CLEAN, "COLLECTIVE_TIMEOUT": "30", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    procs = [Proc([sys.executable, WORKER], {**env, **torchrun(rank, 2, port)}) for rank in range(2)]
    for proc, code in zip(procs, finish_all(procs, 90), strict=True):
        assert code == 0, proc.output()
    assert agent.get(f"collective/init-127.0.0.1:{port}/orchestrator").startswith(b"127.0.0.1:")


def test_init_with_a_store_as_torch_hands_its_backends() -> None:
    torch_distributed = pytest.importorskip("torch.distributed")
    from collective.launch.bootstrap import init_with_store

    store = torch_distributed.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    with col.Runtime() as rt:
        assert init_with_store(rt, store, 0, 1, environ={**CLEAN, "COLLECTIVE_TIMEOUT": "20"}) == 0
        np.testing.assert_array_equal(rt.all_gather(0, np.arange(3)), [[0, 1, 2]])
        with pytest.raises(col.RegistrationError, match="already joined a job"):
            init_with_store(rt, store, 0, 1, environ=CLEAN)
        rt.finish(0)
