"""``init()``'s settings: every one checked before rank 0 starts an orchestrator, a failed ``init()``
leaves nothing behind, launcher values in unusual forms, and ``collective launch``'s exit status."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import collective as col
from collective.launch import bootstrap, free_port
from collective.launch.bootstrap import init
from collective.launch.launchers import first_host, launched_from
from tests.conftest import wait_until
from tests.processes import met_in_shared_memory
from tests.test_init import CLEAN, slurm, torchrun

pytestmark = pytest.mark.timeout(60)


def _port_is_free(port: int) -> bool:
    """Nothing listens on ``port`` (a closed connection's TIME_WAIT does not count: servers reuse it)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_bad_setting_is_refused_before_rank_0_starts_its_orchestrator() -> None:
    port = free_port()
    env = {**CLEAN, **torchrun(0, 1, port), "COLLECTIVE_TIMEOUT": "-1"}
    with col.Runtime() as rt:
        with pytest.raises(col.ConfigError, match="COLLECTIVE_TIMEOUT='-1': timeout must be"):
            init(rt, environ=env)
        assert _port_is_free(port)
        with pytest.raises(col.ConfigError, match="COLLECTIVE_DATA_SERVICE_PORT='abc' is not a number"):
            init(rt, environ={**env, "COLLECTIVE_TIMEOUT": "20", "COLLECTIVE_DATA_SERVICE_PORT": "abc"})
        assert _port_is_free(port)
        assert init(rt, environ={**env, "COLLECTIVE_TIMEOUT": "20"}) == 0  # fixed: it works
        np.testing.assert_array_equal(rt.all_reduce(0, np.ones(2)), np.ones(2))
        rt.finish(0)


def test_rank_0_says_why_it_cannot_host_the_orchestrator() -> None:
    """It always said "pick a free MASTER_PORT": wrong advice for an address of another machine."""
    with col.Runtime() as rt:
        elsewhere = {**CLEAN, **torchrun(0, 1, free_port()), "MASTER_ADDR": "192.0.2.1"}  # (TEST-NET-1)
        with pytest.raises(col.ConfigError, match="MASTER_ADDR is not an address of this machine"):
            init(rt, environ=elsewhere)
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            busy = {**CLEAN, **torchrun(0, 1, taken.getsockname()[1])}
            with pytest.raises(col.ConfigError, match="something listens there already"):
                init(rt, environ=busy)


def test_a_failed_registration_stops_the_orchestrator_it_started() -> None:
    """Rank 0 of 2 alone: registration times out; MASTER_PORT is free again and init() may retry."""
    port = free_port()
    env = {**CLEAN, **torchrun(0, 2, port), "COLLECTIVE_TIMEOUT": "1"}
    with col.Runtime() as rt:
        with pytest.raises(col.CollectiveError):
            init(rt, environ=env)
        assert _port_is_free(port)
        assert init(rt, environ={**env, "WORLD_SIZE": "1", "COLLECTIVE_TIMEOUT": "20"}) == 0
        rt.finish(0)


def test_init_logs_where_its_rank_and_meeting_point_came_from(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    env = {**CLEAN, **torchrun(0, 1, port), "COLLECTIVE_TIMEOUT": "20"}
    with col.Runtime() as rt, caplog.at_level(logging.DEBUG, logger="collective"):
        assert init(rt, environ=env) == 0
        rt.finish(0)
    said = [record.getMessage() for record in caplog.records if record.name == "collective.launch.bootstrap"]
    assert said == [
        f"init(): rank 0 of 1 from torchrun's variables, job 'init-127.0.0.1:{port}', orchestrator "
        f"hosted by rank 0 at 127.0.0.1:{port}"
    ], said


def test_a_token_with_surrounding_spaces_is_one_token_for_orchestrator_and_nodes() -> None:
    env = {
        **CLEAN,
        **torchrun(0, 1, free_port()),
        "COLLECTIVE_TIMEOUT": "20",
        "COLLECTIVE_TOKEN": " s3cret\n",
    }
    with col.Runtime() as rt:
        assert init(rt, environ=env) == 0
        np.testing.assert_array_equal(rt.all_reduce(0, np.ones(2)), np.ones(2))
        rt.finish(0)


def test_init_after_register_or_twice_is_a_registration_error_whatever_the_variables() -> None:
    with col.Runtime() as rt:
        rt.register(0, "cpu", col.CollectiveConfig(num_devices=1))
        with pytest.raises(col.RegistrationError, match="registered with register"):
            init(rt, environ=CLEAN)  # no launcher variables at all: still the registration error
    env = {**CLEAN, **torchrun(0, 1, free_port()), "COLLECTIVE_TIMEOUT": "20"}
    with col.Runtime() as rt:
        init(rt, environ=env)
        with pytest.raises(col.RegistrationError, match="already called"):
            init(rt, environ={**env, "RANK": "5"})
        rt.finish(0)


def test_a_collected_runtime_is_forgotten() -> None:
    env = {**CLEAN, **torchrun(0, 1, free_port()), "COLLECTIVE_TIMEOUT": "20"}
    rt = col.Runtime()
    init(rt, environ=env)
    rt.finish(0)
    rt.close()
    assert rt in bootstrap.initialised()
    del rt
    gc.collect()
    assert bootstrap.initialised() == []  # a new Runtime at the same address starts afresh


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node[1-3]-ib", "node1-ib"),
        ("gpu[01-02]-ib,cpu1", "gpu01-ib"),
        ("rack[1-2]-node[3,5]", "rack1-node3"),
        ("n[07-09,11]", "n07"),
        (" c[5-6]", "c5"),
        ("a,b[1-2]", "a"),
        ("gpu-[001-004]", "gpu-001"),
    ],
)
def test_the_first_host_of_a_slurm_node_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


def test_mpirun_inside_a_slurm_job_is_read_from_its_own_variables() -> None:
    """An sbatch script's mpirun: every process inherits SLURM_PROCID=0; Open MPI's rank counts."""
    env = {
        **CLEAN,
        **slurm(0, 1, 1234),
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
    }
    launched = launched_from(env)
    assert (launched.source, launched.rank, launched.world) == ("Open MPI", 3, 4)


def launch_argv(nodes: int, *program: str) -> list[str]:
    """``python -m collective launch --nodes NODES --timeout 30 PROGRAM...``"""
    return [sys.executable, "-m", "collective", "launch", "--nodes", str(nodes), "--timeout", "30", *program]


def test_launch_takes_a_separator_before_the_program() -> None:
    argv = launch_argv(1, "--", "sh", "-c", "echo rank=$RANK")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=CLEAN)
    assert done.returncode == 0, done.stderr
    assert "rank=0" in done.stdout


def test_launch_passes_on_output_that_is_no_utf8() -> None:
    """A byte that is no UTF-8 killed the node's pump: its later lines were lost (exit 0), and a
    node with more to say blocked on a full pipe: launch hung."""
    program = "import sys; sys.stdout.buffer.write(b'caf\\xe9\\n'); sys.stdout.flush(); " + (
        "[print(i) for i in range(100000)]"
    )
    argv = launch_argv(2, "--", sys.executable, "-c", program)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=CLEAN)
    assert done.returncode == 0 and "UnicodeDecodeError" not in done.stderr, done.stderr[-2000:]
    for node in (0, 1):
        assert f"[node {node}] caf\\xe9\n" in done.stdout and f"[node {node}] 99999\n" in done.stdout


def test_launch_killed_outright_leaves_no_orchestrator_behind(tmp_path: Path) -> None:
    """SIGKILL (the OOM killer, a batch system's last word) gives launch no chance to stop its
    orchestrator: it ran on, orphaned, forever. Now it stops with its parent (the nodes of one host
    go on without it, to their end, as they would after the orchestrator's loss)."""
    script = tmp_path / "loop.py"  # (its sleeps pace a job of about 20 s: still running when launch dies)
    script.write_text(
        "import time, collective as col\npeer = col.init()\nfor _ in range(400):\n"
        "    col.barrier(peer)\n    time.sleep(0.05)\n"
    )
    launch = subprocess.Popen(
        launch_argv(2, str(script)),
        env=CLEAN,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children: list[int] = []
    try:
        wait_until(lambda: len(_children_of(launch.pid)) >= 3, 30, "the orchestrator and 2 nodes started")
        children = _children_of(launch.pid)
        assert len(children) == 3, children
        (orchestrator,) = [
            pid for pid in children if b"orchestrator" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        nodes = [pid for pid in children if pid != orchestrator]
        wait_until(lambda: met_in_shared_memory(nodes), 30, "the nodes running their job")
        launch.kill()
        launch.wait(10)
        wait_until(lambda: not _running(orchestrator), 10, "the orchestrator ending with launch")
    finally:
        launch.kill()
        for pid in children:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _running(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def test_launch_gives_everything_after_m_module_to_the_module(tmp_path: Path) -> None:
    """``-m mod --nodes 3`` started 3 nodes and gave the module no arguments (launch took them)."""
    (tmp_path / "echo_args.py").write_text("import os, sys\nprint(os.environ['WORLD_SIZE'], sys.argv[1:])\n")
    argv = launch_argv(1, "-m", "echo_args", "--nodes", "3", "--job", "x", "--help")
    env = {**CLEAN, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[node 0] 1 ['--nodes', '3', '--job', 'x', '--help']"], done.stdout
    for given, expected in ((["--", "--lr", "1"], "['--lr', '1']"), (["a", "--", "b"], "['a', '--', 'b']")):
        argv = [sys.executable, "-m", "collective", "launch", "--nodes", "1", "-m", "echo_args", *given]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        assert done.stdout.splitlines() == [f"[node 0] 1 {expected}"], (given, done.stdout)  # (python -m's)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--job", ""], "argument --job: job must be a name of 1 to 200 characters"),
        (["--job", "j" * 201], "argument --job: job must be a name of 1 to 200 characters"),
        (["--job", " "], "without surrounding spaces"),
        (["-m"], "argument -m: expected a module name"),
        (["-m", "--x"], "argument -m: expected a module name"),
    ],
)
def test_launch_refuses_a_bad_job_name_or_module_before_starting(args: list[str], message: str) -> None:
    argv = [sys.executable, "-m", "collective", "launch", "--nodes", "1", *args]
    if args[0] != "-m":
        argv += ["-m", "json.tool"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=CLEAN)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_launcher_values_in_unusual_forms() -> None:
    env = {**CLEAN, **slurm(0, 2, 1234), "SLURM_JOB_NODELIST": "c[5-6]", "MASTER_ADDR": " "}
    del env["MASTER_PORT"]
    assert launched_from(env).master == ("c5", 29500)  # a blank MASTER_ADDR is unset
    assert launched_from({**CLEAN, **torchrun(1, 2, 1234), "LOCAL_RANK": "\u00b2"}).local_rank is None
    unresolved = {**env, "SLURM_JOB_NODELIST": "no-such-host.invalid[01-02]"}  # (MASTER_ADDR was named)
    with pytest.raises(
        col.ConfigError, match=r"^the first host of SLURM_JOB_NODELIST='no-such-host.invalid01'"
    ):
        bootstrap.config_from(launched_from(unresolved), unresolved)


def test_a_named_orchestrator_without_master_addr_gives_the_address_reaching_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[str, str]] = []

    def reaching(host: str, variable: str = "MASTER_ADDR") -> str:
        asked.append((host, variable))
        return "10.1.2.3"

    monkeypatch.setattr(bootstrap, "reaching", reaching)
    env = {
        **CLEAN,
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "COLLECTIVE_GLOBAL_ADDRESS": "192.0.2.10:29500",
        "COLLECTIVE_JOB": "j",
    }
    config = bootstrap.config_from(
        launched_from(env), env
    )  # rank 1 with a named orchestrator: starts nothing
    assert asked == [("192.0.2.10", "COLLECTIVE_GLOBAL_ADDRESS")]
    assert (config.node_address, config.global_address) == ("10.1.2.3:0", "192.0.2.10:29500")
    given = {**env, "COLLECTIVE_NODE_ADDRESS": "10.9.9.9:0"}  # an address given is used as it is
    assert bootstrap.config_from(launched_from(given), given).node_address == "10.9.9.9:0"
    torchrun_given = {**CLEAN, **torchrun(1, 2, 1234), "COLLECTIVE_NODE_ADDRESS": "10.9.9.9:0"}
    assert bootstrap.config_from(launched_from(torchrun_given), torchrun_given).node_address == "10.9.9.9:0"
    portless = {**torchrun_given, "COLLECTIVE_NODE_ADDRESS": "10.9.9.8"}  # (it became 127.0.0.1)
    assert bootstrap.config_from(launched_from(portless), portless).node_address == "10.9.9.8:0"
    assert len(asked) == 1  # (with MASTER_ADDR set too: it was ignored there)


@pytest.mark.parametrize(("signal_number", "status"), [(9, 137), (15, 143)])
def test_launch_reports_a_node_killed_by_a_signal_as_a_shell_does(signal_number: int, status: int) -> None:
    kill = f"import os; os.kill(os.getpid(), {signal_number})"
    argv = launch_argv(1, sys.executable, "-c", kill)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=CLEAN)
    assert done.returncode == status, done.stderr
    assert f"node 0 was killed by signal {signal_number}" in done.stderr


def test_launch_whose_output_reader_left_stops_its_nodes_as_a_pipeline_does() -> None:
    """``collective launch ... | head -1``: the pump wrote into a closed pipe (BrokenPipeError),
    the nodes blocked on their full pipes, and launch waited for them forever."""
    program = (
        "import time\nfor i in range(10**6): print(i, flush=True)\ntime.sleep(60)"  # (holds: not an order)
    )
    argv = launch_argv(2, sys.executable, "-c", program)
    launched = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CLEAN)
    try:
        assert launched.stdout is not None and launched.stdout.readline().startswith("[node ")
        launched.stdout.close()  # the reader leaves
        assert launched.wait(20) == 141  # 128 + SIGPIPE, as a shell reports a writer whose reader left
        assert launched.stderr is not None and "Traceback" not in launched.stderr.read()
    finally:
        launched.kill()
        launched.wait(10)


def test_launch_whose_reader_leaves_after_its_nodes_ended_says_so(tmp_path: Path) -> None:
    """The nodes' last output was still on its way when the reader left: launch exited 0."""
    marker = f"open(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w')"
    node = f"import os; print('x' * 200_000, flush=True); {marker}"
    argv = launch_argv(2, sys.executable, "-c", node)
    launched = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=CLEAN)
    try:

        def nodes_ended() -> bool:  # (each node names itself once its output is out: then it ends)
            pids = [int(name) for name in os.listdir(tmp_path)]
            return len(pids) == 2 and not any(map(_running, pids))

        wait_until(nodes_ended, 30, "the nodes ending")  # meanwhile: launch's pump waits on the full pipe
        assert launched.stdout is not None and launched.stdout.read(10)
        launched.stdout.close()
        assert launched.wait(20) == 141
    finally:
        launched.kill()
        launched.wait(10)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "argument --port: must be a port in 0..65535"),
        (["--port", "-1"], "argument --port: must be a port in 0..65535"),
        (["--lost-after", "-5"], "argument --lost-after: must be a finite number of seconds > 0"),
        (["--lost-after", "0"], "argument --lost-after: must be a finite number of seconds > 0"),
        (["--host", "999.1.1.1"], "collective orchestrator: the orchestrator cannot listen on 999.1.1.1"),
    ],
)
def test_the_orchestrator_daemon_refuses_bad_arguments(argv: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "collective", "orchestrator", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env=CLEAN,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_rank_0s_orchestrator_ends_with_its_job() -> None:
    port = free_port()
    with col.Runtime() as rt:
        init(rt, environ={**CLEAN, **torchrun(0, 1, port), "COLLECTIVE_TIMEOUT": "20"})
        serving = bootstrap.orchestrator_threads()[-1]
        assert serving.is_alive()
        rt.finish(0)
    serving.join(5)  # every node left: it stops serving, and nothing of it stays
    assert not serving.is_alive() and serving not in bootstrap.orchestrator_threads()
    assert _port_is_free(port)
