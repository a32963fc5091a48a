"""The executor conformance matrix: one table of collective cases, one numpy reference, any path.

Imported by tests/test_matrix.py (threads of one process) and by tests/matrix_worker.py (processes
of a multi-process job); depends only on the public API, numpy and ml_dtypes. Every peer of a job
runs the same list of ``Case`` values in order with ``run_table`` (peers outside a case's group
skip it), builds every rank's inputs itself and checks its own result bit for bit against the
reference. Inputs are small integers (-3..3) cast to the dtype, so every reduction is exact and
every path, strategy and combining order must give the same bits.

* ``SPECS``: one ``Spec`` per collective: its inputs, its call, its reference, its ``out=`` modes.
  A new collective is one more ``Spec`` subclass in that table.
* ``build_cases(world, ...)``: the table for a job of ``world`` peers (the product of dtypes, ops,
  sizes, roots, ``out=`` modes, views, shapes and groups, pruned to stay fast).
* ``run_table(api, peer, world, cases)``: one peer's run; wrong results are recorded, not raised.
* ``PathCounter``: the executor path of every step, from the ``collective.executors`` DEBUG log.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import threading
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

import collective as col

__all__ = [
    "DTYPES",
    "PROFILES",
    "SPECS",
    "Case",
    "Failures",
    "PathCounter",
    "Seat",
    "Spec",
    "build_cases",
    "by_group",
    "cases_of_peer",
    "group_shapes",
    "local_paths",
    "routes",
    "run_table",
]

DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)
    for name in ("float32", "float64", "int32", "int64", "uint8", "float16", "bfloat16")
}
FLOAT_OPS = ("sum", "mean", "max", "min", "prod")
INT_OPS = (*FLOAT_OPS, "band", "bor", "bxor")
OUT_MODES = ("none", "new", "inplace")  # no out=; a separate out array; out=x (in place)
SENTINEL = 7  # what a fresh ``out`` holds before the call (outside -3..3; kept where no result lands)
UFUNCS: dict[str, Any] = {
    "sum": np.add,
    "mean": np.add,
    "max": np.maximum,
    "min": np.minimum,
    "prod": np.multiply,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}
# per-peer block sizes in bytes, around the executors' limits: fused/inline up to 64 KiB, shared
# memory chunks of 1 MiB, the shared path up to 4 MiB
FUSE_LIMIT = 64 << 10
MIB = 1 << 20
PERIOD = 262_109  # (a prime) elements after which an input's values repeat


def is_integer(dtype: str) -> bool:
    return DTYPES[dtype].kind in "iu"


def ops_of(dtype: str) -> tuple[str, ...]:
    """The reduce ops defined for ``dtype`` (the bitwise ones on integers only)."""
    return INT_OPS if is_integer(dtype) else FLOAT_OPS


# -- the cases -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One collective every member of ``members`` calls (None: the whole job, no ``group=``).

    ``block`` is the unit of data: the array of an all_reduce, reduce, broadcast, all_gather or
    gather; each of the group-size blocks stacked along axis 0 of a reduce_scatter's, all_to_all's
    or scatter root's array; the first array of an all_reduce_coalesced list. ``root`` is a group
    rank; ``view``: every input is a non-contiguous view; ``variant``: another all_reduce_coalesced
    list (CoalescedSpec).
    """

    index: int
    kind: str
    dtype: str
    block: tuple[int, ...]
    op: str | None = None
    root: int | None = None
    out: str = "none"
    view: bool = False
    members: tuple[int, ...] | None = None
    variant: str = ""

    @property
    def spec(self) -> Spec:
        return SPECS[self.kind]

    def group_members(self, world: int) -> tuple[int, ...]:
        """The peers of the case's group, in rank order."""
        return tuple(range(world)) if self.members is None else self.members

    @property
    def label(self) -> str:
        parts = [f"#{self.index}", self.kind, self.dtype + (f"+{self.variant}" if self.variant else "")]
        parts += [self.op] if self.op else []
        parts.append(f"block={self.block}" + (" view" if self.view else ""))
        parts += [f"root={self.root}"] if self.root is not None else []
        parts += [f"out={self.out}", f"group={'all' if self.members is None else list(self.members)}"]
        return " ".join(parts)


def group_shapes(world: int) -> list[tuple[int, ...] | None]:
    """The groups every table runs on: the whole job (None); the peers but rank 0 and, from 6 peers,
    but the last but one (ranked by position, not by peer id; with several processes, spread
    unevenly over them); and a group of one (the last peer). No repeats."""
    rest = tuple(peer for peer in range(1, world) if world < 6 or peer != world - 2)
    shapes: list[tuple[int, ...] | None] = [None]
    for members in (rest, (world - 1,)):
        if members and members != tuple(range(world)) and members not in shapes:
            shapes.append(members)
    return shapes


def sizes(n: int, itemsize: int) -> dict[str, int]:
    """Block lengths (elements) on both sides of each limit, for a group of ``n``: empty, one,
    fewer than the peers, 17, exactly 64 KiB, just over 64 KiB."""
    found = {"0": 0, "1": 1, "few": n - 1, "17": 17, "64KiB": FUSE_LIMIT // itemsize}
    found["mid"] = found["64KiB"] + 5
    unique: dict[str, int] = {}
    for name, length in found.items():
        if length >= 0 and length not in unique.values():
            unique[name] = length
    return unique


LARGE = {"1MiB+": (MIB // 4) + 3, "4MiB+": (4 * MIB // 4) + 3}  # float32 blocks past 1 and 4 MiB


def build_cases(
    world: int,
    *,
    dtypes: Sequence[str] = tuple(DTYPES),
    large: bool = True,
    kinds: Sequence[str] | None = None,
    above: int = -1,
) -> list[Case]:
    """The table for a job of ``world`` peers: every collective (``kinds``: a subset) on every group
    of ``group_shapes``; ``dtypes`` limits the dtype sweeps (float32 always stays); ``large`` adds
    blocks past 1 MiB and 4 MiB; ``above``: only the cases with a step past that many bytes."""
    names = list(dict.fromkeys(["float32", *dtypes]))
    per_group: list[list[dict[str, Any]]] = []
    for members in group_shapes(world):
        n = world if members is None else len(members)
        per_group.append(
            [
                {"kind": spec.kind, "members": members, **params}
                for spec in SPECS.values()
                if kinds is None or spec.kind in kinds
                for params in spec.sweep(n, names, large)
                if max(spec.step_bytes(Case(0, **{"kind": spec.kind, **params}), n)) > above
            ]
        )
    # the groups take turns, case by case: no peer waits long for the others of a group it is not in
    turns = [params for row in itertools.zip_longest(*per_group) for params in row if params is not None]
    turns.append({"kind": "barrier", "dtype": "float32", "block": ()})  # (the whole job ends together)
    return [Case(index=index, **params) for index, params in enumerate(turns)]


# Tables by name, as tests/matrix_worker.py takes them (its PROFILE argument): build_cases' options.
PROFILES: dict[str, dict[str, Any]] = {
    "full": {},
    "past64k": {"above": FUSE_LIMIT},  # what moves over a link between nodes (a strategy's schedule)
}


def cases_of_peer(cases: Sequence[Case], world: int, peer: int) -> int:
    """How many of ``cases`` peer ``peer`` takes part in (what its run_table checks)."""
    return sum(peer in case.group_members(world) for case in cases)


class _Turns:
    """Round-robin choices, so a sweep varies the axes it does not enumerate."""

    def __init__(self) -> None:
        self._counters: dict[str, Iterator[int]] = {}

    def next(self, axis: str, options: Sequence[Any]) -> Any:
        counter = self._counters.setdefault(axis, itertools.count())
        return options[next(counter) % len(options)]


# -- the specs: one per collective ---------------------------------------------------------------


def values(shape: tuple[int, ...], dtype: str, seed: int, view: bool = False) -> np.ndarray:
    """Small integers (-3..3) in ``dtype``, a function of ``seed`` (the same in every process);
    ``view``: a non-contiguous view (every other element along the last axis of a wider array)."""
    wide = view and len(shape) > 0
    full = (*shape[:-1], 2 * shape[-1]) if wide else shape
    count = math.prod(full)
    z = np.arange(min(count, PERIOD), dtype=np.uint64)  # splitmix64 of (seed, index); uint64 wraps
    z += np.uint64((seed * 0x9E3779B97F4A7C15) & (2**64 - 1))
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    small = ((z >> np.uint64(40)) % np.uint64(7)).astype(np.int8) - np.int8(3)
    if count > PERIOD:  # large arrays repeat a prime-length pattern (cheap to make, never block-aligned)
        small = np.resize(small, count)
    array = small.reshape(full).astype(np.int64 if is_integer(dtype) else np.float32)
    array = array.astype(DTYPES[dtype])
    return array[..., ::2] if wide else array


def reduced(arrays: Sequence[np.ndarray], op: str) -> np.ndarray:
    """``op`` over ``arrays`` in rank order, in their dtype (integers wrap as numpy's do); mean is
    the sum divided by the count: true division in the dtype, floor division for integers."""
    total = contiguous(arrays[0])
    for other in arrays[1:]:
        UFUNCS[op](total, other, out=total)
    if op == "mean":
        if total.dtype.kind in "iu":
            np.floor_divide(total, len(arrays), out=total)
        else:
            np.true_divide(total, total.dtype.type(len(arrays)), out=total)
    return total


def contiguous(array: Any) -> np.ndarray:
    """A C-contiguous copy of the same shape (0-d stays 0-d, unlike np.ascontiguousarray)."""
    return np.array(array, copy=True, order="C")


def rows(array: np.ndarray, n: int, rank: int) -> np.ndarray:
    """Block ``rank`` of the ``n`` equal blocks along axis 0."""
    k = array.shape[0] // n
    return array[rank * k : (rank + 1) * k]


@dataclass
class Data:
    """One case's inputs and reference for every rank of its group (None where a rank passes no
    input or gets no result), and a digest of what each rank's input held before any call."""

    inputs: list[Any]
    expected: list[Any]
    pristine: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pristine = [_digest(x) for x in self.inputs]


def _raw(array: np.ndarray) -> np.ndarray:
    """The bytes of ``array`` in C order, as a flat uint8 array (a copy only when not contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _digest(x: Any) -> list[tuple[Any, ...]] | None:
    """Shape, dtype and CRC-32 of the bytes of an array or of each of a list (None for None)."""
    if x is None:
        return None
    return [
        (item.shape, item.dtype.str, zlib.crc32(_raw(item).data))
        for item in (x if isinstance(x, list) else [x])
    ]


@dataclass(frozen=True)
class Seat:
    """Where one peer sits in a case: its peer id, its rank in the group of ``size``, the root as a
    peer id (None: no root), and the ``group=`` to pass (None: the whole job)."""

    peer: int
    rank: int
    size: int
    root: int | None
    group: Any


class Spec:
    """What the matrix knows of one collective. Subclasses set the flags and the three methods
    ``inputs`` (every rank's argument), ``expected`` (the reference) and ``call``."""

    kind: ClassVar[str]
    reduces: ClassVar[bool] = False  # takes an op
    rooted: ClassVar[bool] = False  # takes a root
    blocked: ClassVar[bool] = False  # its input stacks one block per rank along axis 0
    zero_d: ClassVar[bool] = True  # a 0-d block is allowed
    out_modes: ClassVar[tuple[str, ...]] = ("none", "new")

    def input_shape(self, case: Case, n: int) -> tuple[int, ...]:
        """The shape of an input array (the root's, for a scatter)."""
        return (n * case.block[0], *case.block[1:]) if self.blocked else case.block

    def inputs(self, case: Case, n: int) -> list[Any]:
        """Every rank's input, in rank order."""
        shape = self.input_shape(case, n)
        return [values(shape, case.dtype, 1000 * case.index + rank, case.view) for rank in range(n)]

    def expected(self, case: Case, inputs: list[Any]) -> list[Any]:
        """Every rank's reference result (None for a rank that gets none)."""
        raise NotImplementedError

    def call(self, api: Any, case: Case, seat: Seat, x: Any, out: Any) -> Any:
        """``seat.peer``'s call through ``api`` (the ``collective`` module or a ``col.Runtime``)."""
        raise NotImplementedError

    def steps(self, case: Case) -> int:
        """How many executor steps (rendezvous) one call takes."""
        return 1

    def fresh_out(self, shaped: Any) -> Any:
        """A separate ``out`` for a result like ``shaped`` (holding SENTINEL)."""
        return _fresh(shaped)

    def identity(self, got: Any, out: Any) -> list[str]:
        """What is wrong with how the result relates to the ``out`` given (empty: nothing)."""
        return _identity(got, out)

    def step_bytes(self, case: Case, n: int) -> list[int]:
        """Per step, the largest input any rank passes, in bytes (what the executor's choice reads)."""
        return [math.prod(self.input_shape(case, n)) * DTYPES[case.dtype].itemsize]

    def sweep(self, n: int, dtypes: list[str], large: bool) -> Iterator[dict[str, Any]]:
        """The cases of this collective on a group of ``n``: every dtype with every op; every size
        with every out= mode; the large sizes; every root at a small and a mid size; odd shapes;
        every dtype past 64 KiB. The axes a sweep does not enumerate take turns."""
        turns = _Turns()
        roots = list(range(n)) if self.rooted else [None]

        def case(dtype: str, block: tuple[int, ...], op: str | None = None, **fixed: Any) -> dict[str, Any]:
            out = fixed.pop("out", None) or turns.next("out", self.out_modes)
            view = fixed.pop("view", None)
            if view is None:
                view = bool(turns.next("view", (0, 1))) and len(block) > 0
            return {
                "dtype": dtype,
                "block": block,
                "op": (op or turns.next(f"op {dtype}", ops_of(dtype))) if self.reduces else None,
                "root": fixed.pop("root", None) if "root" in fixed else turns.next("root", roots),
                "out": out,
                "view": view and out != "inplace",
                **fixed,
            }

        small_shapes: list[tuple[int, ...]] = [(17,), (3, 5)]
        for dtype in dtypes:  # every dtype with every op, small
            for op in ops_of(dtype) if self.reduces else (None,):
                yield case(dtype, turns.next("small", small_shapes), op)
        for length in sizes(n, 4).values():  # every size with every out= mode (float32)
            for out in self.out_modes:
                yield case("float32", (length,), out=out)
        for length in LARGE.values() if large else ():
            yield case("float32", (length,), view=False)
        for root in roots if self.rooted else ():  # every root, small and past 64 KiB
            for length in (17, sizes(n, 4)["mid"]):
                yield case("float32", (length,), root=root)
        shapes: list[tuple[int, ...]] = [(2, 3, 4), (4, 0), (5, 1, 3)] + ([()] if self.zero_d else [])
        for shape in shapes:
            yield case("float64", shape)
        for dtype in dtypes[1:]:  # every other dtype past 64 KiB
            yield case(dtype, (sizes(n, DTYPES[dtype].itemsize)["mid"],))


class AllReduceSpec(Spec):
    kind = "all_reduce"
    reduces = True
    out_modes = OUT_MODES

    def expected(self, case: Case, inputs: list[Any]) -> list[Any]:
        assert case.op is not None
        total = reduced(inputs, case.op)
        return [total] * len(inputs)

    def call(self, api: Any, case: Case, seat: Seat, x: Any, out: Any) -> Any:
        return api.all_reduce(seat.peer, x, case.op, group=seat.group, out=out)


class ReduceSpec(AllReduceSpec):
    kind = "reduce"
    rooted = True

    def expected(self, case: Case, inputs: list[Any]) -> list[Any]:
        assert case.op is not None and case.root is not None
        results: list[Any] = [None] * len(inputs)
        results[case.root] = reduced(inputs, case.op)
        return results

    def call(self, api: Any, case: Case, seat: Seat, x: Any, out: Any) -> Any:
        return api.reduce(seat.peer, x, case.op, root=seat.root, group=seat.group, out=out)


class BroadcastSpec(Spec):
    kind = "broadcast"
    rooted = True
    out_modes = OUT_MODES  # in place: the root passes out=x, the others a separate out

    def inputs(self, case: Case, n: int) -> list[Any]:
        everyone = super().inputs(case, n)
        return [x if rank == case.root else None for rank, x in enumerate(everyone)]

    def expected(self, case: Case, inputs: list[Any]) -> list[Any]:
        assert case.root is not None
        return [contiguous(inputs[case.root])] * len(inputs)

    def call(self, api: Any, case: Case, seat: Seat, x: Any, out: Any) -> Any:
        return api.broadcast(seat.peer, x, group=seat.group, out=out)


class AllGatherSpec(Spec):
    kind = "all_gather"

    def expected(self, case: Case, inputs: list[Any]) -> list[Any]:
        return [np.stack(inputs)] * len(inputs)

    def call(self, api: Any, case: Case, seat: Seat, x: Any, out: Any) -> Any:
        return api.all_gather(seat.peer, x, group=seat.group, out=out)


class GatherSpec(AllGatherSpec):
    kind = "gather"
    rooted = True

    def expected(self, case: Case, inputs: list[Any]) -> list[Any]:
        assert case.root is not None
        results: list[Any] = [None] * len(inputs)
        results[case.root] = np.stack(inputs)
        return results

    def call(self, api: Any, case: Case, seat: Seat, x: Any, out: Any) -> Any:
        return api.gather(seat.peer, x, root=seat.root, group=seat.group, out=out)


class ReduceScatterSpec(Spec):
    kind = "reduce_scatter"
    reduces = True
    blocked = True
    zero_d = False

    def expected(self, case: Case, inputs: list[Any]) -> list[Any]:
        assert case.op is not None
        total = reduced(inputs, case.op)
        return [rows(total, len(inputs), rank) for rank in range(len(inputs))]

    def call(self, api: Any, case: Case, seat: Seat, x: Any, out: Any) -> Any:
        return api.reduce_scatter(seat.peer, x, case.op, group=seat.group, out=out)


class AllToAllSpec(Spec):
    kind = "all_to_all"
    blocked = True
    zero_d = False
    out_modes = OUT_MODES

    def expected(self, case: Case, inputs: list[Any]) -> list[Any]:
        n = len(inputs)
        return [np.concatenate([rows(x, n, rank) for x in inputs]) for rank in range(n)]

    def call(self, api: Any, case: Case, seat: Seat, x: Any, out: Any) -> Any:
        return api.all_to_all(seat.peer, x, group=seat.group, out=out)


class ScatterSpec(Spec):
    kind = "scatter"
    rooted = True

    def input_shape(self, case: Case, n: int) -> tuple[int, ...]:
        return (n, *case.block)

    def inputs(self, case: Case, n: int) -> list[Any]:
        everyone = super().inputs(case, n)
        return [x if rank == case.root else None for rank, x in enumerate(everyone)]

    def expected(self, case: Case, inputs: list[Any]) -> list[Any]:
        assert case.root is not None
        stack = inputs[case.root]
        return [contiguous(stack[rank]) for rank in range(len(inputs))]

    def call(self, api: Any, case: Case, seat: Seat, x: Any, out: Any) -> Any:
        return api.scatter(seat.peer, x, root=seat.root, group=seat.group, out=out)


class BarrierSpec(Spec):
    kind = "barrier"
    out_modes = ("none",)

    def inputs(self, case: Case, n: int) -> list[Any]:
        return [None] * n

    def expected(self, case: Case, inputs: list[Any]) -> list[Any]:
        return [None] * len(inputs)

    def call(self, api: Any, case: Case, seat: Seat, x: Any, out: Any) -> Any:
        return api.barrier(seat.peer, group=seat.group)

    def step_bytes(self, case: Case, n: int) -> list[int]:
        return [0]

    def sweep(self, n: int, dtypes: list[str], large: bool) -> Iterator[dict[str, Any]]:
        yield {"dtype": "float32", "block": ()}
        yield {"dtype": "float32", "block": ()}


class CoalescedSpec(Spec):
    """all_reduce_coalesced of [block, (2, 3), ()] in the case's dtype (a view makes the first array
    one). Variants: "mixed" adds two arrays of a second dtype (two buckets, two steps); "many" is 184
    arrays of two dtypes, past a 1 MiB chunk, their 2-D arrays views with ``view`` (every rank's
    slice of a bucket spans several arrays: read in pieces by the shared-memory path)."""

    kind = "all_reduce_coalesced"
    reduces = True
    out_modes = OUT_MODES  # in place: out is the list of inputs
    MANY: ClassVar[list[tuple[int, ...]]] = [(3,), (4, 5), (), (70_000,)] + [(5_003,), (7,), (40, 33)] * 60

    @staticmethod
    def other(dtype: str) -> str:
        return "float32" if is_integer(dtype) else "int32"

    def items(self, case: Case) -> list[tuple[tuple[int, ...], str]]:
        if case.variant == "many":  # every third array of the repeated three in the other dtype
            return [
                (shape, self.other(case.dtype) if i % 3 == 2 else case.dtype)
                for i, shape in enumerate(self.MANY)
            ]
        items = [(case.block, case.dtype), ((2, 3), case.dtype), ((), case.dtype)]
        if case.variant == "mixed":
            items += [((5,), self.other(case.dtype)), ((4, 2), self.other(case.dtype))]
        return items

    def viewed(self, case: Case, i: int, shape: tuple[int, ...]) -> bool:
        """Whether array ``i`` of the list is a non-contiguous view."""
        return case.view and (len(shape) > 1 if case.variant == "many" else i == 0)

    def inputs(self, case: Case, n: int) -> list[Any]:
        return [
            [
                values(shape, dtype, 1000 * case.index + 7 * i + rank, self.viewed(case, i, shape))
                for i, (shape, dtype) in enumerate(self.items(case))
            ]
            for rank in range(n)
        ]

    def expected(self, case: Case, inputs: list[Any]) -> list[Any]:
        assert case.op is not None
        op = case.op
        total = [reduced([xs[i] for xs in inputs], op) for i in range(len(inputs[0]))]
        return [total] * len(inputs)

    def call(self, api: Any, case: Case, seat: Seat, x: Any, out: Any) -> Any:
        return api.all_reduce_coalesced(seat.peer, x, case.op, group=seat.group, out=out)

    def steps(self, case: Case) -> int:
        return len({dtype for _, dtype in self.items(case)})

    def step_bytes(self, case: Case, n: int) -> list[int]:
        buckets: dict[str, int] = {}
        for shape, dtype in self.items(case):
            buckets[dtype] = buckets.get(dtype, 0) + math.prod(shape) * DTYPES[dtype].itemsize
        return list(buckets.values())

    def sweep(self, n: int, dtypes: list[str], large: bool) -> Iterator[dict[str, Any]]:
        yield from super().sweep(n, dtypes, large)
        for out in self.out_modes:  # two dtypes, small and past 64 KiB; many arrays
            for length in (17, sizes(n, 4)["mid"]):
                yield {"dtype": "float32", "block": (length,), "op": "max", "out": out, "variant": "mixed"}
            yield {
                "dtype": "float32",
                "block": (3,),
                "op": "sum",
                "out": out,
                "variant": "many",
                "view": out == "new",
            }


class _UnevenSpec(Spec):
    """An uneven collective: the rows of each rank's block vary with the rank (some none); ``out``
    is one array of every row a rank gets, and the result a list of views of it, by source rank."""

    zero_d = False

    @staticmethod
    def spread(base: int, i: int, j: int = 0) -> int:
        """A row count near ``base`` that varies with ``i`` and ``j`` (0 for some)."""
        return max(0, base + (i * 7 + j * 3) % 5 - 2)

    def fresh_out(self, shaped: Any) -> Any:
        if not isinstance(shaped, list):
            return _fresh(shaped)
        return np.full((sum(a.shape[0] for a in shaped), *shaped[0].shape[1:]), SENTINEL, shaped[0].dtype)

    def identity(self, got: Any, out: Any) -> list[str]:
        if not isinstance(got, list):
            return _identity(got, out)
        start = 0
        for piece in got:
            rows = piece.shape[0]
            if rows and not np.shares_memory(piece, out[start : start + rows]):
                return [f"a piece of the result is not rows {start}..{start + rows} of the out= given"]
            start += rows
        return [] if start == out.shape[0] else [f"the pieces hold {start} rows, out= {out.shape[0]}"]


class AllGatherVSpec(_UnevenSpec):
    kind = "all_gather_v"

    def inputs(self, case: Case, n: int) -> list[Any]:
        base, rest = case.block[0], case.block[1:]
        return [
            values((self.spread(base, rank), *rest), case.dtype, 1000 * case.index + rank, case.view)
            for rank in range(n)
        ]

    def expected(self, case: Case, inputs: list[Any]) -> list[Any]:
        return [[contiguous(x) for x in inputs]] * len(inputs)

    def call(self, api: Any, case: Case, seat: Seat, x: Any, out: Any) -> Any:
        return api.all_gather_v(seat.peer, x, group=seat.group, out=out)

    def step_bytes(self, case: Case, n: int) -> list[int]:
        width = math.prod(case.block[1:]) * DTYPES[case.dtype].itemsize
        return [max(self.spread(case.block[0], rank) for rank in range(n)) * width]


class ReduceScatterVSpec(_UnevenSpec):
    kind = "reduce_scatter_v"
    reduces = True

    def sizes(self, case: Case, n: int) -> list[int]:
        return [self.spread(case.block[0], j) for j in range(n)]

    def input_shape(self, case: Case, n: int) -> tuple[int, ...]:
        return (sum(self.sizes(case, n)), *case.block[1:])

    def expected(self, case: Case, inputs: list[Any]) -> list[Any]:
        assert case.op is not None
        total, sizes = reduced(inputs, case.op), self.sizes(case, len(inputs))
        starts = list(itertools.accumulate(sizes, initial=0))
        return [total[starts[j] : starts[j + 1]] for j in range(len(inputs))]

    def call(self, api: Any, case: Case, seat: Seat, x: Any, out: Any) -> Any:
        return api.reduce_scatter_v(
            seat.peer, x, self.sizes(case, seat.size), case.op, group=seat.group, out=out
        )


class AllToAllVSpec(_UnevenSpec):
    kind = "all_to_all_v"

    def sends(self, case: Case, n: int, rank: int) -> list[int]:
        return [self.spread(case.block[0], rank, j) for j in range(n)]

    def inputs(self, case: Case, n: int) -> list[Any]:
        base_rest = case.block[1:]
        return [
            values(
                (sum(self.sends(case, n, rank)), *base_rest), case.dtype, 1000 * case.index + rank, case.view
            )
            for rank in range(n)
        ]

    def expected(self, case: Case, inputs: list[Any]) -> list[Any]:
        n = len(inputs)
        starts = [list(itertools.accumulate(self.sends(case, n, k), initial=0)) for k in range(n)]
        return [[contiguous(inputs[k][starts[k][j] : starts[k][j + 1]]) for k in range(n)] for j in range(n)]

    def call(self, api: Any, case: Case, seat: Seat, x: Any, out: Any) -> Any:
        sends = self.sends(case, seat.size, seat.rank)
        return api.all_to_all_v(seat.peer, x, sends, group=seat.group, out=out)

    def step_bytes(self, case: Case, n: int) -> list[int]:
        width = math.prod(case.block[1:]) * DTYPES[case.dtype].itemsize
        return [max(sum(self.sends(case, n, rank)) for rank in range(n)) * width]


SPECS: dict[str, Spec] = {
    spec.kind: spec
    for spec in (
        AllReduceSpec(),
        ReduceSpec(),
        BroadcastSpec(),
        AllGatherSpec(),
        GatherSpec(),
        ReduceScatterSpec(),
        AllToAllSpec(),
        ScatterSpec(),
        BarrierSpec(),
        CoalescedSpec(),
        AllGatherVSpec(),
        ReduceScatterVSpec(),
        AllToAllVSpec(),
    )
}


# -- one case's data, built once per process ------------------------------------------------------


class _Memo:
    """The last few cases' Data, built once per process whatever the number of local peers."""

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[Case, int], tuple[threading.Lock, list[Data]]] = OrderedDict()

    def get(self, case: Case, n: int) -> Data:
        key = (case, n)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = (threading.Lock(), [])
                while len(self._entries) > self._keep:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
        lock, built = entry
        with lock:  # the first peer here builds it; the others wait for it
            if not built:
                inputs = case.spec.inputs(case, n)
                built.append(Data(inputs, case.spec.expected(case, inputs)))
            return built[0]


_data = _Memo()


# -- the runner ----------------------------------------------------------------------------------


class Failures(list[str]):
    """The failures of one peer's run ("<case label>: <what differed>"), and how many cases it checked."""

    def __init__(self) -> None:
        super().__init__()
        self.checked = 0


def run_table(api: Any, peer: int, world: int, cases: Sequence[Case]) -> Failures:
    """Run every case of ``cases`` whose group holds ``peer``, in order, as peer ``peer`` of a job of
    ``world`` peers through ``api`` (the ``collective`` module or a ``col.Runtime``).

    A wrong result (bits, shape, dtype, type, ``out`` not returned, an input or an off-root ``out``
    written, a new result sharing memory with an input) is recorded and the run goes on; a
    CollectiveError (or any other exception) raises.
    """
    failures = Failures()
    for case in cases:
        if peer in case.group_members(world):
            failures.extend(
                f"{case.label}: peer {peer}: {problem}" for problem in run_case(api, peer, world, case)
            )
            failures.checked += 1
    return failures


def run_case(api: Any, peer: int, world: int, case: Case) -> list[str]:
    """Peer ``peer``'s call of ``case`` and what differed from the reference (empty: nothing)."""
    members = case.group_members(world)
    rank, n = members.index(peer), len(members)
    data = _data.get(case, n)
    x, expected = data.inputs[rank], data.expected[rank]
    shaped = expected if expected is not None else next((e for e in data.expected if e is not None), None)
    out: Any = None
    if case.out == "inplace":
        x = _private(x)
        out = x if x is not None else case.spec.fresh_out(shaped)
    elif case.out == "new":
        out = case.spec.fresh_out(shaped)
    kept = _digest(out)  # what an out that gets no result must still hold
    group = None if case.members is None else col.new_group(list(members))
    seat = Seat(peer, rank, n, None if case.root is None else members[case.root], group)
    got = case.spec.call(api, case, seat, x, out)
    problems = _compare(got, expected, "result")
    if expected is not None and out is not None:
        problems += case.spec.identity(got, out)
    elif expected is not None and not problems and _aliases(got, data.inputs):
        problems.append("a new result shares memory with an input")
    elif out is not None and _digest(out) != kept:
        problems.append("an out= that gets no result was written")
    if case.out != "inplace" and _digest(x) != data.pristine[rank]:
        problems.append("the input was modified")
    return problems


def _private(x: Any) -> Any:
    """A C-contiguous copy of an input (or list of them), for the call to write in place."""
    if x is None:
        return None
    if isinstance(x, list):
        return [contiguous(item) for item in x]
    return contiguous(x)


def _fresh(like: Any) -> Any:
    """A separate ``out`` (or list of them) shaped like the result, holding SENTINEL."""
    if like is None:
        return None
    if isinstance(like, list):
        return [np.full(item.shape, SENTINEL, item.dtype) for item in like]
    return np.full(like.shape, SENTINEL, like.dtype)


def _aliases(got: Any, inputs: list[Any]) -> bool:
    """Whether a new result may share memory with any rank's input (for a list of lists: item i with
    every rank's input i)."""
    if isinstance(got, list) and any(isinstance(x, list) for x in inputs):  # (a list of lists: coalesced)
        return any(_aliases(item, [x[i] for x in inputs if x is not None]) for i, item in enumerate(got))
    if isinstance(got, list):  # (pieces of one result: the uneven collectives)
        return any(_aliases(item, inputs) for item in got)
    return (
        isinstance(got, np.ndarray)
        and got.size > 0
        and any(x is not None and np.may_share_memory(got, x) for x in inputs)
    )


def _identity(got: Any, out: Any) -> list[str]:
    if isinstance(out, list):
        if (
            not isinstance(got, list)
            or len(got) != len(out)
            or any(g is not o for g, o in zip(got, out, strict=True))
        ):
            return ["the result is not the list of the out= arrays given"]
        return []
    return [] if got is out else ["the result is not the out= array given"]


def _compare(got: Any, expected: Any, what: str) -> list[str]:
    """How ``got`` differs from ``expected`` (an array, a list of arrays, or None), bit for bit."""
    if expected is None:
        return [] if got is None else [f"{what}: expected None, got {type(got).__name__}"]
    if isinstance(expected, list):
        if not isinstance(got, list) or len(got) != len(expected):
            return [f"{what}: expected a list of {len(expected)} arrays, got {type(got).__name__}"]
        return [
            p
            for i, (g, e) in enumerate(zip(got, expected, strict=True))
            for p in _compare(g, e, f"{what}[{i}]")
        ]
    if type(got) is not np.ndarray:
        return [f"{what}: expected a numpy array, got {type(got).__name__}"]
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return [f"{what}: got {got.shape} {got.dtype}, expected {expected.shape} {expected.dtype}"]
    a, b = _raw(got), _raw(expected)
    if np.array_equal(a, b):
        return []
    size = expected.dtype.itemsize
    wrong = np.flatnonzero((a.reshape(-1, size) != b.reshape(-1, size)).any(axis=1))
    first = int(wrong[0])
    where = np.unravel_index(first, expected.shape) if expected.ndim else ()
    return [
        f"{what}: {wrong.size} of {expected.size} elements differ, first at {tuple(map(int, where))}: "
        f"got {got.reshape(-1)[first]!r}, expected {expected.reshape(-1)[first]!r}"
    ]


# -- the paths taken ------------------------------------------------------------------------------

PATH_LOGGER = "collective.executors"
_RECORD = re.compile(r"^(?P<label>.+) of group \((?P<members>[\d, ]*)\): (?P<path>.+)$")


class PathCounter(logging.Handler):
    """Counts the steps per (group members, executor path) from the DEBUG records that
    ``collective.executors`` logs for every step: "<label> of group <members>: <path>"."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.routes: Counter[tuple[tuple[int, ...], str]] = Counter()
        self.unread: list[str] = []  # records in another format

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        found = _RECORD.match(message)
        if found is None:
            self.unread.append(message)
            return
        members = tuple(int(p) for p in found["members"].replace(",", " ").split())
        self.routes[(members, found["path"])] += 1

    def paths(self) -> Counter[str]:
        """Steps per path name."""
        totals: Counter[str] = Counter()
        for (_, path), count in self.routes.items():
            totals[path] += count
        return totals

    @contextmanager
    def attached(self) -> Iterator[PathCounter]:
        """Listen to the executors' logger at DEBUG level (not propagated) while inside."""
        logger = logging.getLogger(PATH_LOGGER)
        level, propagate = logger.level, logger.propagate
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        logger.addHandler(self)
        try:
            yield self
        finally:
            logger.removeHandler(self)
            logger.setLevel(level)
            logger.propagate = propagate


def local_paths(case: Case, world: int, fuse_below: int, share_below: int) -> list[str]:
    """The path of each step of ``case`` among threads of one process, by the documented limits:
    fused when every input is at most ``fuse_below`` bytes, shared up to ``share_below``, else linked."""
    n = len(case.group_members(world))
    found = []
    for nbytes in case.spec.step_bytes(case, n):
        if fuse_below and nbytes <= fuse_below:
            found.append("fused")
        elif share_below and nbytes <= share_below:
            found.append("shared")
        else:
            found.append("linked")
    return found


def routes(
    cases: Sequence[Case], world: int, local: Sequence[int], path_of: Callable[[Case], list[str]]
) -> Counter[tuple[tuple[int, ...], str]]:
    """The steps one process logs, per (members, path): every step of every case whose group holds
    one of its ``local`` peers (one record per step and process), ``path_of(case)`` giving each
    step's path."""
    expected: Counter[tuple[tuple[int, ...], str]] = Counter()
    for case in cases:
        members = case.group_members(world)
        if set(members) & set(local):
            for path in path_of(case):
                expected[(members, path)] += 1
    return expected


def by_group(world: int, paths: dict[tuple[int, ...], str]) -> Callable[[Case], list[str]]:
    """A ``path_of`` for ``routes`` where the group alone decides the path (``paths[members]``)."""
    return lambda case: [paths[case.group_members(world)]] * case.spec.steps(case)
