"""One benchmark row: an op x strategy x size on local peers, timed and verified.

Inputs alternate between two value sets from one iteration to the next, so a call that left a
previous (correct) result in place is still counted as wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from typing import Any

import numpy as np

from collective.algorithms.ops import ReduceOp
from collective.bench.harness import Measurement, PeerStep, measure_threads
from collective.bench.ops import OPS, OpBench, busbw_factor, count_wrong, expected_blocks, make_input, shapes
from collective.bench.trivial import TrivialGroup
from collective.config import KINDS, CollectiveConfig
from collective.runtime import Runtime

__all__ = [
    "OPS",
    "Case",
    "Row",
    "busbw_factor",
    "measure_peer",
    "picked_by_auto",
    "resolve_dtype",
    "row_from",
    "run_case",
]


@dataclass(frozen=True)
class Case:
    system: str  # "collective" or "trivial"
    op: str
    strategy: str
    peers: int
    size: int  # bytes per peer
    dtype: str
    redop: str
    root: int  # reduce and broadcast; ignored by all_reduce
    alloc: bool = False  # collective only: a new result array per call instead of out=


@dataclass(frozen=True)
class Row:
    case: Case
    count: int
    time_us: float
    min_us: float
    algbw: float
    busbw: float
    wrong: int
    iterations: int
    picked: str = ""  # strategy auto: the schedule (or path) it ran
    figures: str = ""  # strategy auto: where its figures came from ("probe 0.41 s", "default", ...)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self.case), **{k: v for k, v in asdict(self).items() if k != "case"}}

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> Row:
        """The inverse of as_dict (rows travel as JSON from node and gloo processes)."""
        case_names = {f.name for f in dataclass_fields(Case)}
        case = Case(**{k: v for k, v in fields.items() if k in case_names})
        return cls(case, **{k: v for k, v in fields.items() if k not in case_names})


def resolve_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class Buffers:
    """One peer's inputs (two value sets), result buffer and expected block values for ``case``."""

    def __init__(self, case: Case, peer: int) -> None:
        dtype = resolve_dtype(case.dtype)
        self.counts = shapes(case.op, case.size // dtype.itemsize, case.peers)
        self.inputs = [make_input(case.op, peer, parity, self.counts, dtype) for parity in (0, 1)]
        self.expected = [
            expected_blocks(case.op, peer, case.peers, case.root, case.redop, parity, dtype)
            for parity in (0, 1)
        ]
        self.out = np.empty(self.counts.result, dtype)

    def wrong(self, result: Any, i: int) -> int:
        return count_wrong(result, self.expected[i % 2], self.counts.result)


def run_case(case: Case, warmup: int, iterations: int, timeout: float = 600.0) -> Row:
    """Time ``case`` on local peers (threads) and count wrong elements in every result."""
    op = ReduceOp.parse(case.redop)

    def steps(call: Callable[[int, Any, Any], Any]) -> Callable[[int], PeerStep]:
        def make_step(peer: int) -> PeerStep:
            buffers = Buffers(case, peer)
            latest: list[Any] = [None]

            def run(i: int) -> None:
                latest[0] = call(peer, buffers.inputs[i % 2], buffers.out)

            def check(i: int) -> int:
                return buffers.wrong(latest[0], i)

            return run, check

        return make_step

    if case.system == "trivial":
        group = TrivialGroup(
            case.peers, case.size // resolve_dtype(case.dtype).itemsize, resolve_dtype(case.dtype), timeout
        )

        def trivial_call(peer: int, x: Any, out: Any) -> Any:
            if case.op == "all_reduce":
                group.all_reduce(peer, x, out, op)
            elif case.op == "reduce":
                group.reduce(peer, x, out, op, case.root)
                return out if peer == case.root else None
            else:
                group.broadcast(peer, x if peer == case.root else None, out, case.root)
            return out

        measurement = measure_threads(case.peers, steps(trivial_call), warmup, iterations, timeout)
        return row_from(case, measurement)
    measurement, (picked, figures) = _run_collective(case, steps, timeout, warmup, iterations)
    return replace(row_from(case, measurement), picked=picked, figures=figures)


def row_from(case: Case, measurement: Measurement) -> Row:
    """The table row of a measurement: algbw = size / time, busbw = algbw x the op's factor."""
    algbw = case.size / (measurement.median_us * 1e-6) / 1e9 if measurement.median_us > 0 else 0.0
    if case.op == "barrier":
        algbw = 0.0
    busbw = algbw * busbw_factor(case.op, case.peers)
    count = shapes(case.op, case.size // resolve_dtype(case.dtype).itemsize, case.peers).result
    return Row(
        case,
        count,
        measurement.median_us,
        measurement.min_us,
        algbw,
        busbw,
        measurement.wrong,
        measurement.iterations,
    )


def strategy_fields(strategy: str, scopes: tuple[str, ...] = ("local",)) -> dict[str, Any]:
    """Every collective kind of a config set to ``strategy``."""
    return {f"{scope}_{kind}_strategy": strategy for scope in scopes for kind in KINDS}


def picked_by_auto(runtime: Runtime, case: Case) -> tuple[str, str]:
    """(what strategy auto runs ``case`` with, where its figures came from), from explain()."""
    if case.op not in KINDS and case.op != "barrier":
        return "", ""
    dtype = resolve_dtype(case.dtype)
    nbytes = shapes(case.op, case.size // dtype.itemsize, case.peers).input * dtype.itemsize
    found = runtime.explain(case.op, nbytes, dtype=dtype)
    figures = f"{found.source} {found.spent:.2f} s" if found.spent else found.source
    return (found.choice, figures) if found.choice != "-" else (found.path, "-")


def measure_peer(runtime: Runtime, case: Case, peer: int) -> tuple[Callable[[Any, Any], Any], Buffers]:
    """How ``peer`` runs one iteration of ``case`` (input, out) -> result, and its buffers."""
    bench = OpBench(case.op)

    def call(x: Any, out: Any) -> Any:
        return bench.run(runtime, peer, x, None if case.alloc else out, case.peers, case.root, case.redop)

    return call, Buffers(case, peer)


def _run_collective(
    case: Case,
    steps: Callable[..., Callable[[int], PeerStep]],
    timeout: float,
    warmup: int,
    iterations: int,
) -> tuple[Measurement, tuple[str, str]]:
    config = CollectiveConfig(num_devices=case.peers, timeout=timeout, **strategy_fields(case.strategy))
    picked = ["", ""]
    with Runtime() as runtime:
        bench = OpBench(case.op)

        def call(peer: int, x: Any, out: Any) -> Any:
            return bench.run(runtime, peer, x, None if case.alloc else out, case.peers, case.root, case.redop)

        registering = steps(call)

        def make_step(peer: int) -> PeerStep:
            runtime.register(peer, "cpu", config)
            if peer == 0 and case.strategy == "auto":
                picked[:] = picked_by_auto(runtime, case)
            return registering(peer)

        return measure_threads(case.peers, make_step, warmup, iterations, timeout), (picked[0], picked[1])
