"""Jobs across emulated hosts (collective.bench.jobs.hosts): each host a network namespace whose link
can be shaped, taken down or slowed, and what every survivor hears when a host fails.

A process killed outright closes its connections (the kernel does): every survivor names it
within half a second. A host cut off or stopped closes nothing: it is found by its silence,
within the heartbeats' 2 s. A slow link is no failure: data that moves slowly raises nothing,
until a call's own timeout passes. These tests need root (network namespaces) and skip without.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from collective.bench import cli
from collective.bench.jobs.hosts import EmulatedHosts, link_bytes_per_second, unavailable
from tests.processes import READY, WORKER, Proc, expect_peer_lost, node_env

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

_jobs = itertools.count()


class Job:
    """An orchestrator on host 0 and one node worker per host, each inside its host."""

    def __init__(self, hosts: EmulatedHosts, *argv: str, timeout: float = 20) -> None:
        self.hosts = hosts
        address = hosts.address(0)
        self.orchestrator = Proc(
            hosts.command(0, [sys.executable, "-m", "collective", "orchestrator", "--host", address])
        )
        _, line = self.orchestrator.wait_for(READY, 30)
        orchestrator = line[len(READY) :]
        job = f"hosts-{os.getpid()}-{next(_jobs)}"
        self.nodes: list[Proc] = []
        for host in range(hosts.count):
            env = node_env(orchestrator, job, host, hosts.count, 1, timeout=timeout)
            env.update(COLLECTIVE_NODE_ADDRESS=f"{hosts.address(host)}:0", COLLECTIVE_HOST_ID=f"host{host}")
            self.nodes.append(Proc(hosts.command(host, [sys.executable, WORKER, *argv]), env))

    def close(self) -> None:
        for node in self.nodes:
            if node.process.poll() is None:
                os.kill(node.process.pid, signal.SIGCONT)  # (a stopped one ends too)
        for proc in [*self.nodes, self.orchestrator]:
            proc.kill()


@pytest.fixture
def three_hosts() -> Iterator[EmulatedHosts]:
    with EmulatedHosts(3, link="1gbit") as hosts:
        yield hosts


@pytest.fixture
def job_of(three_hosts: EmulatedHosts) -> Iterator[Any]:
    jobs: list[Job] = []

    def start(*argv: str, timeout: float = 20) -> Job:
        jobs.append(Job(three_hosts, *argv, timeout=timeout))
        return jobs[-1]

    yield start
    for job in jobs:
        job.close()


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


# -- the harness ---------------------------------------------------------------------------------


def test_emulated_hosts_reach_each_other_over_their_links_and_leave_nothing_behind() -> None:
    with EmulatedHosts(2, link="100mbit") as hosts:
        names = [hosts.namespace(0), hosts.namespace(1)]
        assert all(name in _namespaces() for name in names)
        listen = "import socket; s = socket.create_server((%r, 7000)); print('up', flush=True); s.accept()"
        server = Proc(hosts.command(0, [sys.executable, "-c", listen % hosts.address(0)]))
        try:
            server.wait_for("up", 30)
            connect = f"import socket; socket.create_connection(({hosts.address(0)!r}, 7000), timeout=5)"
            reached = subprocess.run(hosts.command(1, [sys.executable, "-c", connect]), capture_output=True)
            assert reached.returncode == 0, reached.stderr
            assert server.wait(10) == 0
        finally:
            server.kill()
        shaped = subprocess.run(
            hosts.command(0, ["tc", "qdisc", "show", "dev", "eth0"]), capture_output=True, text=True
        ).stdout
        assert "tbf" in shaped and "100Mbit" in shaped, shaped
        with EmulatedHosts(1) as other:  # another run at once: its own names and subnet
            assert other.namespace(0) not in names and other.address(0) != hosts.address(0)
    listed = _namespaces()
    assert not any(name in listed for name in names), listed
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"col{hosts.run}br" not in links and f"col{hosts.run}v" not in links


def test_link_rates_are_read_as_tc_writes_them() -> None:
    assert link_bytes_per_second("1gbit") == 125e6
    assert link_bytes_per_second("100Mbit") == 12.5e6
    with pytest.raises(ValueError, match=r"e\.g\. 100mbit"):
        link_bytes_per_second("fast")


def test_bench_across_hosts_prints_ours_beside_gloo_with_the_link_share(capsys: Any) -> None:
    pytest.importorskip("torch")
    argv = ["--hosts", "2", "--link", "1gbit", "--op", "all_reduce", "--strategy", "ring", "--compare"]
    argv += ["gloo", "-b", "1M", "-e", "1M", "-w", "1", "-n", "3"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "2 emulated hosts x 1 processes" in out and "links shaped to 1gbit" in out
    assert "link %" in out and "speedup vs gloo" in out and "torch.distributed gloo" in out, out
    assert "wrong elements: 0" in out
    assert not any(name.startswith("col") for name in _namespaces())


def test_bench_refuses_a_link_without_hosts(capsys: Any) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["--link", "1gbit"])
    assert stop.value.code == 2
    assert "give --hosts too" in capsys.readouterr().err


def test_a_machine_that_refuses_namespaces_is_named_and_the_bench_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A container without the capability refuses ``ip netns add``: unavailable() says so (found by
    trying), and ``collective bench --hosts`` refuses with it, exit status 2."""
    from collective.bench.jobs import hosts

    def refuse(*args: str, check: bool = True) -> Any:
        if check:
            raise hosts.HostsError("'ip netns add' failed: Operation not permitted")
        return subprocess.CompletedProcess(args, 1, "", "")

    hosts._refused.cache_clear()
    monkeypatch.setattr(hosts, "_ip", refuse)
    try:
        reason = hosts.unavailable()
        assert reason is not None and "cannot be made here" in reason and "Operation not permitted" in reason
        with pytest.raises(SystemExit) as stop:
            cli.main(["--hosts", "2", "--op", "all_reduce"])
        assert stop.value.code == 2
        assert "argument --hosts: emulated hosts cannot be made here" in capsys.readouterr().err
    finally:
        monkeypatch.undo()
        hosts._refused.cache_clear()


# -- host faults ---------------------------------------------------------------------------------


def test_a_host_whose_process_is_killed_is_named_by_every_survivor_within_half_a_second(job_of: Any) -> None:
    job = job_of("loop")
    job.nodes[0].wait_for("READY", 60)
    job.nodes[1].process.kill()
    killed = time.monotonic()
    expect_peer_lost([job.nodes[0], job.nodes[2]], killed, 0.5, naming="node 1 (peer 1)")


def test_a_host_whose_link_goes_down_is_named_within_the_heartbeat_bound(
    three_hosts: EmulatedHosts, job_of: Any
) -> None:
    job = job_of("loop")
    job.nodes[0].wait_for("READY", 60)
    three_hosts.set_link(2, up=False)
    down = time.monotonic()
    expect_peer_lost(
        [job.nodes[0], job.nodes[1]], down, 3.5, naming="node 2 (peer 2) stopped sending heartbeats"
    )
    when, line = job.nodes[2].wait_for("ERROR", 15)  # the cut-off host hears nothing from the orchestrator
    assert line.startswith("ERROR PeerLostError") and "orchestrator" in line, job.nodes[2].output()
    assert when - down < 3.5


def test_a_stopped_host_is_named_within_the_heartbeat_bound(job_of: Any) -> None:
    job = job_of("loop")
    job.nodes[0].wait_for("READY", 60)
    os.kill(job.nodes[2].process.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    expect_peer_lost(
        [job.nodes[0], job.nodes[1]], stopped, 3.5, naming="node 2 (peer 2) stopped sending heartbeats"
    )
    os.kill(job.nodes[2].process.pid, signal.SIGCONT)
    _, line = job.nodes[2].wait_for("ERROR", 15)  # once it runs again: lost (or the others gone)
    assert line.startswith("ERROR PeerLostError"), job.nodes[2].output()


def test_a_slow_link_is_no_failure_until_the_calls_own_timeout_passes(
    three_hosts: EmulatedHosts, job_of: Any
) -> None:
    three_hosts.reshape(1, "10mbit")  # 1 MiB all_reduce among 3: ~1.4 MB over it, ~1.1 s a call
    job = job_of("slow", "3", "0.3", timeout=60)
    for node in job.nodes:
        _, line = node.wait_for("ROUND 2", 60)
        assert float(line.split()[2]) > 0.5, node.output()  # it did go slowly
    for node in job.nodes:
        _, line = node.wait_for("ERROR", 30)
        assert line.startswith("ERROR CollectiveTimeout"), node.output()
        assert "PeerLostError" not in node.output()


def _children(pid: int) -> set[int]:
    """The processes ``pid`` started (its direct children), now."""
    found: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as handle:
            found.update(int(child) for child in handle.read().split())
    return found


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_bench_across_hosts_stopped_midway_leaves_no_namespace_link_or_process(signum: int) -> None:
    before = _namespaces()
    argv = [sys.executable, "-m", "collective", "bench", "--hosts", "2", "--link", "100mbit"]
    bench = Proc([*argv, "--op", "all_reduce", "--strategy", "ring", "-b", "64M", "-e", "64M", "-n", "50"])
    try:
        deadline = time.monotonic() + 30
        started: set[int] = set()
        while len(started) < 3 and time.monotonic() < deadline:  # its orchestrator and two nodes
            started |= _children(bench.process.pid)
            time.sleep(0.05)  # (polling /proc: nothing to wait on)
        assert len(started) >= 3, bench.output()
        made = _namespaces() - before
        assert made, _namespaces()
        bench.process.send_signal(signum)
        assert bench.wait(30) == 128 + signum, bench.output()
    finally:
        bench.kill()
    assert not _namespaces() & made
    assert not [pid for pid in started if os.path.exists(f"/proc/{pid}")], (
        "a child process outlived the bench"
    )
