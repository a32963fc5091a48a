"""docs/deploy.md's recipes, run as written: its sbatch scripts inside a simulated Slurm job, its
Kubernetes manifest's containers as local processes.

The Slurm job is what sbatch would make of the scripts' #SBATCH lines (2 nodes, their tasks), on
this machine: Slurm's variables of the allocation, and tests/fake_slurm's srun and scontrol on
PATH (srun runs the tasks here, each with the variables a task gets). The manifest is read as
YAML; its containers run with their commands and environment as written, the cluster's names,
ports and secret replaced by this machine's. The recipes are the files in docs/examples/deploy,
and docs/deploy.md shows them verbatim.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from collective.launch import free_port, stop_processes
from tests.conftest import RUN_SETTINGS
from tests.processes import outside_launchers

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "docs" / "examples" / "deploy"
FAKE_SLURM = Path(__file__).with_name("fake_slurm")


def sbatch(script: str, tasks_per_node: int, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` as sbatch would on 2 nodes (both this machine, at two loopback addresses)."""
    env = outside_launchers(keep=RUN_SETTINGS)
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
    job = subprocess.Popen(
        ["bash", str(RECIPES / script)],
        cwd=RECIPES,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # (its tasks in its process group: stopped with it, whatever happens)
    )
    try:
        out, err = job.communicate(timeout=150)
    finally:
        stop_processes([job], groups=True)
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


def test_the_docs_show_the_recipes_as_they_are() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    recipes = ("slurm_tasks.sbatch", "slurm_torchrun.sbatch", "kubernetes.yaml", "train.py")
    for name in (*recipes, "ray_group.py", "ray_train.py"):
        assert (RECIPES / name).read_text().strip() in text, f"docs/deploy.md does not show {name} as it is"
    shown = (ROOT / "docs" / "frameworks.md").read_text()
    assert (RECIPES / "ray_group.py").read_text().strip() in shown, "docs/frameworks.md: ray_group.py"


def test_one_slurm_task_per_device() -> None:
    done = sbatch("slurm_tasks.sbatch", 2, MASTER_PORT=str(free_port()))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all_reduce over 4 processes: mean 1.50" in done.stdout, done.stdout + done.stderr


def test_one_slurm_task_per_node_running_torchrun() -> None:
    pytest.importorskip("torch")
    done = sbatch("slurm_torchrun.sbatch", 1, RDZV_PORT=str(free_port()))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all_reduce over 4 processes: mean 1.50" in done.stdout, done.stdout + done.stderr


# What the manifest's containers may set: the variables the runtime reads (collective.config,
# collective.launch), nothing misspelt.
READ = {
    "COLLECTIVE_GLOBAL_ADDRESS",
    "COLLECTIVE_JOB",
    "COLLECTIVE_TOKEN",
    "COLLECTIVE_TIMEOUT",
    "COLLECTIVE_NODE_ADDRESS",
    "COLLECTIVE_DATA_SERVICE_PORT",
}


def containers(documents: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every container of the manifest by the kind of what holds it."""
    found = {}
    for document in documents:
        spec = document["spec"]
        if document["kind"] == "Deployment":
            found["Deployment"] = spec["template"]["spec"]["containers"][0]
        elif document["kind"] == "JobSet":
            job = spec["replicatedJobs"][0]["template"]["spec"]
            found["JobSet"] = job["template"]["spec"]["containers"][0]
    return found


def test_the_kubernetes_manifest_runs_as_written(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    pytest.importorskip("torch")
    documents = list(yaml.safe_load_all((RECIPES / "kubernetes.yaml").read_text()))
    assert [d["kind"] for d in documents] == ["Service", "Deployment", "JobSet"]
    service, _, jobset = documents
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["ports"][0]["port"] == 29400
    found = containers(documents)
    for container in found.values():
        assert {e["name"] for e in container["env"]} <= READ, container["env"]
    workers = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert workers["completionMode"] == "Indexed" and workers["parallelism"] == workers["completions"] == 2
    # torchrun's agents meet through the orchestrator's service (collective.torch.rendezvous)
    command = found["JobSet"]["command"]
    assert "--rdzv-backend=collective" in command, command
    assert f"--rdzv-endpoint={service['metadata']['name']}:29400" in command, command
    # this machine's names, ports and secret for the cluster's
    orchestrator_port = free_port()
    here = {
        "0.0.0.0": "127.0.0.1",
        "collective-orchestrator:29400": f"127.0.0.1:{orchestrator_port}",
        "29400": str(orchestrator_port),
    }

    def local(text: str, index: int = 0) -> str:
        for cluster, mine in here.items():
            text = text.replace(cluster, mine)
        return text.replace("$(JOB_COMPLETION_INDEX)", str(index))

    def environment(container: dict[str, Any], index: int = 0) -> dict[str, str]:
        env = outside_launchers()
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env["OMP_NUM_THREADS"] = "1"
        for item in container["env"]:
            secret = item.get("valueFrom", {}).get("secretKeyRef")
            env[item["name"]] = "a test token" if secret else local(item["value"], index)
        return env

    server = found["Deployment"]
    command = [local(arg) for arg in server["command"]]
    started = [subprocess.Popen(command, env=environment(server), start_new_session=True)]
    try:
        pods = [
            subprocess.Popen(
                [local(arg, index) for arg in found["JobSet"]["command"]],
                env=environment(found["JobSet"], index),
                cwd=RECIPES,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # (stopped as a whole; torchrun stops its workers on SIGINT)
            )
            for index in range(workers["completions"])
        ]
        started += pods
        outputs = [pod.communicate(timeout=150)[0] for pod in pods]
        assert [pod.returncode for pod in pods] == [0, 0], outputs
        assert "all_reduce over 4 processes: mean 1.50" in "".join(outputs), outputs  # (rank 0's pod)
    finally:
        stop_processes(started, groups=True)
