"""docs/deploy.md's recipes, run as written: its sbatch scripts inside a simulated Slurm job.

The job is what sbatch would make of the scripts' #SBATCH lines (2 nodes, their tasks), on this
machine: Slurm's variables of the allocation, and tests/fake_slurm's srun and scontrol on PATH
(srun runs the tasks here, each with the variables a task gets). The scripts are the files in
docs/examples/deploy, and docs/deploy.md shows them verbatim.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from collective.launch import free_port
from tests.conftest import RUN_SETTINGS

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "docs" / "examples" / "deploy"
FAKE_SLURM = Path(__file__).with_name("fake_slurm")
LAUNCHER_PREFIXES = ("COLLECTIVE_", "SLURM_", "OMPI_", "PMIX_", "TORCHELASTIC_")
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def sbatch(script: str, tasks_per_node: int, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` as sbatch would on 2 nodes (both this machine, at two loopback addresses)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k in RUN_SETTINGS or not (k.startswith(LAUNCHER_PREFIXES) or k in LAUNCHER_VARIABLES)
    }
    env.update(
        PATH=os.pathsep.join([str(FAKE_SLURM), str(Path(sys.executable).parent), env.get("PATH", "")]),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME=script,
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="127.0.0.1,127.0.0.2",
        SLURM_NTASKS=str(2 * tasks_per_node),
        SLURM_NTASKS_PER_NODE=str(tasks_per_node),
        SLURM_SUBMIT_DIR=str(RECIPES),
        OMP_NUM_THREADS="1",
        **extra,
    )
    return subprocess.run(
        ["bash", str(RECIPES / script)], cwd=RECIPES, env=env, capture_output=True, text=True, timeout=150
    )


def test_the_docs_show_the_recipes_as_they_are() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    for name in ("slurm_tasks.sbatch", "slurm_torchrun.sbatch", "train.py"):
        assert (RECIPES / name).read_text().strip() in text, f"docs/deploy.md does not show {name} as it is"


def test_one_slurm_task_per_device() -> None:
    done = sbatch("slurm_tasks.sbatch", 2, MASTER_PORT=str(free_port()))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all_reduce over 4 processes: mean 1.50" in done.stdout, done.stdout + done.stderr


def test_one_slurm_task_per_node_running_torchrun() -> None:
    pytest.importorskip("torch")
    done = sbatch("slurm_torchrun.sbatch", 1, RDZV_PORT=str(free_port()))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all_reduce over 4 processes: mean 1.50" in done.stdout, done.stdout + done.stderr
