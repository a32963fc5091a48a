"""A fixed subset of torch's own distributed test suite, run on our backend (tests/torch_suite).

The whole suite (``python -m tests.torch_suite.run``, about 300 tests) takes minutes per backend;
these cover each op family, DDP, groups, point to point and errors: as a third-party backend
(the suite's "plugin" path) at 2 and 3 ranks, and the tests the suite gates on gloo's name run
with our backend creating every group (``--as-gloo``). Each run is one subprocess of the runner;
every selected test must pass (none skipped: a skip would hide a missing feature here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import RUN_SETTINGS
from tests.torch_suite.run import error_summary, exception_lines, selected

pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(400)

ROOT = Path(__file__).resolve().parent.parent

AS_PLUGIN_2 = [
    "test_all_reduce_sum",
    "test_all_reduce_product",
    "test_all_reduce_max",
    "test_all_reduce_sum_complex",
    "test_all_reduce_sum_async",
    "test_all_reduce_complex_unsupported_ops",
    "test_broadcast",
    "test_reduce_sum_twice",
    "test_all_gather",
    "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_with_empty",
    "test_gather_checks",
    "test_scatter_checks",
    "test_barrier",
    "test_send_recv",
    "test_send_recv_with_tag",
    "test_send_recv_any_source",
    "test_isend",
    "test_irecv",
    "test_destroy_group",
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallel_requires_grad",
    "test_ddp_create_graph",
    "test_static_graph_api_cpu",
]
AS_PLUGIN_3 = [
    "test_all_reduce_full_group_sum",
    "test_reduce_full_group_max",
    "test_all_gather_coalesced_full_group",
    "test_scatter_full_group",
    "test_barrier_full_group",
    "test_get_rank_size_group",
    "test_destroy_full_group",
]
AS_GLOO_2 = [
    "test_all_reduce_coalesced_sum",
    "test_sparse_all_reduce_sum",
    "test_scatter_object_list",
    "test_all_gather_object_default_pg",
    "test_get_future",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_batch_isend_irecv_gloo_tags",
    "test_barrier_timeout_global",
]


def run_suite(tmp_path: Path, names: list[str], world: int, *extra: str) -> dict[str, object]:
    out = tmp_path / "suite.json"
    command = [sys.executable, "-m", "tests.torch_suite.run", "--backend", "collective"]
    command += ["--world-size", str(world), "--start", "fork", "--timeout", "120", "--json", str(out)]
    command += [*extra, *(arg for name in names for arg in ("--only", name))]
    env = {
        k: v
        for k, v in os.environ.items()
        if k in RUN_SETTINGS or not k.startswith(("COLLECTIVE_", "MASTER_"))
    }
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    assert out.exists(), f"the runner wrote no report (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    report = json.loads(out.read_text())
    outcomes = {test["name"]: test["outcome"] for test in report["tests"]}
    wrong = {name: outcome for name, outcome in outcomes.items() if outcome != "passed"}
    assert not wrong and sorted(outcomes) == sorted(names), f"{wrong}\n{done.stdout[-4000:]}"
    assert done.returncode == 0
    return report


@pytest.mark.parametrize(
    ("names", "world", "extra"),
    [(AS_PLUGIN_2, 2, ()), (AS_PLUGIN_3, 3, ()), (AS_GLOO_2, 2, ("--as-gloo",))],
    ids=["plugin-2", "plugin-3", "as-gloo-2"],
)
def test_torchs_own_distributed_tests_pass_on_our_backend(
    tmp_path: Path, names: list[str], world: int, extra: tuple[str, ...]
) -> None:
    report = run_suite(tmp_path, names, world, *extra)
    assert report["counts"]["passed"] == len(names)  # type: ignore[index]


def test_the_runner_selects_by_name_and_pattern() -> None:
    names = ["test_all_reduce_sum", "test_all_reduce_max", "test_barrier", "test_barrier_group"]
    assert selected(names, [], []) == names
    assert selected(names, ["barrier"], []) == ["test_barrier", "test_barrier_group"]
    assert selected(names, ["test_all_*_max"], ["test_barrier"]) == ["test_all_reduce_max", "test_barrier"]
    with pytest.raises(SystemExit, match="no such test in the suite: test_nothing"):
        selected(names, [], ["test_nothing"])


def test_the_runner_reports_each_processs_exception_without_torchs_cpp_stack() -> None:
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "x.py", line 3, in f\n'
        "    raise RuntimeError('boom')\n"
        "RuntimeError: boom\n"
        "Exception raised from run at /src/x.cpp:1 (most recent call first):\n"
        "frame #0: ...\n"
    )
    assert exception_lines(traceback) == ["RuntimeError: boom"]
    spawned = (
        "Process 1 exited with error code 10 and exception:\n" + traceback + "\n"
        "Process 0 exited with error code 10 and exception:\n"
        + traceback.replace("RuntimeError: boom", "ValueError: bad")
    )
    assert error_summary(spawned) == ["Process 1: RuntimeError: boom", "Process 0: ValueError: bad"]
