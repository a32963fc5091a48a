"""bench/ddp_bench.py's report: the tables and the issue's targets, from step times (no processes)."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("torch")

from collective.bench.ddp_bench import VARIANTS, model_of, report


def test_the_models_are_the_issues() -> None:
    mlp26, mlp13 = model_of("mlp26"), model_of("mlp1.3M")
    assert len(list(mlp26.parameters())) == 26
    assert len(list(mlp13.parameters())) == 6 and sum(p.numel() for p in mlp13.parameters()) == 1_333_770
    idle = model_of("mlp26", idle_ms=0.1)
    assert len(list(idle.parameters())) == 26 and len(idle) > len(mlp26)  # a sleeper per layer


def test_report_checks_each_target_on_the_medians() -> None:
    ms = {"none": 1.0, "naive": 10.0, "flat": 4.0, "ddp": 3.0, "ddp-overlap": 1.1, "gloo-ddp": 3.5}
    times = {case: {v: [ms[v], ms[v] * 3, ms[v] / 2] for v in VARIANTS} for case in ("mlp26", "mlp1.3M")}
    times["overlap"] = {v: [ms[v]] for v in VARIANTS}
    times["idle"] = {v: [ms[v] * 2 if v == "ddp-overlap" else ms[v]] for v in VARIANTS}
    lines = report(times, argparse.Namespace(overlap_rows=1024, idle_ms=0.5))
    assert "target mlp26: ddp <= 1.0x gloo DDP: 0.86x met" in lines
    assert "target mlp26: ddp <= 0.5x naive: 0.30x met" in lines
    assert any(line.startswith("target overlap (1024 rows)") and line.endswith("1.10x met") for line in lines)
    assert any(line.startswith("target idle (0.5 ms") and line.endswith("2.20x NOT met") for line in lines)
    assert any(line.startswith("mlp26") and "0.29x" in line for line in lines)  # none / gloo-ddp


def test_hosts_names_one_host_per_process() -> None:
    from collective.bench.ddp_bench import main

    with pytest.raises(SystemExit) as refused:
        main(["--hosts", "abc"])
    assert refused.value.code == 2
