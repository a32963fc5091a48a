"""The flight recorder (collective.trace): what it records, the dumps it writes on failures, on
SIGUSR1 and on demand, and what `collective trace analyze` and `collective trace chrome` say of them."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collective as col
from collective import cli
from collective.config import CollectiveConfig
from collective.launch import free_port
from collective.runtime import Runtime
from collective.trace import RECORDER
from collective.trace.analyze import analyze, load_dumps
from collective.trace.analyze import main as analyze_main
from collective.trace.chrome import chrome_trace
from collective.transport.orchestrator import HEARTBEAT_INTERVAL
from tests.conftest import outcomes_of_peers, run_cli, run_peers, wait_until
from tests.processes import WORKER, finish_all, start_nodes

HERE = Path(__file__).name


@pytest.fixture
def trace_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "trace"
    monkeypatch.setenv("COLLECTIVE_TRACE_DIR", str(folder))
    return folder


def _joined(runtime: Runtime, n: int = 4, timeout: float = 20.0) -> None:
    config = CollectiveConfig(num_devices=n, timeout=timeout)
    run_peers(n, lambda p: runtime.register(p, "cpu", config), runtime)


def _line_of(text: str, path: str = __file__) -> int:
    return next(i for i, line in enumerate(Path(path).read_text().splitlines(), 1) if text in line)


def test_every_call_is_recorded_with_its_caller(tmp_path: Path) -> None:
    with Runtime(0, 0) as runtime:
        _joined(runtime)
        run_peers(4, lambda p: runtime.all_reduce(p, np.ones(1000), strategy="ring"), runtime)
        run_peers(4, lambda p: runtime.broadcast(p, np.arange(3.0) if p == 1 else None), runtime)
        path = RECORDER.dump(str(tmp_path / "dump.json"))
    document = json.loads(Path(path).read_text())
    assert document["schema"] == "collective-flight-recorder" and document["version"] == 1
    assert document["pid"] == os.getpid() and document["peers"] == [0, 1, 2, 3]
    ring = [e for e in document["entries"] if e["kind"] == "all_reduce" and e["algorithm"] == "ring"][-4:]
    assert sorted(e["peer"] for e in ring) == [0, 1, 2, 3]
    first = ring[0]
    assert first["pg_id"] == "world" and first["op"] == "sum" and first["state"] == "completed"
    assert (
        first["input_sizes"] == [[1000]] and first["input_dtypes"] == ["float64"] and first["bytes"] == 8000
    )
    assert first["path"] == "linked" and first["duration_ms"] > 0
    assert first["frames"][0]["filename"].endswith(HERE)
    assert first["frames"][0]["line"] == _line_of('np.ones(1000), strategy="ring"')
    broadcasts = [e for e in document["entries"] if e["kind"] == "broadcast"][-4:]
    assert {e["collective_seq_id"] for e in broadcasts} == {first["collective_seq_id"] + 1}
    assert all(e["bytes"] == 24 and e["root"] == 1 for e in broadcasts)


def test_stats_count_calls_by_kind_algorithm_and_size() -> None:
    with Runtime(0, 0) as runtime:
        _joined(runtime, 2)
        before = {(r["kind"], r["algorithm"], r["size_class"]): r["calls"] for r in col.stats()}
        for _ in range(3):
            run_peers(2, lambda p: runtime.all_reduce(p, np.ones(100), strategy="centralized"), runtime)
    after = {(r["kind"], r["algorithm"], r["size_class"]): r for r in col.stats()}
    row = after[("all_reduce", "centralized", "<=1KiB")]
    assert row["calls"] - before.get(("all_reduce", "centralized", "<=1KiB"), 0) == 6
    assert sum(row["histogram"].values()) == row["calls"] and row["seconds"] > 0


def test_stats_rows_are_keyed_by_what_the_calls_were_not_by_their_signature_objects() -> None:
    """A batch tallied: one row per kind, algorithm (or path), size class and group, whether the
    calls share one agreed Signature object or each has its own, and one Signature under two
    paths counted apart; failures, times and bytes summed per row."""
    from collective.calls.signature import Signature
    from collective.trace.recorder import Stats

    def signature(count: int) -> Signature:
        return Signature("all_reduce", None, None, (count,), np.dtype(np.float32))

    shared, ring = signature(2), signature(2)

    def entry(
        seq: int, what: Signature | None, path: str, algorithm: str | None, ended: int
    ) -> tuple[Any, ...]:
        group, kind = ((0, 1, 5), "recv") if what is None else ((0, 1), "all_reduce")
        state, error = ("failed", "E") if ended == 301 else ("completed", None)
        return (0, group, seq, kind, None, what, path, algorithm, state, 0, 0, ended, error)

    entries = [
        *[entry(i, shared, "shm", None, 100) for i in range(6)],
        entry(6, shared, "fused", "ring", 301),  # (the same Signature, another key; failed)
        entry(7, signature(2), "shm", None, 100),  # (another Signature, the same key)
        entry(8, ring, "fused", "ring", 299),
        entry(9, signature(300), "shm", None, 100),
        *[entry(i, None, "p2p", None, 50) for i in range(2)],
    ]
    expected = {
        ("all_reduce", "shm", "<=1KiB"): [7, 0, 700, 8 * 7],  # (calls, failed, ns, bytes)
        ("all_reduce", "ring", "<=1KiB"): [2, 1, 600, 8 * 2],
        ("all_reduce", "shm", "<=4KiB"): [1, 0, 100, 1200],
        ("recv", "p2p", "0"): [2, 0, 100, 0],
    }
    repeated = entries[:6] * 10 + [entries[7], entries[9]]  # (one Signature object, mostly)
    for batch, rows in (
        (entries, expected),
        (
            repeated,
            {
                ("all_reduce", "shm", "<=1KiB"): [61, 0, 6100, 8 * 61],
                ("all_reduce", "shm", "<=4KiB"): [1, 0, 100, 1200],
            },
        ),
    ):
        stats = Stats()
        stats.tally(batch)
        found = {
            (r["kind"], r["algorithm"], r["size_class"]): [
                r["calls"],
                r["failed"],
                round(r["seconds"] * 1e9),
                r["bytes"],
            ]
            for r in stats.snapshot((0, 1))
        }
        assert found == rows, found


def test_a_receive_left_open_by_its_job_ends_as_failed_when_the_next_job_begins() -> None:
    """A receive started and never waited for (its handle let go) cannot end once its job is
    over: the next job's ring does not carry it as open, and stats count it as failed."""
    from collective.trace.recorder import Recorder

    recorder = Recorder(8)
    recorder.joined("first", (0, 1), (1,), 1)
    recorder.open_p2p(1, 0, 1, 3, "recv", None)
    assert [entry["state"] for entry in recorder.document("test")["entries"]] == ["started"]
    recorder.joined("second", (0, 1), (1,), 2)
    assert recorder.document("test")["entries"] == []
    rows = recorder.snapshot()
    assert [(row["kind"], row["calls"], row["failed"]) for row in rows] == [("recv", 1, 1)], rows


def test_every_call_of_a_loop_is_counted_past_the_ring() -> None:
    """Once the ring drops the oldest calls, stats still count every one, in its own size class,
    and a dump shows the newest, each with its own number, caller and times."""
    keys = (("all_reduce", "centralized", "<=1KiB"), ("all_reduce", "centralized", "<=4KiB"))

    def counted() -> dict[tuple[str, str, str], int]:
        return {(r["kind"], r["algorithm"], r["size_class"]): r["calls"] for r in col.stats()}

    size = RECORDER.size
    RECORDER.size = 8
    try:
        with Runtime(0, 0) as runtime:
            _joined(runtime, 2)
            before = counted()

            def loop(peer: int) -> None:
                for count in [100] * 20 + [300] * 10:  # 800 B, then 2400 B
                    runtime.all_reduce(peer, np.ones(count), strategy="centralized")

            run_peers(2, loop, runtime)
            document = RECORDER.document("test")
    finally:
        RECORDER.size = size
    assert len(document["entries"]) <= 8
    mine = [entry for entry in document["entries"] if entry["peer"] == 0 and entry["kind"] == "all_reduce"]
    last = mine[-4:]
    assert [entry["collective_seq_id"] for entry in last] == list(
        range(last[0]["collective_seq_id"], last[0]["collective_seq_id"] + 4)
    )
    assert all(entry["input_sizes"] == [[300]] and entry["state"] == "completed" for entry in last)
    assert all(
        entry["frames"][0]["line"] == _line_of('np.ones(count), strategy="centralized")') for entry in last
    )
    assert all(entry["duration_ms"] > 0 and entry["time_discovered_started_ns"] for entry in last)
    after = counted()
    assert [after.get(key, 0) - before.get(key, 0) for key in keys] == [40, 20]


def test_a_peer_that_skips_a_call_is_named_from_the_dump_a_timeout_writes(trace_dir: Path) -> None:
    with Runtime() as runtime:
        _joined(runtime)

        def body(peer: int) -> Any:
            runtime.all_reduce(peer, np.ones(4))
            if peer != 3:
                runtime.all_reduce(peer, np.ones(4), timeout=0.5)  # peer 3 skips this one

        outcomes = outcomes_of_peers(4, body, runtime)
    errors = [o for o in outcomes[:3] if isinstance(o, col.CollectiveTimeout)]
    assert len(errors) == 3, outcomes
    notes = getattr(errors[0], "__notes__", [])
    assert notes[0].startswith("peer 3 is in no call; its last was all_reduce #0 of group world"), notes
    assert str(trace_dir) in notes[1], notes
    out = io.StringIO()
    assert analyze_main(str(trace_dir), out) == 1
    text = out.getvalue()
    assert "peer 3 never entered all_reduce #1 of group world; its last call was all_reduce #0 at " in text
    assert f"{HERE}:{_line_of('runtime.all_reduce(peer, np.ones(4))')}" in text, text


def test_a_mismatch_is_named_as_the_first_disagreeing_call(trace_dir: Path) -> None:
    with Runtime() as runtime:
        _joined(runtime)
        outcomes = outcomes_of_peers(4, lambda p: runtime.all_reduce(p, np.ones(5 if p == 2 else 4)), runtime)
    assert all(isinstance(o, col.MismatchError) for o in outcomes)
    dumps, problems = load_dumps(str(trace_dir))
    assert len(dumps) == 1 and not problems  # (one process: one dump, written once)
    report = analyze(dumps)
    assert len(report.disagreements) == 1, report.lines()
    assert "peers 0, 1, 3 called all_reduce sum [[4]] float64" in report.disagreements[0]
    assert "peer 2 called all_reduce sum [[5]] float64" in report.disagreements[0]


def test_a_straggler_is_named(tmp_path: Path) -> None:
    with Runtime() as runtime:
        _joined(runtime, 3)

        def body(peer: int) -> None:
            for _ in range(5):
                if peer == 2:
                    time.sleep(0.03)  # the condition under test: peer 2 comes late to every call
                runtime.all_reduce(peer, np.ones(4))

        run_peers(3, body, runtime)
        RECORDER.dump(str(tmp_path / "dump.json"))
    report = analyze(load_dumps(str(tmp_path))[0])
    assert [line.split(" of group")[0] for line in report.stragglers] == ["peer 2"], report.lines()


def test_a_few_milliseconds_or_a_few_calls_make_no_straggler() -> None:
    """A busy machine schedules peers milliseconds apart: lateness under the floor, or over fewer
    calls than it takes to tell, is no verdict; the same lateness past the floor over enough
    calls is."""
    from collective.trace.analyze import STRAGGLER_CALLS, STRAGGLER_FLOOR_S, Report, _stragglers

    def named(late_s: float, calls: int) -> list[str]:
        report = Report()
        peers = {
            peer: [
                {"collective_seq_id": seq, "time_created_ns": int((seq + (late_s if peer == 1 else 0)) * 1e9)}
                for seq in range(calls)
            ]
            for peer in (0, 1, 2)
        }
        _stragglers(report, "world", [0, 1, 2], peers)
        return report.stragglers

    assert named(STRAGGLER_FLOOR_S / 2, 10) == []  # (the scheduler's milliseconds)
    assert named(5 * STRAGGLER_FLOOR_S, STRAGGLER_CALLS - 1) == []  # (too few calls to tell)
    found = named(5 * STRAGGLER_FLOOR_S, STRAGGLER_CALLS)
    assert [line.split(" of group")[0] for line in found] == ["peer 1"], found


def test_a_straggler_among_nodes_is_named_from_the_dumps_each_process_writes_at_exit(
    orchestrator: str, tmp_path: Path
) -> None:
    """COLLECTIVE_TRACE_EVERY_JOB=1: every process dumps its calls as it exits; the analysis of
    the three processes' dumps names the slow one."""
    procs = start_nodes(
        orchestrator, "trace-straggle", 3, 1, "straggle", trace_dir=str(tmp_path), trace_every_job=1
    )
    assert finish_all(procs, 60) == [0, 0, 0], [proc.output() for proc in procs]
    dumps, problems = load_dumps(str(tmp_path))
    assert not problems and sorted(peer for dump in dumps for peer in dump.peers) == [0, 1, 2]
    assert {dump.reason for dump in dumps} == {"exit"}
    report = analyze(dumps)
    assert [line.split(" of group")[0] for line in report.stragglers] == ["peer 2"], report.lines()


def test_a_chrome_trace_of_the_dumps_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with Runtime() as runtime:
        _joined(runtime, 2)
        run_peers(2, lambda p: runtime.all_gather(p, np.ones(8)), runtime)
        RECORDER.dump(str(tmp_path / "dump.json"))
    output = tmp_path / "trace.json"
    assert cli.main(["trace", "chrome", str(tmp_path), "-o", str(output)]) == 0
    events = json.loads(output.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X" and e["name"].startswith("all_gather")]
    assert len(slices) >= 2 and all(e["dur"] >= 0 and isinstance(e["ts"], float) for e in slices)
    assert {e["name"] for e in events if e["ph"] == "M"} == {"process_name", "thread_name"}
    assert "open it in https://ui.perfetto.dev" in capsys.readouterr().out
    assert cli.main(["trace", "analyze", str(tmp_path)]) == 0  # all consistent


def test_bench_trace_records_every_process_and_writes_a_chrome_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``collective bench --trace DIR``: each node process's dump (every job), this process's
    (the in-process rows), and DIR/trace.json: valid trace JSON with every call, the sends and
    receives joined by flows; the recorder's settings are put back."""
    size = RECORDER.size
    argv = ["bench", "--nodes", "2", "--peers", "1", "-b", "8", "-e", "8", "-w", "1", "-n", "2"]
    argv += ["--op", "all_reduce", "--op", "sendrecv", "--strategy", "ring", "--trace", str(tmp_path)]
    status, out, _ = run_cli(argv, capsys)
    assert status == 0, out
    assert RECORDER.size == size and "COLLECTIVE_TRACE_EVERY_JOB" not in os.environ
    dumps, problems = load_dumps(str(tmp_path))
    assert not problems and sorted(peer for d in dumps for peer in d.peers) == [0, 1], problems
    trace = json.loads((tmp_path / "trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    calls = sum(len(d.entries) for d in dumps)
    assert len(slices) == calls and f"Chrome trace of {calls} calls" in out, out
    kinds = {e["name"].split()[0] for e in slices}
    assert {"all_reduce", "send", "recv"} <= kinds, kinds
    flows = [e for e in trace["traceEvents"] if e["ph"] in "sf"]
    sends = sum(1 for e in slices if e["name"].startswith("send"))
    assert sends and len(flows) == 2 * sends and all(e["dur"] >= 0 for e in slices)
    assert analyze_main(str(tmp_path), io.StringIO()) == 0


METRICS = textwrap.dedent(
    """
    import sys, threading, urllib.request
    import numpy as np
    import collective as col

    if sys.argv[1] == "without":
        sys.modules["prometheus_client"] = None  # (as where it is not installed)
    runtime = col.Runtime(0, 0)  # (no fast path: the ring runs)
    if sys.argv[1] != "serve":
        try:
            runtime.register(0, "cpu", col.CollectiveConfig(num_devices=1))
        except col.ConfigError as exc:
            print("ConfigError", exc)
        sys.exit(0)
    config = col.CollectiveConfig(num_devices=2)
    def peer(p):
        runtime.register(p, "cpu", config)
        for _ in range(3):
            runtime.all_reduce(p, np.ones(4, np.float32), strategy="ring")
    threads = [threading.Thread(target=peer, args=(p,)) for p in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    port = col.trace.metrics.serve_from_env()  # (served since the first register: its port)
    print(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
    """
)


def test_metrics_are_served_to_prometheus() -> None:
    pytest.importorskip("prometheus_client")
    port = str(free_port())
    env = {**os.environ, "COLLECTIVE_METRICS_PORT": port}
    env.pop("LOCAL_RANK", None)
    said = subprocess.run(
        [sys.executable, "-c", METRICS, "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    labels = 'algorithm="ring",group="world",kind="all_reduce",rank="0,1",size_class="<=1KiB"'
    lines = said.stdout.splitlines()
    assert f"collective_calls_total{{{labels}}} 6.0" in lines, said.stdout + said.stderr
    assert f"collective_failed_calls_total{{{labels}}} 0.0" in lines
    assert f"collective_bytes_total{{{labels}}} 96.0" in lines
    assert f"collective_call_seconds_count{{{labels}}} 6.0" in lines
    infinite = labels.replace(",rank=", ',le="+Inf",rank=')
    assert f"collective_call_seconds_bucket{{{infinite}}} 6.0" in lines


@pytest.mark.parametrize(
    ("value", "how", "problem"),
    [
        ("99999", "with", "is not a port"),
        ("9400", "without", "pip install prometheus_client"),
    ],
)
def test_a_metrics_port_that_cannot_be_served_is_a_config_error(value: str, how: str, problem: str) -> None:
    env = {**os.environ, "COLLECTIVE_METRICS_PORT": value}
    env.pop("LOCAL_RANK", None)
    said = subprocess.run(
        [sys.executable, "-c", METRICS, how], env=env, capture_output=True, text=True, timeout=60
    )
    assert said.stdout.startswith("ConfigError COLLECTIVE_METRICS_PORT") and problem in said.stdout, said


def test_dumps_of_jobs_one_after_another_are_analysed_apart(trace_dir: Path) -> None:
    """COLLECTIVE_TRACE_EVERY_JOB: a process's jobs of one name are told apart by their number in
    it: the calls of one job are not read as disagreeing with another's."""
    for shape in (4, 8):  # two jobs, each consistent, of different calls
        with Runtime() as runtime:
            _joined(runtime, 2)
            run_peers(2, lambda p, n=shape: runtime.all_reduce(p, np.ones(n)), runtime)
            RECORDER.dump_job("the job ended")
    out = io.StringIO()
    assert analyze_main(str(trace_dir), out) == 0, out.getvalue()
    assert out.getvalue().count("# consistent") == 2 and ", its job #" in out.getvalue(), out.getvalue()


def test_analyze_says_when_there_is_nothing_to_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "junk.json").write_text("{not json")
    assert cli.main(["trace", "analyze", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "skipped junk.json" in out and "no flight recorder dumps" in out


def test_a_timeout_names_what_the_missing_peer_does_instead() -> None:
    """Live, without a dump: the error the others get says where the late peer is (its recorder)."""
    with Runtime() as runtime:
        _joined(runtime)

        def body(peer: int) -> Any:
            runtime.all_reduce(peer, np.ones(4))
            if peer == 3:
                return runtime.broadcast(peer, np.ones(4), group=[1, 3], timeout=2)  # ELSEWHERE
            return runtime.all_reduce(peer, np.ones(4), timeout=0.5)

        outcomes = outcomes_of_peers(4, body, runtime)
    for outcome in outcomes[:3]:
        assert isinstance(outcome, col.CollectiveTimeout), outcomes
        (doing,) = [note for note in outcome.__notes__ if note.startswith("peer 3 ")]
        assert doing.startswith("peer 3 is in broadcast #0 of group 1,3 (scheduled for 0."), doing
        assert doing.endswith(f"{HERE}:{_line_of('# ELSEWHERE')}"), doing
    assert isinstance(outcomes[3], col.CollectiveTimeout)  # (peer 1 had left for the failure)
    (doing,) = [note for note in outcomes[3].__notes__ if note.startswith("peer 1 ")]
    assert doing.startswith("peer 1 is in no call; its last was all_reduce #1 of group world (failed "), doing


def test_a_timeout_across_nodes_names_what_the_missing_peer_does(orchestrator: str) -> None:
    """What a peer of another node does comes from its node's heartbeats, through the orchestrator."""
    procs = start_nodes(orchestrator, "trace-skip", 2, 1, "skip")
    codes = finish_all(procs, 60)
    assert codes == [3, 0], [proc.output() for proc in procs]
    worker = WORKER
    notes = [line for _, line in procs[0].lines if line.startswith("NOTE 0 peer 1 ")]
    assert len(notes) == 1, procs[0].output()
    assert notes[0].startswith("NOTE 0 peer 1 is in no call; its last was all_reduce #0 of group world"), (
        notes
    )
    assert f"{worker}:{_line_of('# LAST_CALL', worker)}" in notes[0], notes


def test_a_killed_node_is_named_live_and_by_the_analysis(orchestrator: str, tmp_path: Path) -> None:
    """The survivors' PeerLostError says what the killed peer was doing (its last heartbeat's
    account); their dumps, without its, name it as the peer that left none."""
    settle = str(4 * HEARTBEAT_INTERVAL)  # (a few heartbeats have told what the peers do)
    procs = start_nodes(orchestrator, "trace-kill", 3, 1, "loop", settle, shm=0, trace_dir=str(tmp_path))
    try:
        procs[0].wait_for("READY", 60)
        procs[1].kill()
        for survivor in (procs[0], procs[2]):
            survivor.wait_for("ERROR", 15)
            assert survivor.wait(30) == 3
    finally:
        finish_all(procs, 30)
    loop_line = f"{WORKER}:{_line_of('col.all_reduce(peer, x)', WORKER)}"
    for survivor in (procs[0], procs[2]):
        said = [line for _, line in survivor.lines if "peer 1 is in" in line]
        assert said and loop_line in said[0], survivor.output()
    dumps, _ = load_dumps(str(tmp_path))
    assert sorted(peer for dump in dumps for peer in dump.peers) == [0, 2]
    report = analyze(dumps)
    assert report.culprits and report.culprits[0].startswith("peer 1 left no dump (did its process die?)")


def test_nodes_that_disagree_dump_and_the_analysis_names_the_call(orchestrator: str, tmp_path: Path) -> None:
    procs = start_nodes(orchestrator, "trace-mismatch", 2, 2, "mismatch", "shape", trace_dir=str(tmp_path))
    for proc, code in zip(procs, finish_all(procs, 60), strict=True):
        assert code == 3 and "ERROR MismatchError" in proc.output(), proc.output()
    dumps, _ = load_dumps(str(tmp_path))
    assert sorted(peer for d in dumps for peer in d.peers) == [0, 1, 2, 3]
    report = analyze(dumps)
    assert report.disagreements and "peers 0, 1 called all_reduce sum [[5]]" in report.disagreements[0]


SCRIPT = textwrap.dedent(
    """
    import sys, threading
    import numpy as np
    import collective as col

    config = col.CollectiveConfig(num_devices=2, timeout=60)
    threading.Thread(target=col.register, args=(1, "cpu", config), daemon=True).start()
    col.register(0, "cpu", config)
    print("READY", flush=True)
    col.all_reduce(0, np.ones(4))  # peer 1 never calls: this blocks until SIGUSR1's dump is read
    """
)


def test_sigusr1_dumps_while_a_call_blocks(tmp_path: Path) -> None:
    env = {**os.environ, "COLLECTIVE_TRACE_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )

    def dumped_blocked() -> bool:
        """Signal again (the first may come before the call), then look for the blocked call."""
        proc.send_signal(signal.SIGUSR1)
        dumps = load_dumps(str(tmp_path))[0]
        return any(e["kind"] == "all_reduce" and e["state"] == "scheduled" for d in dumps for e in d.entries)

    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        wait_until(dumped_blocked, 15, "a dump from SIGUSR1 showing the blocked all_reduce", interval=0.2)
    finally:
        proc.kill()
        proc.wait(10)
    (dump,) = load_dumps(str(tmp_path))[0]
    assert dump.reason == "SIGUSR1" and dump.pid == proc.pid and dump.peers == [0, 1]


def _entry(peer: int, seq: int, state: str, kind: str = "all_reduce") -> dict[str, Any]:
    return {
        "record_id": seq,
        "pg_id": "world",
        "ranks": [0, 1, 2],
        "peer": peer,
        "collective_seq_id": seq,
        "kind": kind,
        "op": "sum",
        "input_sizes": [[4]],
        "input_dtypes": ["float32"],
        "state": state,
        "time_created_ns": 1_000_000 * seq + peer,
        "frames": [{"filename": "train.py", "line": 80 + seq, "name": "step"}],
    }


def test_a_peer_whose_process_died_without_a_dump_is_named() -> None:
    from collective.trace.analyze import Dump

    dumps = [
        Dump(
            f"p{peer}.json",
            100 + peer,
            "host",
            "job",
            [peer],
            3,
            "PeerLostError",
            [_entry(peer, 0, "completed"), _entry(peer, 1, "failed")],
        )
        for peer in (0, 1)
    ]
    report = analyze(dumps)
    assert report.culprits == [
        "peer 2 left no dump (did its process die?); the others wait in all_reduce #1 of group world"
    ]
    assert not report.consistent and not report.disagreements


def test_sends_and_receives_are_recorded_apart_from_the_collectives(tmp_path: Path) -> None:
    with Runtime() as runtime:
        _joined(runtime, 2)

        def body(peer: int) -> Any:
            if peer == 0:
                runtime.send(0, np.arange(6.0).reshape(2, 3), dst=1, tag=7)
                return None
            return runtime.recv(1, src=0, tag=7)

        run_peers(2, body, runtime)
        run_peers(2, lambda p: runtime.barrier(p), runtime)
        RECORDER.dump(str(tmp_path / "dump.json"))
    (dump,) = load_dumps(str(tmp_path))[0]
    sent, received = (next(e for e in dump.entries if e["kind"] == kind) for kind in ("send", "recv"))
    assert sent["is_p2p"] and sent["peer"] == 0 and sent["ranks"] == [0, 1] and sent["collective_seq_id"] == 0
    assert received["peer"] == 1 and received["state"] == "completed" and received["input_sizes"] == [[2, 3]]
    assert sent["bytes"] == 48 and sent["frames"][0]["filename"].endswith(HERE)
    assert received["collective_seq_id"] == 0 and sent["tag"] == received["tag"] == 7  # (numbered apart)
    flows = [e for e in chrome_trace([dump])["traceEvents"] if e["ph"] in "sf"]
    assert [(e["ph"], e["tid"]) for e in flows] == [("s", 0), ("f", 1)]  # the send's arrow to its receive
    report = analyze([dump])
    assert report.consistent, report.lines()  # (point-to-point calls are no group's collectives)
    assert all("2 calls recorded" in line for line in report.summary), (
        report.summary
    )  # (a p2p call and a barrier)
