"""Multi-node jobs with real processes over real ZeroMQ sockets on 127.0.0.1."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from tests.processes import Proc, finish_all, start_nodes, start_orchestrator

pytestmark = pytest.mark.timeout(180)
_jobs = itertools.count()


@pytest.fixture(scope="module")
def orchestrator() -> Iterator[str]:
    """One orchestrator daemon for the module: it serves many jobs, one after another and at once."""
    proc, address = start_orchestrator()
    try:
        yield address
    finally:
        proc.terminate()
        assert proc.process.returncode == 0, proc.output()


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
        assert node.output().count("OK 276") == 1, node.output()  # 138 collectives x 2 peers


def test_two_jobs_at_the_same_time_on_one_orchestrator(orchestrator: str) -> None:
    first = start_nodes(orchestrator, job_name(), 2, 1, "matrix")
    second = start_nodes(orchestrator, job_name(), 2, 2, "matrix", global_all_reduce_strategy="tree:2")
    for node, code in zip(first + second, finish_all(first + second, 150), strict=True):
        assert code == 0, node.output()
