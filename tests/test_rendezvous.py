"""torchrun's agents meeting through the orchestrator (``--rdzv-backend collective``): the key-value
stores it serves, the torch store over them, and torchrun itself with two agents, elastic."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from collective.bench.jobs.hosts import EmulatedHosts, unavailable
from collective.launch import free_port, stop_processes
from collective.transport.kv.client import StoreClient, StoreError
from collective.transport.kv.store import Stores
from collective.transport.orchestrator import Orchestrator
from tests.conftest import RUN_SETTINGS, wait_until
from tests.processes import READY, Proc, outside_launchers

# -- the stores (one orchestrator's, called directly) ---------------------------------------------


def kv(op: str, store: str = "s", **fields: object) -> dict[str, object]:
    return {"t": "kv", "job": store, "id": fields.pop("id", 1), "op": op, **fields}


def answer(stores: Stores, message: dict[str, object], identity: bytes = b"a") -> dict[str, object]:
    (only,) = stores.handle(identity, message)
    return only[1]


def test_a_store_sets_gets_adds_and_compares_as_torch_stores_do() -> None:
    stores = Stores()
    assert answer(stores, kv("set", keys=["a", "b"], values=[b"1", "two"])) == {
        "t": "kv",
        "job": "s",
        "id": 1,
    }
    assert answer(stores, kv("get", keys=["b", "a"]))["values"] == [b"two", b"1"]
    assert answer(stores, kv("add", keys=["n"], amount=5))["value"] == 5
    assert answer(stores, kv("add", keys=["n"], amount=-2))["value"] == 3
    assert answer(stores, kv("get", keys=["n"]))["values"] == [b"3"]
    assert "holds no integer" in str(answer(stores, kv("add", keys=["b"], amount=1))["error"])
    # compare_set: a missing key counts as b""; the answer is the value now
    assert answer(stores, kv("compare_set", keys=["c"], expected=b"x", desired=b"y"))["value"] == b"x"
    assert answer(stores, kv("check", keys=["c"]))["value"] is False
    assert answer(stores, kv("compare_set", keys=["c"], expected=b"", desired=b"y"))["value"] == b"y"
    assert answer(stores, kv("compare_set", keys=["c"], expected=b"x", desired=b"z"))["value"] == b"y"
    assert answer(stores, kv("compare_set", keys=["c"], expected=b"y", desired=b"z"))["value"] == b"z"
    assert answer(stores, kv("count"))["value"] == 4
    assert answer(stores, kv("delete", keys=["c"]))["value"] is True
    assert answer(stores, kv("delete", keys=["c"]))["value"] is False
    assert answer(stores, kv("check", keys=["a", "n"]))["value"] is True
    # stores are apart by name
    assert answer(stores, kv("check", "other", keys=["a"]))["value"] is False
    assert sorted(stores.names()) == ["other", "s"]


def test_a_get_or_wait_is_held_until_its_keys_are_set_or_its_time_is_up() -> None:
    stores = Stores()
    assert stores.handle(b"getter", kv("get", keys=["a", "b"], wait=30, id=7)) == []
    assert stores.handle(b"waiter", kv("wait", keys=["a"], wait=30, id=8)) == []
    assert stores.handle(b"late", kv("get", keys=["never"], wait=0, id=9)) == []
    answers = stores.handle(b"setter", kv("set", keys=["a"], values=[b"1"]))
    assert [(who, reply.get("id")) for who, reply in answers] == [(b"setter", 1), (b"waiter", 8)]
    answers = stores.handle(b"adder", kv("add", keys=["b"], amount=2))
    assert answers[1] == (b"getter", {"t": "kv", "job": "s", "id": 7, "values": [b"1", b"2"]})
    (expired,) = stores.expire()
    assert expired[0] == b"late" and expired[1]["error"] == "timeout: key 'never' still not set in store 's'"
    assert stores.expire() == []
    # a connection that closed waits for nothing
    assert stores.handle(b"gone", kv("wait", keys=["x"], wait=30)) == []
    stores.forget(b"gone")
    assert [who for who, _ in stores.handle(b"setter", kv("set", keys=["x"], values=[b""]))] == [b"setter"]


def test_a_store_refuses_what_is_malformed_or_too_much() -> None:
    stores = Stores(most_bytes=100)
    for message, error in [
        (kv("set", keys="a", values=[b"1"]), "keys must be a list of strings"),
        (kv("set", keys=["a"], values=[]), "one value per key"),
        (kv("set", keys=["a"], values=[3]), "values must be bytes or strings"),
        (kv("get", keys=["a"], wait=-1), "wait must be 0 to"),
        (kv("add", keys=["a", "b"], amount=1), "'add' takes one key"),
        (kv("add", keys=["a"], amount="1"), "integer amount"),
        (kv("rename", keys=["a"]), "unknown op 'rename'"),
        (kv("set", keys=["big"], values=[b"x" * 98]), "full: store 's' holds 0 bytes, at most 100"),
    ]:
        assert error in str(answer(stores, message)["error"]), error
    assert answer(stores, kv("set", keys=["ok"], values=[b"x" * 98]))  # (2 + 98 bytes: just fits)
    assert "full" in str(answer(stores, kv("set", keys=["o"], values=[b""]))["error"])
    assert "error" not in answer(stores, kv("set", keys=["ok"], values=[b"y" * 98]))  # (a value replaced)


def test_an_idle_store_is_dropped() -> None:
    stores = Stores(idle=0.0)
    answer(stores, kv("set", keys=["a"], values=[b"1"]))
    assert stores.handle(b"w", kv("wait", "held", keys=["a"], wait=30)) == []
    time.sleep(0.01)  # (older than an idle time of 0)
    assert stores.expire() == [] and stores.names() == ["held"]  # (one with a held wait stays)


# -- the torch store, over a real orchestrator ----------------------------------------------------


@pytest.fixture
def served() -> Iterator[Orchestrator]:
    orchestrator = Orchestrator(token="t0ken")
    thread = threading.Thread(target=orchestrator.serve, daemon=True)
    thread.start()
    yield orchestrator
    orchestrator.stop()
    thread.join(5)


def test_the_torch_store_works_through_a_prefix_store_and_across_threads(served: Orchestrator) -> None:
    dist = pytest.importorskip("torch.distributed")
    from collective.torch.rendezvous import OrchestratorStore

    store = OrchestratorStore(served.address, "run", "t0ken", timedelta(seconds=10))
    other = OrchestratorStore(served.address, "run", "t0ken", timedelta(seconds=10))
    try:
        prefixed = dist.PrefixStore("round.0", store)
        prefixed.set("a", "1")
        assert other.get("round.0/a") == b"1"
        assert prefixed.add("n", 2) == 2 and other.add("round.0/n", 3) == 5
        prefixed.multi_set(["x", "y"], ["1", b"2"])
        assert prefixed.multi_get(["x", "y"]) == [b"1", b"2"]
        assert prefixed.compare_set("a", "1", "3") == b"3"
        assert prefixed.check(["a", "x"]) and not prefixed.check(["zz"])
        assert store.num_keys() == 4 and store.delete_key("round.0/x") and store.num_keys() == 3
        # a get blocks until another client sets the key, while this client's other thread goes on
        got: list[bytes] = []
        getter = threading.Thread(target=lambda: got.append(store.get("late")))
        getter.start()
        wait_until(lambda: len(served._stores._held) == 1, 5, "the get held by the orchestrator")
        assert store.add("meanwhile", 1) == 1  # (the same client, from this thread)
        other.set("late", "here")
        getter.join(5)
        assert got == [b"here"]
        # a timeout names the keys never set
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError, match=r"timeout: keys 'p', 'q' still not set in store 'run'"):
            store.wait(["p", "q"], timedelta(seconds=0.3))
        assert time.monotonic() - started < 3
    finally:
        store.close()
        other.close()


def test_a_wrong_token_or_no_orchestrator_is_named(served: Orchestrator) -> None:
    started = time.monotonic()
    wrong = StoreClient(served.address, "run", "not the token")
    try:
        with pytest.raises(
            StoreError, match=r"handshake failed .* COLLECTIVE_TOKEN must be the orchestrator's"
        ):
            wrong.request("count", 10)
    finally:
        wrong.close()
    assert time.monotonic() - started < 5
    nobody = StoreClient(f"127.0.0.1:{free_port()}", "run", None, connect_timeout=0.5)
    try:
        with pytest.raises(StoreError, match=r"no connection to the orchestrator at 127\.0\.0\.1:.*: start"):
            nobody.request("count", 10)
    finally:
        nobody.close()


# -- torchrun -------------------------------------------------------------------------------------

WORKER = Path(__file__).with_name("torchrun_worker.py")
ORCHESTRATOR = [sys.executable, "-m", "collective", "-v", "orchestrator", "--port", "0"]
ROUND = re.compile(r"ROUND (\S+) (\d+) (\d+) (\d+)")


class Machines:
    """Where the test's hosts run: emulated hosts (network namespaces, collective.bench.jobs.hosts)
    where this machine allows them (as root), else all of them on this machine's loopback."""

    def __init__(self, count: int) -> None:
        self._hosts = EmulatedHosts(count) if unavailable() is None else None

    def __enter__(self) -> Machines:
        if self._hosts is not None:
            self._hosts.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._hosts is not None:
            self._hosts.close()

    def address(self, host: int) -> str:
        return self._hosts.address(host) if self._hosts is not None else "127.0.0.1"

    def command(self, host: int, argv: list[str]) -> list[str]:
        return self._hosts.command(host, argv) if self._hosts is not None else argv


class Agent:
    """A torchrun agent of one worker (``--rdzv-backend collective``) on host ``host`` of
    ``machines``, in a process group of its own."""

    def __init__(
        self, machines: Machines, host: int, endpoint: str, finish: Path, env: dict[str, str]
    ) -> None:
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
            "--max-restarts", "2", "--monitor-interval", "0.2", "--rdzv-backend", "collective",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic", "--local-addr", machines.address(host),
            "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
            str(WORKER), str(finish), "2",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            machines.command(host, argv),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def rounds(self) -> list[tuple[str, int, int, float]]:
        """(job, rank, world, sum) of each ROUND line its workers printed."""
        said = ROUND.findall("\n".join(list(self.lines)))  # (lines of two workers may run together)
        return [(job, int(rank), int(world), float(total)) for job, rank, world, total in said]

    def output(self) -> str:
        return "\n".join(self.lines)

    def lose_node(self) -> None:
        """SIGKILL the agent and its worker at once (a worker leads a session of its own), as when
        their machine goes down."""
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for process in [pid, *map(int, children)]:
            os.kill(process, signal.SIGKILL)
        self.process.wait(10)


def whole(agents: list[Agent], world: int, after: int = -1) -> dict[int, list[tuple[int, float]]]:
    """Round -> (rank, sum) of every worker, for the rounds after ``after`` whose ``world`` workers
    all printed (a round's job is torchrun-elastic.<round>)."""
    found: dict[int, list[tuple[int, float]]] = {}
    for agent in agents:
        for job, rank, size, total in agent.rounds():
            number = int(job.removeprefix("torchrun-elastic."))
            if size == world and number > after:
                found.setdefault(number, []).append((rank, total))
    return {number: sorted(sums) for number, sums in found.items() if len(sums) == world}


@pytest.mark.timeout(180)
def test_two_torchrun_agents_meet_through_the_orchestrator_and_one_restarts(tmp_path: Path) -> None:
    """min:max 1:2 nodes of one process each, on two hosts (emulated where root may make them):
    both agents form a world of 2; the second host's agent is killed with its process, the other's
    process fails, restarts and goes on alone; a new agent comes up on that host and the world is 2
    again, each round a job of its own on the orchestrator (which runs on the first host)."""
    pytest.importorskip("torch")
    env = outside_launchers(keep=RUN_SETTINGS)
    env.update(COLLECTIVE_TOKEN="a torchrun token", OMP_NUM_THREADS="1", COLLECTIVE_TIMEOUT="30")
    finish = tmp_path / "finish"
    agents: list[Agent] = []
    with contextlib.ExitStack() as cleanup:
        machines = cleanup.enter_context(Machines(2))  # (the orchestrator and an agent on host 0)
        server = Proc(machines.command(0, [*ORCHESTRATOR, "--host", machines.address(0)]), env)
        cleanup.callback(server.terminate)
        cleanup.callback(lambda: stop_processes([agent.process for agent in agents], groups=True))
        _, line = server.wait_for(READY, 30)
        address = line[len(READY) :]
        agents += [Agent(machines, 0, address, finish, env), Agent(machines, 1, address, finish, env)]
        first, second = agents
        # (if one agent starts over a second after the other, it forms a world of 1 first, and
        # the other joins it in the next round: a world of 2 comes either way)
        wait_until(lambda: whole([first, second], 2), 60, lambda: f"2\n{first.output()}\n{second.output()}")
        ((formed, sums),) = whole([first, second], 2).items()
        assert sums == [(0, 3.0), (1, 3.0)]
        second.lose_node()
        wait_until(lambda: whole([first], 1, after=formed), 60, lambda: f"alone\n{first.output()}")
        ((alone, sums),) = whole([first], 1, after=formed).items()
        assert sums == [(0, 1.0)]
        finish.touch()
        agents.append(Agent(machines, 1, address, finish, env))  # (the lost host, back)
        third = agents[-1]
        for agent in (first, third):
            assert agent.process.wait(60) == 0, agent.output()
        ((_, sums),) = whole([first, third], 2, after=alone).items()
        assert sums == [(0, 3.0), (1, 3.0)]
