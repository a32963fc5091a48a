"""docs/examples/: each example runs tiny under ``collective launch`` (or torchrun) and passes its own check.

Every example compares its result with a single-process reference it computes itself and exits 1
when they differ; these tests run them with real processes and read their verdict lines.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from collective.launch import free_port
from tests.conftest import RUN_SETTINGS
from tests.processes import Proc

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(150)

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
CLEAN = {
    k: v
    for k, v in os.environ.items()
    if k in RUN_SETTINGS or not k.startswith(("COLLECTIVE_", "SLURM_", "OMPI_"))
}
CLEAN = {k: v for k, v in CLEAN.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def launch(nodes: int, script: str, *args: str) -> str:
    """``collective launch --nodes N docs/examples/SCRIPT --tiny ARGS``: its output (exit 0 asserted)."""
    argv = [
        sys.executable,
        "-m",
        "collective",
        "launch",
        "--nodes",
        str(nodes),
        "--timeout",
        "60",
        str(EXAMPLES / script),
        "--tiny",
        *args,
    ]
    proc = Proc(argv, CLEAN)
    assert proc.wait(120) == 0, proc.output()
    return proc.output()


def test_ddp_variants_match_one_process_and_time_each_variant() -> None:
    output = launch(2, "ddp_variants.py")
    for peer in range(2):
        assert f"[node {peer}] ddp_variants: peer {peer}: OK" in output, output
    rows = dict(re.findall(r"\[node 0\]   (\S.*?\S) +\d+\.\d+ +\d+\.\d+x +\d+ +(\d\.\de[-+]\d+)", output))
    expected = [
        "no communication",
        "naive per-parameter",
        "flattened",
        "overlapped per-parameter",
        "bucketed (collective.ddp)",
        "accumulation x4 (no_sync)",
    ]
    assert list(rows) == expected, output
    assert float(rows["no communication"]) > 1e-4, output  # the check sees a missing sync


@pytest.mark.parametrize(
    ("nodes", "args", "layout", "roles"),
    [
        (3, [], "2-tier (2 workers + aggregator-optimiser)", ["worker", "worker", "server"]),
        (
            4,
            ["--workers", "2"],
            "3-tier (2 workers + aggregator + optimiser)",
            ["worker", "worker", "aggregator", "optimiser"],
        ),
    ],
    ids=["2-tier", "3-tier"],
)
def test_parameter_server_layouts_match_one_process(
    nodes: int, args: list[str], layout: str, roles: list[str]
) -> None:
    output = launch(nodes, "parameter_server.py", *args)
    assert f"parameter_server: {layout}" in output, output
    for peer, role in enumerate(roles):
        assert f"[node {peer}] parameter_server: peer {peer} ({role}): OK" in output, output


def test_tensor_parallel_two_groups_match_the_unsharded_layers() -> None:
    output = launch(4, "tensor_parallel.py", "--tp", "2")
    for peer in range(4):
        group = (0, 1) if peer < 2 else (2, 3)
        assert f"tensor_parallel: peer {peer} (rank {peer % 2} of group {group}): OK" in output, output
    assert re.search(r"column -> tanh -> row \(MLP\) +collectives: forward 1, backward 1", output), output
    assert re.search(r"row-parallel \(input split\) +collectives: forward 1, backward 0", output), output


def test_tensor_parallel_under_torchrun() -> None:
    """The real torchrun: its agent serves a store on the master port (init() meets through it)."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(EXAMPLES / "tensor_parallel.py"),
        "--tiny",
    ]
    proc = Proc(argv, {**CLEAN, "COLLECTIVE_TIMEOUT": "60"})
    assert proc.wait(120) == 0, proc.output()
    for peer in range(2):
        assert f"tensor_parallel: peer {peer} (rank {peer} of group (0, 1)): OK" in proc.output(), (
            proc.output()
        )


def test_pipeline_parallel_four_stages_match_the_unpipelined_model() -> None:
    output = launch(4, "pipeline_parallel.py")
    for stage in range(4):
        assert f"[node {stage}] pipeline_parallel: stage {stage}: OK" in output, output
        assert f"in flight (1F1B bound {4 - stage})" in output, output
