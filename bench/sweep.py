"""One benchmark row: an op x strategy x size on local peers, timed and verified.

Inputs alternate between two value sets from one iteration to the next, so a call that left a
previous (correct) result in place is still counted as wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from typing import Any

import numpy as np

from collective.algorithms.ops import ReduceOp
from collective.arrays import scale_for_mean
from collective.bench.harness import Measurement, PeerStep, measure_threads
from collective.bench.trivial import TrivialGroup
from collective.config import CollectiveConfig
from collective.runtime import Runtime

__all__ = [
    "OPS",
    "Case",
    "Row",
    "busbw_factor",
    "count_wrong",
    "expected_value",
    "input_value",
    "resolve_dtype",
    "row_from",
    "run_case",
]

OPS = ("all_reduce", "reduce", "broadcast")


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

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self.case), **{k: v for k, v in asdict(self).items() if k != "case"}}

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> Row:
        """The inverse of as_dict (rows travel as JSON from node and gloo processes)."""
        case_names = {f.name for f in dataclass_fields(Case)}
        case = Case(**{k: v for k, v in fields.items() if k in case_names})
        return cls(case, **{k: v for k, v in fields.items() if k not in case_names})


def busbw_factor(op: str, peers: int) -> float:
    """nccl-tests' bus bandwidth factors: 2(n-1)/n for all_reduce, 1 for reduce and broadcast."""
    return 2 * (peers - 1) / peers if op == "all_reduce" else 1.0


def input_value(peer: int, parity: int) -> int:
    """Every element of ``peer``'s input on iterations of this parity (small: exact in every dtype)."""
    return peer + 1 + parity


def expected_value(case: Case, dtype: Any, parity: int) -> Any:
    """The exact result for inputs filled with input_value (small integers: exact in every dtype)."""
    if case.op == "broadcast":
        return np.full(1, input_value(case.root, parity), dtype)[0]
    op = ReduceOp.parse(case.redop)
    ufunc = getattr(np, op.ufunc_name)
    acc = np.full(1, input_value(0, parity), dtype)
    for peer in range(1, case.peers):
        ufunc(acc, np.full(1, input_value(peer, parity), dtype), out=acc)
    if op is ReduceOp.MEAN:
        scale_for_mean(acc, case.peers)
    return acc[0]


def count_wrong(result: Any, expected: Any, should_have: bool, count: int) -> int:
    """Wrong elements in ``result`` (all of them if it is missing, or present where it should not be)."""
    if not should_have:
        return 0 if result is None else count
    if result is None or result.shape != (count,):
        return count
    return int(np.count_nonzero(result != expected))


def resolve_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def run_case(case: Case, warmup: int, iterations: int, timeout: float = 600.0) -> Row:
    """Time ``case`` and count wrong elements in every result."""
    dtype = resolve_dtype(case.dtype)
    count = case.size // dtype.itemsize
    expected = [expected_value(case, dtype, parity) for parity in (0, 1)]
    op = ReduceOp.parse(case.redop)

    def steps(call: Callable[[int, Any, Any], Any]) -> Callable[[int], PeerStep]:
        def make_step(peer: int) -> PeerStep:
            inputs = [np.full(count, input_value(peer, parity), dtype) for parity in (0, 1)]
            out = np.empty(count, dtype)
            latest: list[Any] = [None]
            should_have = case.op != "reduce" or peer == case.root

            def run(i: int) -> None:
                latest[0] = call(peer, inputs[i % 2], out)

            def check(i: int) -> int:
                return count_wrong(latest[0], expected[i % 2], should_have, count)

            return run, check

        return make_step

    if case.system == "trivial":
        group = TrivialGroup(case.peers, count, dtype, timeout)

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
    else:
        measurement = _run_collective(case, steps, timeout, warmup, iterations, op)
    return row_from(case, count, measurement)


def row_from(case: Case, count: int, measurement: Measurement) -> Row:
    """The table row of a measurement: algbw = size / time, busbw = algbw x the op's factor."""
    algbw = case.size / (measurement.median_us * 1e-6) / 1e9 if measurement.median_us > 0 else 0.0
    busbw = algbw * busbw_factor(case.op, case.peers)
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


def _run_collective(
    case: Case,
    steps: Callable[..., Callable[[int], PeerStep]],
    timeout: float,
    warmup: int,
    iterations: int,
    op: ReduceOp,
) -> Measurement:
    config = CollectiveConfig(
        num_devices=case.peers, local_all_reduce_strategy=case.strategy, local_reduce_strategy=case.strategy,
        local_broadcast_strategy=case.strategy, timeout=timeout,
    )  # fmt: skip
    with Runtime() as runtime:

        def call(peer: int, x: Any, out: Any) -> Any:
            target = None if case.alloc else out
            if case.op == "all_reduce":
                return runtime.all_reduce(peer, x, op, out=target)
            if case.op == "reduce":
                return runtime.reduce(peer, x, op, case.root, out=target)
            return runtime.broadcast(peer, x if peer == case.root else None, out=target)

        registering = steps(call)

        def make_step(peer: int) -> PeerStep:
            runtime.register(peer, "cpu", config)
            return registering(peer)

        return measure_threads(case.peers, make_step, warmup, iterations, timeout)
