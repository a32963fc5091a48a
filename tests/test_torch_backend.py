"""The torch.distributed backend "collective": real torchrun-style processes, and its pieces in process.

Skipped where torch is not installed (it is the optional extra ``[torch]``; CI installs the CPU
build). The processes run tests/torch_worker.py with torchrun's variables on 127.0.0.1.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import collective.torch as backend  # noqa: E402  (after the skip: it imports torch)
from collective.errors import MismatchError, PeerLostError  # noqa: E402
from collective.launch import free_port  # noqa: E402
from collective.torch.work import TorchWork, array, backend_error, fill, host  # noqa: E402
from tests.conftest import RUN_SETTINGS  # noqa: E402
from tests.processes import Proc, finish_all, outside_launchers  # noqa: E402

pytestmark = pytest.mark.timeout(180)

WORKER = str(Path(__file__).with_name("torch_worker.py"))
CLEAN = outside_launchers(keep=RUN_SETTINGS)  # (the workers' own variables come from each test)


def torchrun(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    return {
        **CLEAN,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "COLLECTIVE_TIMEOUT": "60",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def run_job(world: int, *argv: str, timeout: float = 150, **extra: str) -> list[Proc]:
    """Run ``world`` ranks of torch_worker.py; every one must exit 0 and print OK."""
    port = free_port()
    procs = [
        Proc([sys.executable, WORKER, *argv], torchrun(rank, world, port, **extra)) for rank in range(world)
    ]
    codes = finish_all(procs, timeout)
    for rank, (proc, code) in enumerate(zip(procs, codes, strict=True)):
        assert code == 0 and f"OK {rank}" in proc.output(), f"rank {rank} (exit {code}):\n{proc.output()}"
    return procs


# -- real processes -------------------------------------------------------------------------------

AUTOLOADED = """
import sys, torch, torch.distributed as dist
loaded = sorted(name for name in sys.modules if name.startswith("collective"))
dist.init_process_group("collective")
rank = dist.get_rank()
values = torch.full((3,), float(rank + 1))
dist.all_reduce(values)
assert values.tolist() == [3.0] * 3, values
print(f"OK {rank} at import {loaded}", flush=True)
dist.destroy_process_group()
"""


def test_a_process_that_never_imports_the_package_knows_the_backend() -> None:
    """torch's backend autoload (entry point group ``torch.backends``): init_process_group("collective")
    in a script that never imports collective (a Ray Train worker, a configured name); ``import torch``
    itself loads only collective.autoload, not the runtime."""
    port = free_port()
    procs = [Proc([sys.executable, "-c", AUTOLOADED], torchrun(rank, 2, port)) for rank in range(2)]
    for rank, (proc, code) in enumerate(zip(procs, finish_all(procs, 120), strict=True)):
        expected = f"OK {rank} at import ['collective', 'collective.autoload']"
        assert code == 0 and expected in proc.output(), f"rank {rank} (exit {code}):\n{proc.output()}"


RECORDED = """
import sys, torch, torch.distributed as dist
import collective as col
dist.init_process_group("collective")
values = torch.ones(4)
dist.all_reduce(values)  # LINE 6
dist.all_reduce(values, async_op=True).wait()  # LINE 7
dist.broadcast(values, src=0)  # LINE 8
for _ in range(3):
    dist.all_reduce(values)  # LINE 10 (its kept call, run again)
for entry in col.dump_trace(sys.argv[1]) and col.trace.RECORDER.entries():
    print("ENTRY", entry[3], col.trace.recorder.frame_of(entry[4])["line"], flush=True)
print("STATS", sorted((row["kind"], row["calls"]) for row in col.stats()), flush=True)
dist.destroy_process_group()
"""


def test_the_backends_calls_are_recorded_with_the_scripts_lines(tmp_path: Path) -> None:
    """The flight recorder sees the torch backend's calls, blocking or not, kept or not, at the
    line of the script that made them (not in torch.distributed, nor the worker that ran an async
    one)."""
    proc = Proc([sys.executable, "-c", RECORDED, str(tmp_path / "dump.json")], torchrun(0, 1, free_port()))
    assert finish_all([proc], 120) == [0], proc.output()
    entries = [line.split()[1:] for _, line in proc.lines if line.startswith("ENTRY")]
    expected = [["all_reduce", "6"], ["all_reduce", "7"], ["broadcast", "8"], *[["all_reduce", "10"]] * 3]
    assert entries == expected, proc.output()
    assert "STATS [('all_reduce', 5), ('broadcast', 1)]" in proc.output()


MIXED = """
import sys, torch.distributed as dist
try:
    dist.init_process_group(sys.argv[1])
except dist.DistBackendError as exc:
    print(f"REFUSED {exc}", flush=True)
"""


@pytest.mark.parametrize("backend", ["cpu:collective,cuda:gloo", "cpu:gloo,cuda:collective"])
def test_a_backend_string_pairing_ours_with_another_is_refused_on_every_rank(backend: str) -> None:
    """torch takes a Python ProcessGroup as the whole group: the other backend would be dropped
    silently (CUDA traffic through host memory where NCCL was asked for)."""
    port = free_port()
    procs = [Proc([sys.executable, "-c", MIXED, backend], torchrun(rank, 2, port)) for rank in range(2)]
    for rank, (proc, code) in enumerate(zip(procs, finish_all(procs, 120), strict=True)):
        said = proc.output()
        assert code == 0 and "REFUSED InvalidArgumentError" in said, f"rank {rank} (exit {code}):\n{said}"
        assert "pairs 'collective' with gloo" in said and "use 'collective' alone" in said, said


def test_every_op_against_a_reference_on_the_world_and_a_subgroup() -> None:
    """3 ranks: all_reduce (every dtype and op, PREMUL_SUM, bool, strided, requires_grad), broadcast,
    reduce, all_gather (list, into a tensor), reduce_scatter (list, tensor), all_to_all (equal,
    uneven, lists), gather, scatter, barrier, isend/irecv and send/recv, async work with futures,
    the object collectives and errors; then the same on the subgroup [0, 2]."""
    run_job(3, "ops")


def test_groups_of_the_same_ranks_receives_splits_in_place_forms_and_subgroup_timeouts() -> None:
    """3 ranks: async calls on two groups of the same ranks keep their own values; a pending irecv
    holds up no receive from another rank; a coalesced call's first error reaches its work; split
    sizes are checked; all_gather_into_tensor / reduce_scatter_tensor in place; futures' values;
    a subgroup's timeout is its collectives'."""
    run_job(3, "mends")


def test_ddp_trains_exactly_as_under_gloo(tmp_path: Path) -> None:
    """The same seeded models, 2 ranks: plain DDP (30 steps, both models), no_sync accumulation and
    the fp16 compression hook; final parameters equal gloo's within float32 rounding."""
    results: dict[str, list[dict[str, Any]]] = {}
    for name in ("collective", "gloo"):
        run_job(2, "ddp", name, str(tmp_path / name))
        results[name] = [torch.load(tmp_path / f"{name}.{rank}") for rank in range(2)]
    for scenario, ours in results["collective"][0].items():
        theirs = results["gloo"][0][scenario]
        assert ours.shape == theirs.shape and ours.numel() > 1000
        assert float((ours - theirs).abs().max()) <= 1e-5, scenario
        assert torch.equal(ours, results["collective"][1][scenario]), f"{scenario}: ranks differ"


def test_fsdp_trains_exactly_as_under_gloo() -> None:
    """FSDP2 (fully_shard, per layer and the whole model), 2 ranks: the same parameters, bit for
    bit, on a mesh of our group as on one of gloo's."""
    run_job(2, "fsdp")


def test_ddp_with_sparse_gradients_trains_as_under_gloo() -> None:
    """nn.Embedding(sparse=True): its COO gradients all_reduce (summed, as gloo's) and DDP trains."""
    run_job(2, "sparse")


@pytest.mark.parametrize("shm", ["1", "0"])
def test_an_all_reduce_repeated_on_the_same_tensor_runs_its_kept_call(shm: str) -> None:
    """2 ranks, through shared memory and over TCP: a tensor all-reduced again and again (new
    contents, three ops, async too) is kept once per op; a rank that keeps its tensor meets one
    that does not; a tensor whose memory moved or is read as another dtype or shape is not the
    kept call's, also when it moves while its async call waits in the queue; a mismatch fails both
    ranks and the group goes on; a kept call keeps no tensor alive; COLLECTIVE_TORCH_REPEAT=0 turns
    it off."""
    run_job(2, "repeats", COLLECTIVE_SHM=shm)


def test_pipeline_parallel_schedules_train_as_one_process_does() -> None:
    """torch.distributed.pipelining (1F1B, GPipe; stages by hand and the pipeline() frontend, which
    sends a 0-d tensor into a (1,) buffer as it warms up) on 2 ranks of ours."""
    run_job(2, "pipelines")


def test_a_killed_rank_is_an_error_on_every_other_rank_within_seconds() -> None:
    port = free_port()
    procs = [Proc([sys.executable, WORKER, "kill"], torchrun(rank, 3, port)) for rank in range(3)]
    codes = finish_all(procs, 120)
    assert codes[2] == -9, procs[2].output()
    for rank in (0, 1):
        assert codes[rank] == 0, procs[rank].output()
        _, line = procs[rank].wait_for("RAISED ", 1)
        seconds = float(line.split()[1])
        assert seconds < 8, line
        assert "PeerLostError" in line and "peer 2" in line, line


def test_init_process_group_reuses_the_peer_of_col_init_under_torchruns_agent() -> None:
    """torchrun's agent serves the store on MASTER_PORT; col.init() meets there, and then
    init_process_group("collective") uses that peer instead of joining again."""
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    procs = [
        Proc([sys.executable, WORKER, "reuse"], torchrun(rank, 2, port, TORCHELASTIC_USE_AGENT_STORE="True"))
        for rank in range(2)
    ]
    for rank, (proc, code) in enumerate(zip(procs, finish_all(procs, 120), strict=True)):
        assert code == 0 and f"OK {rank}" in proc.output(), proc.output()
    del agent


# -- the pieces, in process -----------------------------------------------------------------------


def test_importing_the_module_registers_the_backend() -> None:
    assert dist.is_backend_available("collective")
    assert "collective" in dist.Backend.backend_list
    assert backend.BACKEND == "collective"


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
    ],
    ids=str,
)
def test_array_views_a_tensors_memory(dtype: Any) -> None:
    tensor = (torch.arange(12) % 3).to(dtype).reshape(3, 4)
    view = array(tensor)
    assert view.shape == (3, 4) and view.ctypes.data == tensor.data_ptr()
    expected = tensor.view(torch.uint8) if dtype == torch.bool else tensor
    if dtype == torch.bfloat16:
        np.testing.assert_array_equal(view.astype(np.float32), expected.float().numpy())
    else:
        np.testing.assert_array_equal(view, expected.numpy())
    view[...] = view[::-1].copy()  # writes land in the tensor
    assert torch.equal(tensor, (torch.arange(12) % 3).to(dtype).reshape(3, 4).flip(0))


def test_array_of_special_tensors() -> None:
    leaf = torch.ones(3, requires_grad=True)
    array(leaf)[0] = 5.0
    assert leaf.tolist() == [5.0, 1.0, 1.0] and leaf.requires_grad
    conj = torch.tensor([1 + 2j]).conj()  # a lazily conjugated view: resolved, not read raw
    np.testing.assert_array_equal(array(conj), [1 - 2j])
    assert array(torch.empty(0)).shape == (0,) and array(torch.tensor(2.5)).shape == ()


def test_host_and_fill_handle_strided_tensors() -> None:
    grid = torch.zeros(4, 3)
    column = grid[:, 1]
    assert host(column) is not column and host(column).is_contiguous()
    assert host(grid) is grid
    fill(column, np.arange(4, dtype=np.float32))
    assert grid[:, 1].tolist() == [0, 1, 2, 3] and grid[:, 0].tolist() == [0] * 4
    flags = torch.zeros(3, dtype=torch.bool)[::2]
    fill(flags, np.array([1, 0], np.uint8))
    assert flags.tolist() == [True, False]
    bf = torch.zeros(2, dtype=torch.bfloat16)
    fill(bf, array(torch.tensor([1.5, -2.0], dtype=torch.bfloat16)))
    assert bf.tolist() == [1.5, -2.0]


def test_our_errors_become_dist_backend_errors_with_our_message_and_cause() -> None:
    ours = PeerLostError("node 2 (peer 2) stopped sending heartbeats (2s)", [2])
    error = backend_error(ours)
    assert isinstance(error, dist.DistBackendError) and isinstance(error, RuntimeError)
    assert str(error) == "PeerLostError: node 2 (peer 2) stopped sending heartbeats (2s)"
    assert error.__cause__ is ours
    bug = KeyError("x")
    assert backend_error(bug) is bug  # not ours: as it is


def test_torch_work_success_failure_and_futures() -> None:
    tensor = torch.ones(2)
    work = TorchWork([tensor], "all_reduce")
    assert not work.is_completed()
    doubled = work.get_future().then(lambda fut: fut.value()[0] * 2)
    with pytest.raises(dist.DistBackendError, match=r"did not complete within 0\.05s"):
        work.wait(timeout=0.05)
    work.run(lambda: tensor.add_(1))
    assert work.wait() and work.is_completed() and work.is_success() and work.exception() is None
    assert work.get_future().value()[0] is tensor and doubled.wait().tolist() == [4.0, 4.0]
    assert work.result() == [tensor]

    failed = TorchWork([tensor], "all_reduce")

    def mismatch() -> None:
        raise MismatchError("peer 0 called all_reduce with shape (3,); peer 1 with (4,)")

    failed.run(mismatch)
    assert failed.is_completed() and not failed.is_success()
    with pytest.raises(dist.DistBackendError, match="MismatchError: peer 0 called") as caught:
        failed.wait()
    assert isinstance(caught.value.__cause__, MismatchError)
    with pytest.raises(RuntimeError, match="MismatchError: peer 0 called"):
        failed.get_future().wait()  # failed in torch's C++ too (what DDP's reducer sees)


def test_a_receive_waited_on_from_a_callback_of_the_one_before_runs_at_once() -> None:
    """A callback of a receive's future (run by the thread that runs the pair's receives) waits
    on the pair's next receive: it runs there and then (it waited forever: the pair was busy)."""
    from collective.torch.work import Receives

    receives, ran = Receives("test"), []
    drives: dict[str, Any] = {}

    def first_then_its_callback() -> None:
        ran.append("first")
        drives["second"](True)  # (what the second's work.wait() does)
        ran.append("callback done")

    first = receives.submit((1, 0), first_then_its_callback)
    drives["second"] = receives.submit((1, 0), lambda: ran.append("second"))
    started = threading.active_count()
    first(True)
    assert ran == ["first", "second", "callback done"]
    assert threading.active_count() == started and not receives._queues and not receives._runners


def test_wait_returns_once_the_future_is_complete_and_a_callback_may_wait() -> None:
    """wait() returned while the future was still completing: value() then raised torch's internal
    assert (16 to 193 times in 300 async calls)."""
    tensor = torch.ones(1)
    for _ in range(300):
        work = TorchWork([tensor], "all_reduce")
        waited: list[bool] = []
        work.get_future().then(lambda _, w=work, into=waited: into.append(w.wait()))  # as it completes
        worker = threading.Thread(target=work.run, args=(lambda: None,))
        worker.start()
        assert work.wait(timeout=10) and work.get_future().done()
        assert work.get_future().value() == [tensor]
        worker.join(10)
        assert waited == [True]


# -- the benchmarks ---------------------------------------------------------------------------------


def _bench(module: str, *argv: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", f"collective.bench.torch_backend.{module}", *argv],
        capture_output=True,
        text=True,
        timeout=150,
        env=CLEAN,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_bench_torch_calls_times_round_trips_and_all_reduce_beside_gloo() -> None:
    out = _bench(
        "calls",
        "--op",
        "pingpong",
        "--op",
        "all_reduce",
        "--dtype",
        "bfloat16",
        "--sizes",
        "8,4096",
        "--rounds",
        "2",
        "--iters",
        "20",
    )
    out += _bench(
        "calls", "--op", "pingpong", "--op", "decode", "--rounds", "1", "--iters", "3", "--sizes", "8"
    )
    kinds = (["pingpong"], ["all_reduce"], ["decode"])
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in kinds]
    assert [row[:3] for row in rows] == [
        ["pingpong", "bfloat16", "8"],
        ["pingpong", "bfloat16", "4096"],
        ["all_reduce", "bfloat16", "8"],
        ["all_reduce", "bfloat16", "4096"],
        ["pingpong", "float32", "8"],
        ["decode", "float32", "8"],
    ], out
    assert all(float(row[3]) > 0 and float(row[4]) > 0 and float(row[5]) > 0 for row in rows), out


def test_bench_torch_pipeline_times_both_schedules_beside_gloo_with_the_same_parameters() -> None:
    out = _bench("pipeline", "--rounds", "1", "--microbatches", "2", "--width", "8")
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["1F1B"], ["GPipe"])}
    assert sorted(rows) == ["1F1B", "GPipe"], out
    assert not any("DIFFER" in row or "nan" in row for row in rows.values()), out


def test_bench_backend_torch_times_ours_beside_gloo(capsys: pytest.CaptureFixture[str]) -> None:
    from collective.bench import cli as bench_cli

    argv = [
        "--backend",
        "torch",
        "--op",
        "all_reduce",
        "--nodes",
        "2",
        "-b",
        "8",
        "-e",
        "64",
        "-f",
        "8",
        "-w",
        "1",
        "-n",
        "3",
    ]
    parser = bench_cli.argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    status = bench_cli.run(parser.parse_args(argv), parser, argv, sys.stdout)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "# all_reduce  torch.distributed gloo  peers=2" in out
    assert "# all_reduce  torch.distributed backend collective  peers=2" in out and "speedup vs gloo" in out
    assert "4 rows" in out and "wrong elements: 0" in out


def test_ddp_step_bench_compares_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    from collective.bench import ddp_step

    assert ddp_step.main(["--rounds", "1", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    for name in ddp_step.MODELS:
        line = next(line for line in out.splitlines() if line.strip().startswith(name))
        assert float(line.split()[-1]) <= 1e-5, line  # the largest parameter difference to gloo


def test_a_timeout_says_timed_out_in_the_words_torch_tests_match() -> None:
    """torch's distributed tests match a barrier's timeout with " (Timed out|closed|timeout) "."""
    import re

    from collective.errors import CollectiveTimeout

    error = backend_error(CollectiveTimeout("barrier #3: peers waited 1s for peer 1 to call it", [1]))
    assert str(error) == "CollectiveTimeout: Timed out - barrier #3: peers waited 1s for peer 1 to call it"
    assert re.search(" (Timed out|closed|timeout) ", str(error))


def test_coalesced_wrappers_go_on_after_an_argument_error_and_stop_at_a_timeout() -> None:
    """A refused or mismatched step failed on every rank: the list's next steps are issued (the
    others issue theirs). A timeout or a lost peer ends the list at once: it waited one timeout
    per remaining tensor."""
    from collective.errors import CollectiveTimeout, InvalidArgumentError
    from collective.torch.ops import _each

    for cause, issued in (
        (InvalidArgumentError("bad"), 3),
        (MismatchError("differ"), 3),
        (CollectiveTimeout("late", [2]), 1),
        (PeerLostError("gone", [2]), 1),
    ):
        calls: list[int] = []

        def call(index: int, cause: Exception = cause, calls: list[int] = calls) -> Any:
            calls.append(index)
            if index == 0:
                raise backend_error(cause)
            return index

        with pytest.raises(dist.DistBackendError) as raised:
            _each([lambda i=i: call(i) for i in range(3)])
        assert raised.value.__cause__ is cause and calls == list(range(issued)), (cause, calls)
