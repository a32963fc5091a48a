"""The collective set across nodes: real processes over real ZeroMQ sockets on 127.0.0.1.

Every node runs tests/node_worker.py in "collective_set" mode: all_gather, reduce_scatter,
all_to_all, gather and scatter at every root, barrier and all_reduce_coalesced over the whole
job and over groups spanning nodes, each result checked against a reference the node computes
itself. Blocks from 0 to 17 elements travel inside the leaders' call exchange; 200 KiB blocks
move over the ZeroMQ link with the global strategy under test.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.node_worker import collective_set_count
from tests.processes import finish_all, start_nodes

pytestmark = pytest.mark.timeout(180)
_jobs = itertools.count()
NEW_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")


def run_job(orchestrator: str, nodes: int, devices: int, parts: list[str], **extra: Any) -> None:
    """Run the collective_set mode on ``nodes`` x ``devices`` peers; every node must check every result."""
    procs = start_nodes(orchestrator, f"set-{next(_jobs)}", nodes, devices, "collective_set", *parts, **extra)
    codes = finish_all(procs, 150)
    expected = collective_set_count(nodes * devices, *parts)
    totals = []
    for node, code in zip(procs, codes, strict=True):
        assert code == 0, node.output()
        totals += [int(line.split()[1]) for _, line in node.lines if line.startswith("OK ")]
    assert sum(totals) == expected, f"{totals} collectives checked, expected {expected} in all"


def strategies(strategy: str) -> dict[str, str]:
    """``strategy`` among node leaders for the new kinds, and all_reduce's (barrier, coalesced)."""
    return {f"global_{kind}_strategy": strategy for kind in (*NEW_KINDS, "all_reduce")}


def test_big_endian_arrays_reduce_across_nodes_of_several_peers(orchestrator: str) -> None:
    procs = start_nodes(orchestrator, f"order-{next(_jobs)}", 2, 2, "byte_order")
    for node, code in zip(procs, finish_all(procs, 90), strict=True):
        assert code == 0, node.output()
        assert node.output().count("OK 8") == 2, node.output()


@pytest.mark.parametrize("strategy", ["ring", "tree:2"])
def test_disjoint_groups_spanning_nodes_at_the_same_time(orchestrator: str, strategy: str) -> None:
    """[0, 3, 4] and [1, 2] (3 nodes x 2 peers) call their collectives concurrently."""
    run_job(orchestrator, 3, 2, ["concurrent_groups"], timeout=5, **strategies(strategy))


@pytest.mark.parametrize(("nodes", "devices"), [(3, 2), (2, 1)], ids=["3x2", "2x1"])
def test_send_and_recv_between_nodes(orchestrator: str, nodes: int, devices: int) -> None:
    world = nodes * devices
    procs = start_nodes(orchestrator, f"p2p-{next(_jobs)}", nodes, devices, "p2p")
    for proc, code in zip(procs, finish_all(procs, 90), strict=True):
        assert code == 0, proc.output()
        assert f"OK {devices * (6 + 2 * (world - 1))}" in proc.output(), proc.output()
