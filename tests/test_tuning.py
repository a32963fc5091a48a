"""Strategy auto (collective.tuning): the cost model, profiles, COLLECTIVE_ALGO, the probe's
agreement, explain(), and which schedule runs when strategies are named."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collective as col
from collective.algorithms import centralized, direct, ring, strategies, tree
from collective.algorithms.strategies import Auto, Centralized, Direct, Ring, Tree, parse_strategy
from collective.config import STRATEGY_FIELDS, CollectiveConfig
from collective.errors import ConfigError, InvalidArgumentError, MismatchError
from collective.runtime import Runtime
from collective.tuning.model import Chooser, Curve, Figures, Key, candidates
from collective.tuning.overrides import parse_algo, pinned
from collective.tuning.probe import Intent, decide, intent, measure
from collective.tuning.profile import ProfileError, ProfileWarning, dump, load, parse, save
from tests.conftest import outcomes_of_peers, run_cli, run_peers
from tests.processes import WORKER, Proc, finish_all, node_env, start_nodes

MiB = 1 << 20
THREADS = Key("inproc", "all_reduce", 4)


def _joined(runtime: Runtime, config: CollectiveConfig | None = None) -> None:
    """Four peers of ``runtime`` registered (threads)."""
    chosen = config or CollectiveConfig(num_devices=4)
    run_peers(4, lambda p: runtime.register(p, "cpu", chosen), runtime)


# -- strategy values and COLLECTIVE_ALGO -------------------------------------------------------


def test_auto_is_every_kinds_default_and_parses() -> None:
    config = CollectiveConfig()
    assert all(isinstance(getattr(config, name), Auto) for name in STRATEGY_FIELDS)
    assert parse_strategy(" AUTO ") == Auto() and str(Auto()) == "auto"
    with pytest.raises(ConfigError, match="names no schedule"):
        strategies.all_reduce("auto", None, np.ones(2), np.ones(2), col.ReduceOp.SUM)  # type: ignore[arg-type]


def test_collective_algo_pins_strategies_per_kind_and_scope() -> None:
    fields = parse_algo(" all_reduce:ring ; broadcast:tree:4;global.all_gather:direct;local.*:centralized")
    assert fields["global_all_reduce_strategy"] == Ring() and fields["global_broadcast_strategy"] == Tree(4)
    assert fields["global_all_gather_strategy"] == Direct()
    assert fields["local_all_reduce_strategy"] == Centralized()  # (later entries win)
    assert fields["local_scatter_strategy"] == Centralized() and "global_scatter_strategy" not in fields
    config = pinned(CollectiveConfig(), {"COLLECTIVE_ALGO": "all_reduce:tree:3"})
    assert config.local_all_reduce_strategy == Tree(3) == config.global_all_reduce_strategy
    assert isinstance(config.local_broadcast_strategy, Auto)
    assert pinned(config, {}) is config


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("all_reduce", "'all_reduce' must be KIND:STRATEGY"),
        ("all_reduce:", "'all_reduce:' must be KIND:STRATEGY"),
        ("allreduce:ring", "unknown collective 'allreduce'"),
        ("world.all_reduce:ring", "the scope must be 'local' or 'global'"),
        ("all_reduce:ring;broadcast:tree:x", "'broadcast:tree:x': strategy 'tree:x'"),
        ("broadcast:spiral", "'broadcast:spiral': unknown strategy 'spiral'"),
    ],
)
def test_a_bad_collective_algo_names_the_bad_entry(text: str, named: str) -> None:
    with pytest.raises(ConfigError, match="COLLECTIVE_ALGO") as info:
        parse_algo(text)
    assert named in str(info.value)


def test_register_refuses_a_bad_collective_algo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLLECTIVE_ALGO", "all_reduce:sideways")
    with Runtime() as runtime, pytest.raises(ConfigError, match="all_reduce:sideways"):
        runtime.register(0, "cpu", CollectiveConfig(num_devices=1))


# -- the model ------------------------------------------------------------------------------------


def test_a_curve_joins_its_points_and_extends_the_last_segment() -> None:
    curve = Curve(((1000, 1e-3), (3000, 2e-3), (5000, 6e-3)))
    assert curve.seconds(10) == 1e-3  # held below the first size
    assert curve.seconds(2000) == pytest.approx(1.5e-3)
    assert curve.seconds(7000) == pytest.approx(10e-3)  # the last slope, on
    flat = Curve(((1000, 2e-3), (2000, 1e-3)))  # (noise: falling) as if all bandwidth
    assert flat.seconds(4000) == pytest.approx(1e-3 + 2000 * 1e-3 / 2000)
    assert Curve(((1000, 1e-3),)).seconds(3000) == pytest.approx(3e-3)
    for bad in [(), ((2, 1.0), (1, 1.0)), ((1, 0.0),), ((1, float("nan")),), ((1, 1.0), (1, 2.0))]:
        with pytest.raises(ValueError):
            Curve(bad)  # type: ignore[arg-type]


def test_the_defaults_rank_ring_for_large_and_few_steps_for_small_all_reduce() -> None:
    chooser = Chooser()
    network = Key("zmq", "all_reduce", 8, 8)
    assert chooser.choose(network, 64 * MiB, False) == Ring()
    assert chooser.choose(network, 256, False) in (Centralized(), Direct())
    assert chooser.choose(network, 16, True) == Centralized()  # (ring and direct need an element each)
    explained = chooser.explain("three phases", network, 16, True)
    weighed = {e.strategy: e.competes for e in explained.alternatives}
    assert weighed["ring"] is False and weighed["direct"] is False and weighed["centralized"]
    assert explained.source == "default" and explained.choice == "centralized"


def test_measured_figures_win_and_only_measured_schedules_compete() -> None:
    figures = Figures("profile")
    figures.curves[(THREADS, "tree:2")] = Curve(((MiB, 1e-3), (8 * MiB, 2e-3)))
    figures.curves[(THREADS, "ring")] = Curve(((MiB, 2e-3), (8 * MiB, 3e-3)))
    chooser = Chooser(figures)
    assert chooser.choose(THREADS, 4 * MiB, False) == Tree(2)
    explained = chooser.explain("linked", THREADS, 4 * MiB, False)
    by_name = {e.strategy: e for e in explained.alternatives}
    assert by_name["centralized"].competes is False and by_name["centralized"].note == "not measured"
    assert by_name["tree:2"].source == "profile" and explained.seconds == pytest.approx(1e-3 + 3 / 7 * 1e-3)
    chooser.adopt(None)  # back to the built-in figures
    assert chooser.explain("linked", THREADS, 4 * MiB, False).source == "default"


def test_equal_figures_choose_the_first_candidate() -> None:
    figures = Figures("probe")
    for name in candidates("all_reduce", 4):
        figures.curves[(THREADS, name)] = Curve(((MiB, 1e-3),))
    assert Chooser(figures).choose(THREADS, MiB, False) == parse_strategy(candidates("all_reduce", 4)[0])


# -- profiles -------------------------------------------------------------------------------------


def _figures() -> Figures:
    figures = Figures("profile")
    figures.curves[(THREADS, "tree:2")] = Curve(((4 * MiB, 1e-4), (16 * MiB, 2e-4)))
    figures.curves[(THREADS, "ring")] = Curve(((4 * MiB, 9e-3), (16 * MiB, 3e-2)))
    return figures


def test_a_profile_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    save(_figures(), str(path), "collective tune")
    assert load(str(path)).curves == _figures().curves
    document = json.loads(path.read_text())
    assert document["schema"] == "collective-profile" and document["version"] == 1


def _document(**changes: Any) -> str:
    document = json.loads(dump(_figures()))
    curve = document["curves"][0]
    for name, value in changes.items():
        if name in curve:
            curve[name] = value
        else:
            document[name] = value
    return json.dumps(document)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{not json", "not JSON"),
        (json.dumps({"schema": "something else"}), "not a collective profile"),
        (_document(version=2), "profile version 2"),
        (_document(curves=[]), '"curves" must be a non-empty list'),
        (_document(kind="allreduce"), "kind must be one of"),
        (_document(transport="carrier-pigeon"), "transport must be one of"),
        (_document(participants=0), "participants must be an integer"),
        (_document(strategy="auto"), "names no schedule"),
        (_document(strategy="tree:zero"), "tree arity"),
        (_document(points=[[2, 1e-3], [1, 1e-3]]), "ascending"),
        (_document(points=[[1, -1e-3]]), "finite numbers of seconds > 0"),
        (_document(points=[[1, "fast"]]), "seconds must be a number"),
        (_document(points=[[1.5, 1e-3]]), "integer bytes"),
    ],
)
def test_a_bad_profile_is_refused_naming_the_problem(text: str, problem: str) -> None:
    with pytest.raises(ProfileError, match="profile") as info:
        parse(text)
    assert problem in str(info.value)


def test_a_duplicate_curve_is_refused() -> None:
    document = json.loads(dump(_figures()))
    document["curves"].append(document["curves"][0])
    with pytest.raises(ProfileError, match="twice"):
        parse(json.dumps(document))


def test_a_corrupt_profile_warns_and_the_job_runs_on_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "profile.json"
    path.write_text('{"schema": "collective-profile", "version": 1, "curves": [{"transport"')
    monkeypatch.setenv("COLLECTIVE_PROFILE", str(path))
    with pytest.warns(ProfileWarning, match="not JSON"), Runtime(0, 0) as runtime:
        _joined(runtime)
        results = run_peers(4, lambda p: runtime.all_reduce(p, np.full(MiB, p, np.float32)), runtime)
        assert runtime.explain("all_reduce", 4 * MiB).source == "default"
    assert all(np.all(r == 6) for r in results)


def test_a_profile_for_another_layout_warns_and_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = Figures("profile")
    figures.curves[(Key("inproc", "all_reduce", 8), "ring")] = Curve(((MiB, 1e-3),))
    path = tmp_path / "profile.json"
    save(figures, str(path))
    monkeypatch.setenv("COLLECTIVE_PROFILE", str(path))
    with pytest.warns(ProfileWarning, match="no figures for 4 threads"), Runtime(0, 0) as runtime:
        _joined(runtime)
        assert runtime.explain("all_reduce", 4 * MiB).source == "default"


def test_a_profile_that_fits_decides_and_explain_agrees_with_what_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "profile.json"
    save(_figures(), str(path))  # tree:2 far ahead of ring; nothing else measured
    monkeypatch.setenv("COLLECTIVE_PROFILE", str(path))
    caplog.set_level(logging.DEBUG, "collective.tuning")
    with Runtime(0, 0) as runtime:
        _joined(runtime)
        run_peers(4, lambda p: runtime.all_reduce(p, np.ones(MiB, np.float32)), runtime)
        explained = runtime.explain("all_reduce", 4 * MiB)
    assert explained.source == "profile" and explained.choice == "tree:2" and explained.path == "linked"
    ran = [r.getMessage() for r in caplog.records if r.getMessage().startswith("auto: ")]
    assert ran and all(line.startswith("auto: tree:2 for all_reduce of 4194304 bytes") for line in ran)
    assert "tree:2" in str(explained) and "profile" in str(explained)


# -- which schedule runs ----------------------------------------------------------------------


@pytest.fixture
def schedules(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The all_reduce schedules that ran (each module's all_reduce, counted on the way through)."""
    ran: list[str] = []
    lock = threading.Lock()
    for name, module in (("centralized", centralized), ("tree", tree), ("ring", ring), ("direct", direct)):
        original = module.all_reduce

        def counted(*args: Any, name: str = name, original: Any = original) -> Any:
            with lock:
                ran.append(name if name != "tree" else f"tree:{args[-1]}")
            return original(*args)

        monkeypatch.setattr(module, "all_reduce", counted)
    return ran


def _all_reduce(runtime: Runtime, strategy: Any = None) -> list[Any]:
    return run_peers(
        4, lambda p: runtime.all_reduce(p, np.full(1000, p, np.float64), strategy=strategy), runtime
    )


def test_a_named_strategy_wins_over_collective_algo_which_wins_over_the_config(
    schedules: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLLECTIVE_ALGO", "all_reduce:tree:3")
    with Runtime(0, 0) as runtime:
        _joined(runtime, CollectiveConfig(num_devices=4, local_all_reduce_strategy=Ring()))
        results = [
            _all_reduce(runtime),  # COLLECTIVE_ALGO over the config
            _all_reduce(runtime, "centralized"),  # the call over both
            _all_reduce(runtime, Direct()),
        ]
        assert runtime.explain("all_reduce", 8000).source == "pinned"
    assert schedules == ["tree:3"] * 4 + ["centralized"] * 4 + ["direct"] * 4
    assert all(np.all(r == 6) for each in results for r in each)


def test_auto_runs_what_explain_says(schedules: list[str]) -> None:
    with Runtime(0, 0) as runtime:
        _joined(runtime)
        _all_reduce(runtime, "auto")
        explained = runtime.explain("all_reduce", 8000, dtype="float64")
    assert explained.source == "default" and len(set(schedules)) == 1
    assert schedules[0] == explained.choice


def test_peers_naming_different_strategies_fail_alike() -> None:
    with Runtime(0, 0) as runtime:
        _joined(runtime)

        named = ["ring" if p == 2 else None for p in range(4)]
        errors = outcomes_of_peers(
            4, lambda p: runtime.all_reduce(p, np.ones(10), strategy=named[p]), runtime
        )
        assert all(isinstance(e, MismatchError) and "strategy: " in str(e) for e in errors), errors
        assert "peer 2 passed ring" in str(errors[0])
        named = ["spiral" if p == 1 else "ring" for p in range(4)]
        errors = outcomes_of_peers(
            4, lambda p: runtime.all_reduce(p, np.ones(10), strategy=named[p]), runtime
        )
        assert all(
            isinstance(e, InvalidArgumentError) and "unknown strategy 'spiral'" in str(e) for e in errors
        )
        assert np.all(_all_reduce(runtime)[0] == 6)  # the job goes on


def test_explain_names_the_fast_paths_and_refuses_bad_questions() -> None:
    with pytest.raises(col.RegistrationError, match="no job"):
        Runtime().explain("all_reduce", 8)
    with Runtime() as runtime:
        _joined(runtime)
        assert runtime.explain("all_reduce", 8).path == "fused"
        assert runtime.explain("broadcast", MiB).path == "shared"
        assert runtime.explain("all_gather", 64 * MiB).path == "linked"
        assert runtime.explain("all_gather", 64 * MiB, col.new_group([0, 1])).key == Key(
            "inproc", "all_gather", 2
        )
        with pytest.raises(InvalidArgumentError, match="unknown collective"):
            runtime.explain("allreduce", 8)
        with pytest.raises(InvalidArgumentError, match="nbytes"):
            runtime.explain("all_reduce", -1)


# -- the probe's agreement ------------------------------------------------------------------------


class _Peer:
    """A probing peer whose schedules take the times it is told (two peers disagree)."""

    def __init__(self, slow: str, meeting: threading.Barrier, board: list[np.ndarray], index: int) -> None:
        self.slow, self.meeting, self.board, self.index = slow, meeting, board, index

    def run(self, kind: str, nbytes: int, strategy: str) -> None:
        time.sleep(0.004 if strategy == self.slow else 0.001)

    def agree_max(self, values: np.ndarray) -> np.ndarray:
        self.board[self.index] = values
        self.meeting.wait(10)
        agreed = np.maximum(self.board[0], self.board[1])
        self.meeting.wait(10)
        return agreed


def test_peers_whose_probes_disagree_choose_alike() -> None:
    """Peer 0 finds ring slow, peer 1 finds tree:2 slow: both keep every peer's worst time."""
    meeting, board = threading.Barrier(2), [np.empty(0), np.empty(0)]
    key = Key("zmq", "all_reduce", 2, 2)
    found: list[Figures] = [Figures("none"), Figures("none")]

    def probe(index: int) -> None:
        peer = _Peer(("ring", "tree:2")[index], meeting, board, index)
        found[index] = measure(peer, lambda kind: key, budget=10.0, kinds=("all_reduce",), sizes=(1000, 2000))

    threads = [threading.Thread(target=probe, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert found[0].curves == found[1].curves and found[0].source == "probe"
    first, second = Chooser(found[0]), Chooser(found[1])
    for nbytes in (10, 1500, 10**6):
        assert first.choose(key, nbytes, False) == second.choose(key, nbytes, False)
    assert first.choose(key, 1500, False) not in (Ring(), Tree(2))  # slow on one peer: slow for all


def test_the_probe_stops_at_its_budget_after_a_whole_kind() -> None:
    meeting, board = threading.Barrier(1), [np.empty(0), np.empty(0)]
    peer = _Peer("none", meeting, board, 0)
    peer.agree_max = lambda values: values  # type: ignore[method-assign]
    figures = measure(peer, lambda kind: Key("zmq", kind, 2, 2), budget=0.0)
    assert {key.kind for key, _ in figures.curves} == {"all_reduce"} and figures.seconds_spent > 0


def test_every_process_decides_alike_from_what_each_brought() -> None:
    key = Key("zmq", "all_reduce", 2, 2)
    figures = Figures("profile", {(key, "ring"): Curve(((MiB, 1e-3),))})
    mine = Intent(figures, "abc", "auto", "p.json")
    same = {"profile": "abc", "probe": "auto", "auto": "1"}
    assert decide([same, same], key, mine) == "profile"
    with pytest.warns(ProfileWarning, match="do not all hold this same profile"):
        assert decide([same, {**same, "profile": None}], key, mine) == "probe"
    bare = Intent(None, None, "auto")
    nothing = {"profile": None, "probe": "auto", "auto": "1"}
    assert decide([nothing, nothing], key, bare) == "probe"  # several hosts
    assert decide([nothing, nothing], Key("zmq", "all_reduce", 2, 1), bare) == "default"
    assert decide([nothing, {**nothing, "probe": "never"}], key, bare) == "default"
    assert decide([{**nothing, "probe": "always"}, {**nothing, "probe": "never"}], key, bare) == "probe"
    assert decide([{**nothing, "auto": "0"}, {**nothing, "auto": "0"}], key, bare) == "default"
    with pytest.raises(ConfigError, match="COLLECTIVE_PROBE='sometimes'"):
        intent(True, {"COLLECTIVE_PROBE": "sometimes"})


def test_nodes_probe_at_start_and_run_what_they_explain(orchestrator: str) -> None:
    """Two processes of two peers each (the leaders' schedule over ZeroMQ), a probe forced on this
    one host: every process reports the same choices, from the probe, and runs them."""
    procs = start_nodes(orchestrator, "tuning", 2, 2, "tuning", probe="always")
    for proc, code in zip(procs, finish_all(procs, 120), strict=True):
        assert code == 0, proc.output()
    assert all(("FIGURES probe spent" in proc.output()) for proc in procs), procs[0].output()
    outputs = [[line for _, line in proc.lines if line.startswith(("EXPLAIN", "RAN"))] for proc in procs]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 24, procs[0].output()
    explained = {
        tuple(line.split()[1:3]): line.split()[3:] for line in outputs[0] if line.startswith("EXPLAIN")
    }
    for line in (line for line in outputs[0] if line.startswith("RAN")):
        _, kind, nbytes, ran = line.split()
        path, choice, source = explained[(kind, nbytes)]
        if path == "with_the_calls":
            assert ran == "-" and choice == "-"
        else:
            assert ran == choice and source == "probe" and path == "three_phases", outputs[0]


def test_nodes_pinned_apart_fail_alike_instead_of_hanging(orchestrator: str) -> None:
    """COLLECTIVE_ALGO on one node only: the leaders state their strategies with their calls, so
    every peer gets the same MismatchError instead of two schedules that never meet."""
    envs = [node_env(orchestrator, "pinned-apart", rank, 2, 2) for rank in range(2)]
    envs[1]["COLLECTIVE_ALGO"] = "all_reduce:tree:2"
    procs = [Proc([sys.executable, WORKER, "tuning"], env) for env in envs]
    for proc, code in zip(procs, finish_all(procs, 60), strict=True):
        assert code == 3, proc.output()
        _, line = proc.wait_for("ERROR", 5)
        assert "MismatchError" in line and "strategy: " in line and "tree:2" in line, proc.output()


# -- collective tune ------------------------------------------------------------------------------


def test_tune_writes_a_profile_that_a_job_then_chooses_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tuned.json"
    argv = ["tune", "--peers", "3", "--op", "all_reduce", "--op", "broadcast", "-b", "6M", "-e", "12M"]
    status, out, _ = run_cli([*argv, "-f", "2", "-w", "0", "-n", "1", "-o", str(path)], capsys)
    assert status == 0, out
    figures = load(str(path))
    assert {(key, name) for key, name in figures.curves} == {
        (Key("inproc", kind, 3), name) for kind in ("all_reduce", "broadcast") for name in candidates(kind, 3)
    }
    assert all(len(curve.points) == 2 for curve in figures.curves.values())  # 6 and 12 MiB per peer
    assert f"COLLECTIVE_PROFILE={path}" in out
    monkeypatch.setenv("COLLECTIVE_PROFILE", str(path))
    with Runtime(0, 0) as runtime:
        run_peers(3, lambda p: runtime.register(p, "cpu", CollectiveConfig(num_devices=3)), runtime)
        explained = runtime.explain("broadcast", 8 * MiB)
    fastest = min(
        candidates("broadcast", 3), key=lambda n: figures.curves[(explained.key, n)].seconds(8 * MiB)
    )
    assert explained.source == "profile" and explained.choice == fastest


def test_tune_refuses_a_layout_with_no_schedule_to_choose(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(["tune", "--nodes", "2", "--peers", "1"], capsys)
    assert status == 2 and "shared memory" in err
    status, _, err = run_cli(
        ["tune", "-e", "4M"], capsys
    )  # threads: numpy arrays this small take the fast paths
    assert status == 2 and "fast paths" in err
