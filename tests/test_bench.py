"""`collective bench` and `collective demo`: output, JSON, wrong-result detection, bad arguments."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from collective.algorithms.ops import ReduceOp
from collective.bench import cli as bench_cli
from collective.bench.report import parse_size
from collective.bench.sweep import busbw_factor
from collective.bench.trivial import BareAllReduce, TrivialGroup
from collective.runtime import Runtime
from tests.conftest import run_cli, run_peers, wait_until
from tests.processes import interruptible, met_in_shared_memory


def test_tiny_sweep_prints_nccl_tables_and_a_summary(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_json = tmp_path / "rows.json"
    argv = [
        "bench",
        "--peers",
        "3",
        "-b",
        "8",
        "-e",
        "128K",
        "-f",
        "128",
        "-w",
        "1",
        "-n",
        "3",
        "--root",
        "all",
        "--compare",
        "trivial",
        "--json",
        str(out_json),
        "--op",
        "all_reduce",
        "--op",
        "reduce",
        "--op",
        "broadcast",
    ]
    status, out, _ = run_cli(argv, capsys)
    assert status == 0, out
    for op in ("all_reduce", "reduce", "broadcast"):
        for strategy in ("auto", "centralized", "tree:2", "ring", "direct"):
            assert f"# {op}  strategy {strategy}  peers=3  dtype=float32" in out
        assert f"# {op}  trivial baseline" in out
        assert f"#   {op}: 8 B .. 128 KiB: fast path (any strategy)" in out
    assert (
        "size (B)       count      type  redop  root   time (us)  algbw (GB/s)  busbw (GB/s)  #wrong" in out
    )
    assert "speedup vs trivial" in out
    record = json.loads(out_json.read_text())
    assert record["command"][:2] == ["collective", "bench"] and record["machine"]["cpus"] >= 1
    assert {"python", "numpy", "pyzmq", "collective"} <= set(record["machine"])
    rows = record["rows"]
    # 3 sizes; all_reduce has one row per size, reduce and broadcast one per root; 6 systems
    assert len(rows) == 6 * (3 + 3 * 3 + 3 * 3)
    picked = {row["picked"] for row in rows if row["strategy"] == "auto"}  # (what auto ran, by path)
    assert picked == {"fused", "shared"} and all(
        row["picked"] == "" for row in rows if row["strategy"] != "auto"
    )
    for row in rows:
        assert row["wrong"] == 0 and row["count"] == row["size"] // 4
        assert row["algbw"] == pytest.approx(row["size"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw"] == pytest.approx(row["algbw"] * busbw_factor(row["op"], 3))
    assert (
        busbw_factor("all_reduce", 4) == 1.5
        and busbw_factor("reduce", 4) == busbw_factor("broadcast", 4) == 1
    )


def test_a_wrong_result_is_counted_and_fails_the_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Runtime.all_reduce

    def corrupt(self: Runtime, peer_id: int, x: Any, op: Any = "sum", *, out: Any = None) -> Any:
        result = real(self, peer_id, x, op, out=out)
        if peer_id == 1:
            result.reshape(-1)[0] += 1
        return result

    monkeypatch.setattr(Runtime, "all_reduce", corrupt)
    status, out, err = run_cli(
        ["bench", "--op", "all_reduce", "--strategy", "ring", "-b", "64", "-e", "64", "-w", "0", "-n", "4"],
        capsys,
    )
    assert status == 1
    row = next(line for line in out.splitlines() if line.strip().startswith("64 "))
    assert row.split()[-1] == "4"  # one wrong element per timed iteration
    assert "wrong result elements" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--op", "allgather"], "argument --op: unknown op 'allgather'"),
        (["-b", "16M", "-e", "8"], "argument -b/--minbytes: 16777216 is larger than -e/--maxbytes 8"),
        (["--strategy", "tree:0"], "argument --strategy: Tree arity must be an integer >= 1, got 0"),
        (["--strategy", "spiral"], "argument --strategy: unknown strategy 'spiral'"),
        (["-b", "12Q"], "argument -b/--minbytes: invalid size '12Q'"),
        (["--root", "4"], "argument --root: must be a peer id in 0..3 or 'all'"),
        (["-f", "1"], "argument -f/--stepfactor: must be an integer >= 2"),
        (["--peers", "0"], "argument --peers: must be an integer >= 1"),
        (["--timeout", "-1"], "argument --timeout: must be a finite number of seconds > 0"),
        (["--timeout", "nan"], "argument --timeout: must be a finite number of seconds > 0"),
        (["--backend", "torch", "--strategy", "ring"], "--peers, --strategy, --alloc and --compare trivial"),
        (["--backend", "torch", "--alloc"], "--peers, --strategy, --alloc and --compare trivial"),
        (["--backend", "torch", "--peers", "4"], "--peers, --strategy, --alloc and --compare trivial"),
        (
            ["--op", "all_gather", "--compare", "trivial"],
            "the trivial baseline has all_reduce, reduce, broadcast",
        ),
        (["--op", "sendrecv", "--peers", "1"], "argument --op: sendrecv needs at least 2 peers"),
        (["--json", "/nonexistent-folder/rows.json"], "argument --json: no directory /nonexistent-folder"),
        (["--json", "."], "argument --json: . is a directory: name a file"),  # (not after the sweep)
        (["--plot", "/nonexistent-folder/p.png"], "argument --plot: no directory /nonexistent-folder"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, _, err = run_cli(["bench", *argv], capsys)
    assert status == 2
    assert message in err


def test_sizes_parse_like_nccl_tests() -> None:
    assert [parse_size(t) for t in ("8", "1K", "64M", "1G", "2kb")] == [8, 1024, 64 << 20, 1 << 30, 2048]
    with pytest.raises(ValueError, match="invalid size"):
        parse_size("M")


def test_default_sweep_plan_covers_8_bytes_to_16_mebibytes() -> None:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    args = parser.parse_args([])
    sizes = bench_cli.sweep_sizes(args, 4)
    assert sizes[0] == 8 and sizes[-1] == 16 << 20


def test_demo_and_version_from_a_real_process() -> None:
    demo = subprocess.run(
        [sys.executable, "-m", "collective", "demo", "--peers", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert demo.returncode == 0, demo.stderr
    assert demo.stdout.count("every peer got [ 0.  6. 12. 18.]") == 4  # centralized, tree, ring, direct
    assert "direct: peer 0 sent" in demo.stdout
    version = subprocess.run(
        [sys.executable, "-m", "collective", "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0 and version.stdout.startswith("collective ")
    missing = subprocess.run([sys.executable, "-m", "collective"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "required" in missing.stderr


def test_trivial_baseline_matches_numpy() -> None:
    group = TrivialGroup(3, 10, np.float64)
    xs = [np.arange(10.0) * (p + 1) for p in range(3)]
    outs = [np.empty(10) for _ in range(3)]
    run_peers(3, lambda p: group.all_reduce(p, xs[p], outs[p], ReduceOp.SUM))
    for out in outs:
        np.testing.assert_array_equal(out, sum(xs))


def test_a_tiny_sweep_across_two_nodes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "nodes.json"
    argv = [
        "bench",
        "--nodes",
        "2",
        "--peers",
        "2",
        "-b",
        "8",
        "-e",
        "1M",
        "-f",
        "131072",
        "-w",
        "1",
        "-n",
        "3",
        "--strategy",
        "ring",
        "--strategy",
        "tree:2",
        "--json",
        str(out_json),
        "--op",
        "all_reduce",
        "--op",
        "reduce",
        "--op",
        "broadcast",
    ]
    status, out, _ = run_cli(argv, capsys)
    assert status == 0, out
    assert "# collective bench: 2 nodes x 2 local peers" in out
    assert "# all_reduce  strategy ring  peers=4" in out and "# broadcast  strategy tree:2  peers=4" in out
    rows = json.loads(out_json.read_text())["rows"]
    assert len(rows) == 2 * 3 * 2  # 2 strategies x 3 ops x 2 sizes (root 0)
    for row in rows:
        assert row["wrong"] == 0 and row["peers"] == 4
        assert row["busbw"] == pytest.approx(row["algbw"] * busbw_factor(row["op"], 4))


def test_plot_is_written(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # part of the test extra; the message without it is tested below
    png = tmp_path / "sweep.png"
    status, out, _ = run_cli(
        ["bench", "-b", "8", "-e", "1K", "-f", "32", "-w", "0", "-n", "2", "--plot", str(png)], capsys
    )
    assert status == 0 and f"# plot written to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_optional_packages_are_clear_errors(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(bench_cli, "torch_available", lambda: False)
    status, _, err = run_cli(["bench", "--compare", "gloo"], capsys)
    assert status == 2 and "gloo needs torch (pip install torch==2.13.0" in err
    real_find_spec = bench_cli.importlib.util.find_spec
    monkeypatch.setattr(
        bench_cli.importlib.util,
        "find_spec",
        lambda name: None if name == "matplotlib" else real_find_spec(name),
    )
    status, _, err = run_cli(["bench", "--plot", str(tmp_path / "x.png")], capsys)
    assert status == 2 and "--plot needs matplotlib" in err
    status, _, err = run_cli(["bench", "--nodes", "2", "--compare", "trivial"], capsys)
    assert status == 2 and "the trivial baseline runs in one process" in err


def test_gloo_comparison_when_torch_is_installed(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip(
        "torch"
    )  # an optional extra (several hundred MB); the message without it is tested above
    argv = [
        "bench",
        "--op",
        "all_reduce",
        "--strategy",
        "ring",
        "--nodes",
        "2",
        "--peers",
        "1",
        "-b",
        "8",
        "-e",
        "8",
        "-w",
        "1",
        "-n",
        "3",
        "--compare",
        "gloo",
    ]
    status, out, _ = run_cli(argv, capsys)
    assert status == 0, out
    assert "# all_reduce  torch.distributed gloo  peers=2" in out and "speedup vs gloo" in out


def test_progress_bar_only_on_a_terminal() -> None:
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    shown, hidden = Terminal(), io.StringIO()
    for stream in (shown, hidden):
        progress = bench_cli.Progress(4, stream)
        progress.step("all_reduce ring 8 B")
        progress.step("all_reduce ring 32 B")
        progress.close()
    assert "[#######.......................] 1/4 all_reduce ring 32 B" in shown.getvalue()
    assert hidden.getvalue() == ""


def test_ctrl_c_prints_what_was_measured_and_exits_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = bench_cli.run_case
    calls = []

    def interrupted_on_the_third(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_cli, "run_case", interrupted_on_the_third)
    argv = [
        "bench",
        "--op",
        "all_reduce",
        "--strategy",
        "ring",
        "-b",
        "8",
        "-e",
        "8K",
        "-f",
        "4",
        "-w",
        "0",
        "-n",
        "2",
    ]
    status, out, _ = run_cli(argv, capsys)
    assert status == 130
    assert "# interrupted: the rows above are what was measured" in out
    assert "# 2 rows in" in out


@pytest.mark.parametrize("nodes", [1, 2])
def test_every_op_is_measured_and_checked(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, nodes: int
) -> None:
    """Every op of the collective set, in one process and across nodes: right results, right factors."""
    from collective.bench.ops import OPS

    out_json = tmp_path / "ops.json"
    argv = [
        "bench",
        "--op",
        "all",
        "--nodes",
        str(nodes),
        "--peers",
        str(4 // nodes),
        "-b",
        "64",
        "-e",
        "512K",
        "-f",
        "8192",
        "-w",
        "1",
        "-n",
        "2",
        "--strategy",
        "ring",
        "--root",
        "all",
        "--json",
        str(out_json),
    ]
    status, out, _ = run_cli(argv, capsys)
    assert status == 0, out
    rows = json.loads(out_json.read_text())["rows"]
    assert {row["op"] for row in rows} == set(OPS)
    for row in rows:
        assert row["wrong"] == 0, row
        assert row["busbw"] == pytest.approx(row["algbw"] * busbw_factor(row["op"], 4))
    assert busbw_factor("all_gather", 4) == busbw_factor("reduce_scatter", 4) == 0.75
    assert busbw_factor("gather", 4) == busbw_factor("sendrecv", 4) == 1
    gathers = [row for row in rows if row["op"] == "gather" and row["size"] == 512 << 10]
    assert sorted(row["root"] for row in gathers) == [0, 1, 2, 3]


def test_sigterm_while_the_results_are_written_is_exit_143(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside the sweep the stop was a traceback and exit 1 ('wrong results')."""

    def write_json(*_: Any) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # (kept: where the signal lands, not an order) the handler raises here

    monkeypatch.setattr(bench_cli, "write_json", write_json)
    argv = [
        "bench",
        "--op",
        "all_reduce",
        "--peers",
        "2",
        "-b",
        "8",
        "-e",
        "8",
        "-w",
        "1",
        "-n",
        "2",
        "--json",
        str(tmp_path / "rows.json"),
    ]
    status, _, err = run_cli(argv, capsys)
    assert status == 143 and "stopped by signal 15" in err, err


def test_every_op_of_one_peer_is_every_op_but_sendrecv(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--op all --peers 1 was refused: 'sendrecv needs at least 2 peers'."""
    from collective.bench.ops import OPS

    out_json = tmp_path / "one.json"
    argv = [
        "bench",
        "--op",
        "all",
        "--peers",
        "1",
        "-b",
        "64",
        "-e",
        "64",
        "-w",
        "1",
        "-n",
        "2",
        "--strategy",
        "ring",
        "--json",
        str(out_json),
    ]
    status, out, _ = run_cli(argv, capsys)
    assert status == 0, out
    assert {row["op"] for row in json.loads(out_json.read_text())["rows"]} == set(OPS) - {"sendrecv"}


def test_every_op_against_gloo(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out_json = tmp_path / "gloo.json"
    argv = [
        "bench",
        "--op",
        "all",
        "--nodes",
        "2",
        "--peers",
        "1",
        "-b",
        "1K",
        "-e",
        "1K",
        "-w",
        "1",
        "-n",
        "2",
        "--strategy",
        "ring",
        "--compare",
        "gloo",
        "--json",
        str(out_json),
    ]
    status, out, _ = run_cli(argv, capsys)
    assert status == 0, out
    rows = json.loads(out_json.read_text())["rows"]
    gloo = {row["op"] for row in rows if row["system"] == "gloo"}
    assert gloo == {row["op"] for row in rows if row["system"] == "collective"}
    assert all(row["wrong"] == 0 for row in rows)


def test_shm_vs_gloo_runs_ours_anew_and_persistent_over_processes_and_checks_every_result(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from collective.bench import shm_vs_gloo

    argv = [
        "--worlds",
        "2",
        "--ops",
        "all_reduce,all_gather,reduce_scatter,broadcast,decode",
        "--sizes",
        "8,200K",
        "--systems",
        "ours,anew,persistent",
        "--repeats",
        "1",
        "--budget",
        "0.02",
    ]
    assert shm_vs_gloo.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if not line.startswith("#")][1:]
    assert len(rows) == 10 and all(row[0] == "2" and min(map(float, row[4:10:2])) > 0 for row in rows), out
    assert "# decode, 2 procs, 8 B per all_reduce: tokens/s ours " in out and ", anew " in out
    assert "# target 2 procs all_reduce 8 B: persistent time <= 5 us: " in out  # (its own targets)
    assert "# target 2 procs all_reduce 8 B: normal call time <= 12 us: " in out
    assert "# wrong result elements: 0" in out


def test_coalesced_bench_times_three_variants_and_checks_the_result(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from collective.bench import coalesced

    assert coalesced.main(["--rounds", "1", "--iters", "3"]) == 0
    out = capsys.readouterr().out
    (row,) = [line.split() for line in out.splitlines() if line.strip().startswith("0 ")]
    assert all(float(value) > 0 for value in row[1:4]), out
    assert "# target coalesced <= 1.2 x one array:" in out and "# target coalesced <= 0.3 x separate:" in out


def test_host_tier_bench_times_the_tier_beside_the_flat_path(capsys: pytest.CaptureFixture[str]) -> None:
    from collective.bench.studies import host_tier

    argv = ["--hosts", "aab", "--ops", "all_reduce", "--sizes", "8", "--repeats", "1", "--budget", "0.05"]
    assert host_tier.main(argv) == 0
    out = capsys.readouterr().out
    (row,) = [line.split() for line in out.splitlines() if line.strip().startswith("all_reduce")]
    assert float(row[3]) > 0 and float(row[5]) > 0 and row[-1].endswith("x"), out  # tier, flat, a ratio
    assert "# wrong result elements: 0" in out


def test_keeping_study_times_calls_on_the_same_and_on_new_arrays(capsys: pytest.CaptureFixture[str]) -> None:
    from collective.bench.studies import keeping

    assert keeping.main(["--rounds", "1", "--calls", "50"]) == 0
    out = capsys.readouterr().out
    rows = {line.split(":")[0].strip(): line.split() for line in out.splitlines() if "on - off " in line}
    assert set(rows) == {"same", "fresh"}, out
    assert all(float(row[2]) > 0 and float(row[4]) > 0 for row in rows.values()), out


def test_trace_overhead_study_times_the_recorder_on_off_and_its_least(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from collective.bench.studies import trace_overhead
    from collective.trace import RECORDER

    size = RECORDER.size
    assert trace_overhead.main(["--rounds", "1", "--calls", "30"]) == 0
    assert RECORDER.size == size  # (switched back on as it was)
    out = capsys.readouterr().out
    rows = {
        line.split(":")[0].split("B")[1].strip(): line.split()
        for line in out.splitlines()
        if "on/off" in line
    }
    assert set(rows) == {"4 threads", "2 processes"}, out
    for row in rows.values():
        figures = dict(zip(row[-10::2], row[-9::2], strict=True))
        assert {"on", "off", "least", "on/off", "least/off"} == set(figures), out
        assert all(float(value) > 0 for value in figures.values()), out


def test_thread_floor_bench_times_the_floor_the_baseline_and_ours(capsys: pytest.CaptureFixture[str]) -> None:
    from collective.bench.studies import thread_floor

    assert thread_floor.main(["--peers", "2", "--calls", "50", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line.split()[:1] in (["floor"], ["recorded"], ["trivial"], ["ours"])
    }
    assert set(rows) == {"floor", "recorded", "trivial", "ours"}, out
    assert all(float(wall) > 0 and float(cpu) > 0 for wall, cpu, _, _ in rows.values()), out


def test_a_zero_minimum_size_sweeps_once_from_empty() -> None:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    assert bench_cli.sweep_sizes(parser.parse_args(["-b", "0", "-e", "16"]), 4) == [0, 4, 8, 16]
    assert bench_cli.sweep_sizes(parser.parse_args(["-b", "0", "-e", "0"]), 4) == [0]


def test_ops_that_split_into_blocks_report_the_bytes_they_move(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """4 peers, float32: 24 B cannot give each peer two elements, 100 B is 25 elements (24 move)."""
    out_json = tmp_path / "rows.json"
    argv = [
        "bench",
        "--op",
        "all_gather",
        "--op",
        "all_reduce",
        "--strategy",
        "ring",
        "-b",
        "25",
        "-e",
        "200",
        "-f",
        "4",
        "-w",
        "0",
        "-n",
        "1",
        "--json",
        str(out_json),
    ]
    status, out, _ = run_cli(argv, capsys)
    assert status == 0, out
    rows = json.loads(out_json.read_text())["rows"]
    moved = {
        op: [(r["size"], r["count"]) for r in rows if r["op"] == op] for op in ("all_gather", "all_reduce")
    }
    assert moved["all_gather"] == [(16, 4), (96, 24)]  # whole elements per peer, one at least
    assert moved["all_reduce"] == [(24, 6), (100, 25)]
    assert all(r["algbw"] > 0 for r in rows)


def test_a_plot_of_empty_rows_only_is_no_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, out, _ = run_cli(
        [
            "bench",
            "--op",
            "all_reduce",
            "--strategy",
            "ring",
            "-b",
            "0",
            "-e",
            "0",
            "-w",
            "0",
            "-n",
            "1",
            "--plot",
            str(tmp_path / "p.png"),
        ],
        capsys,
    )
    assert status == 0 and "plot written" in out


def test_groups_bench_times_our_groups_and_the_bare_least_side_by_side() -> None:
    from collective.bench import groups_async

    bare = BareAllReduce(3)
    got = run_peers(3, lambda p: [bare.all_reduce(p, np.full(2, p + 1.0)).tolist() for _ in range(3)])
    assert got == [[[6.0, 6.0]] * 3] * 3  # the bare step is a real all_reduce, call after call
    for concurrent, lone in (groups_async.groups(20), groups_async.bare_groups(20)):
        assert 0 < concurrent < 1e6 and 0 < lone < 1e6


def test_thousands_of_cases_reach_the_node_processes() -> None:
    """The plan went on the command line: past 128 KiB (about 1000 cases, e.g. `--op all` with every
    strategy and size) starting the nodes failed with "Argument list too long"."""
    from collective.bench.jobs.multinode import run_nodes
    from collective.bench.sweep import Case

    cases = [Case("collective", "barrier", "ring", 1, 8 + i, "float32", "sum", 0) for i in range(1200)]
    rows = run_nodes(cases, 2, 1, 0, 1, 30)
    assert [row.case for row in rows] == cases and not any(row.wrong for row in rows)


def test_vs_reference_times_the_baseline_ours_and_the_bare_least_in_the_reference_harness(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from collective.bench import vs_reference

    reference = Path(__file__).resolve().parents[2] / "shared" / "reference-bench"
    if not (reference / "_common.py").is_file():
        pytest.skip("../shared/reference-bench is not beside the repository")
    argv = [
        "--reference-dir",
        str(reference),
        "--peers",
        "2",
        "--sizes",
        "8",
        "--repeats",
        "1",
        "--budget",
        "0.01",
    ]
    assert vs_reference.main(argv) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    rows = {words[1]: float(words[2]) for words in lines if words[:1] == ["8B"]}
    ours = {f"{strategy}{alloc}" for strategy in vs_reference.STRATEGIES for alloc in ("", "+alloc")}
    assert set(rows) == {"trivial", "bare", *ours}
    assert all(0 < time < 1e6 for time in rows.values())
    assert "# target 8B: best time (new result per call) <= 0.5 x trivial" in out


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    found.append(int(entry))
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_bench_of_nodes_stopped_by_a_signal_stops_its_processes_and_their_shared_memory(
    signum: int,
) -> None:
    """SIGTERM killed the bench at once: its orchestrator and nodes ran on (parent 1), still
    benchmarking; Ctrl-C left the nodes' shared-memory segments (they got SIGTERM, which skips
    their clean-up)."""
    argv = [
        sys.executable,
        "-m",
        "collective",
        "bench",
        "--nodes",
        "2",
        "--peers",
        "1",
        "--op",
        "all_reduce",
        "-b",
        "64M",
        "-e",
        "64M",
        "-w",
        "1",
        "-n",
        "100000",
        "--timeout",
        "60",
    ]
    bench = subprocess.Popen(  # (Ctrl-C reaches it even where this test's own SIGINT is ignored)
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible
    )
    started: list[int] = []

    def segments() -> list[str]:
        return [
            name
            for name in os.listdir("/dev/shm")
            if any(name.startswith(f"collective-{pid}-") for pid in started)
        ]

    def in_their_loop() -> bool:
        """Both nodes made their segments and mapped the other's: their first collective ran."""
        nodes = {int(name.split("-")[1]) for name in segments()}
        return len(nodes) == 2 and met_in_shared_memory(nodes)

    def running() -> list[int]:
        return [pid for pid in started if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)]

    try:
        wait_until(lambda: len(_children(bench.pid)) >= 3, 30, "the orchestrator and 2 nodes started")
        started = _children(bench.pid)
        assert len(started) == 3, started
        wait_until(in_their_loop, 30, "both nodes in their loop (each has mapped the other's segment)")
        bench.send_signal(signum)
        assert bench.wait(30) == 128 + signum
    finally:
        bench.kill()
        bench.communicate()
        with contextlib.suppress(AssertionError):  # (as long as they were given before: asserted below)
            wait_until(lambda: not running(), 0.5, "the bench's processes ended")
        alive = running()
        for pid in alive:  # (a failed test leaves nothing running)
            os.kill(pid, signal.SIGKILL)
    assert not alive, alive
    left = segments()
    assert not left, left


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return ""
