"""nccl-tests style tables, the closing summary and the JSON record."""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Sequence
from typing import IO, Any

import numpy as np

from collective.bench.ops import REDUCING, ROOTED
from collective.bench.sweep import Row

__all__ = ["format_size", "parse_size", "print_summary", "print_table", "write_json"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'8', '1K', '64M', '1G' (optionally with a trailing B) -> bytes; raises ValueError."""
    token = text.strip().upper().removesuffix("B")
    unit = token[-1:] if token[-1:] in ("K", "M", "G") else ""
    number = token[: len(token) - len(unit)]
    if not number.isdigit():
        raise ValueError(f"invalid size {text!r}: use a number with an optional K, M or G suffix")
    return int(number) * _UNITS[unit]


def format_size(size: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor} {unit}"
    return f"{size} B"


HEADER = (
    f"{'size (B)':>12} {'count':>11} {'type':>9} {'redop':>6} {'root':>5} {'time (us)':>11} "
    f"{'algbw (GB/s)':>13} {'busbw (GB/s)':>13} {'#wrong':>7}"
)


def print_table(
    rows: Sequence[Row],
    baseline: dict[tuple[str, int, int], Row] | None,
    out: IO[str],
    link: float | None = None,
) -> None:
    """One table (rows of one op x strategy); ``baseline`` adds a speedup column (baseline time /
    ours), ``link`` (bytes per second) a ``link %`` column: bus bandwidth over the link's rate."""
    if not rows:
        return
    case = rows[0].case
    what = {
        "trivial": "trivial baseline",
        "gloo": "torch.distributed gloo",
        "torch": "torch.distributed backend collective",
    }.get(case.system, f"strategy {case.strategy}")
    result = "new result per call" if case.alloc else "out= buffer"
    sources = sorted({row.figures for row in rows if row.figures and row.figures != "-"})
    figures = f"  (figures: {', '.join(sources)})" if sources else ""
    print(f"\n# {case.op}  {what}  peers={case.peers}  dtype={case.dtype}  ({result}){figures}", file=out)
    versus = next(iter(baseline.values())).case.system if baseline else ""
    picked = any(row.picked for row in rows)
    extra = (f" {'link %':>7}" if link else "") + (f"  speedup vs {versus}" if baseline else "")
    extra += f"  {'picked':<14}" if picked else ""
    print(HEADER + extra, file=out)
    for row in rows:
        c = row.case
        redop = c.redop if c.op in REDUCING else "-"
        root = str(c.root) if c.op in ROOTED else "-"
        line = (
            f"{c.size:>12} {row.count:>11} {c.dtype:>9} {redop:>6} {root:>5} {row.time_us:>11.1f} "
            f"{row.algbw:>13.3f} {row.busbw:>13.3f} {row.wrong:>7}"
        )
        if link:
            line += f" {100 * row.busbw * 1e9 / link:>7.1f}"
        if baseline:
            base = baseline.get((c.op, c.size, c.root))
            line += f"  {base.time_us / row.time_us:>18.2f}x" if base and row.time_us > 0 else f"  {'-':>19}"
        if picked:
            line += f"  {row.picked or '-':<14}"
        print(line, file=out)


def print_summary(rows: Sequence[Row], out: IO[str], fused_below: int) -> None:
    """Per op, the fastest strategy for each run of consecutive sizes it wins.

    Sizes up to ``fused_below`` complete in one round whatever the strategy (at the rendezvous
    in one process, inside the call exchange across nodes), so they are reported as such instead
    of naming a winner decided by noise.
    """
    ours = [r for r in rows if r.case.system == "collective" and r.case.strategy != "auto"]
    if not ours:
        return
    print("\n# Fastest fixed strategy (lowest median time) by size", file=out)
    for op in dict.fromkeys(r.case.op for r in ours):
        by_size: dict[int, Row] = {}
        for row in (r for r in ours if r.case.op == op):
            if row.case.size not in by_size or row.time_us < by_size[row.case.size].time_us:
                by_size[row.case.size] = row
        runs: list[tuple[int, int, str]] = []
        for size in sorted(by_size):
            winner = "fast path (any strategy)" if size <= fused_below else by_size[size].case.strategy
            if runs and runs[-1][2] == winner:
                runs[-1] = (runs[-1][0], size, winner)
            else:
                runs.append((size, size, winner))
        ranges = "; ".join(
            f"{format_size(lo)}{'' if lo == hi else ' .. ' + format_size(hi)}: {winner}"
            for lo, hi, winner in runs
        )
        print(f"#   {op}: {ranges}", file=out)


AUTO_WITHIN = 1.10  # auto's target: at most 10% over the fastest fixed strategy ...
AUTO_SMALL_US = (100.0, 20.0)  # ... or 20 us, where every strategy takes under 100 us
ONE_PATH = ("fused", "shared", "with the calls", "shm")  # every strategy runs these alike: no choice


def print_auto_check(rows: Sequence[Row], out: IO[str]) -> tuple[int, int]:
    """Per op and size, auto's time beside the fastest and slowest fixed strategy's, and whether
    it met its target (AUTO_WITHIN, AUTO_SMALL_US). Where auto ran a path every strategy runs
    alike (ONE_PATH: the same code, so the differences are noise), that is said instead of a
    verdict; where auto ran the fastest fixed strategy's schedule but timed more than 10% over it,
    "same schedule" (its choice was the best; the gap is noise between rows). Returns (sizes met or
    "same schedule", sizes where a schedule was chosen)."""
    ours = [r for r in rows if r.case.system == "collective"]
    autos = {(r.case.op, r.case.size, r.case.root): r for r in ours if r.case.strategy == "auto"}
    fixed: dict[tuple[str, int, int], list[Row]] = {}
    for row in ours:
        if row.case.strategy != "auto":
            fixed.setdefault((row.case.op, row.case.size, row.case.root), []).append(row)
    compared = [(where, auto, fixed[where]) for where, auto in autos.items() if where in fixed]
    if not compared:
        return 0, 0
    print(
        "\n# auto beside the fixed strategies (target: within 10% of the fastest, or 20 us where all are",
        file=out,
    )
    print("# under 100 us)", file=out)
    print(
        f"{'op':>15} {'size (B)':>11} {'auto (us)':>10} {'picked':<14} {'fastest':<12} {'(us)':>10} "
        f"{'slowest (us)':>12} {'auto/fastest':>12}  target",
        file=out,
    )
    met = chosen = 0
    for (op, size, _), auto, others in compared:
        best = min(others, key=lambda r: r.time_us)
        worst = max(r.time_us for r in others)
        small = worst < AUTO_SMALL_US[0] and auto.time_us - best.time_us <= AUTO_SMALL_US[1]
        ok = auto.time_us <= best.time_us * AUTO_WITHIN or small
        if auto.picked in ONE_PATH:
            verdict = "one path for all"
        else:
            chosen += 1
            same = auto.picked == best.case.strategy  # (then a gap is the rows' noise, not the choice)
            met += ok or same
            verdict = "met" if ok else "same schedule" if same else "MISSED"
            verdict += " (the slowest)" if auto.time_us > worst and not same else ""
        print(
            f"{op:>15} {size:>11} {auto.time_us:>10.1f} {auto.picked or '-':<14} {best.case.strategy:<12} "
            f"{best.time_us:>10.1f} {worst:>12.1f} {auto.time_us / best.time_us:>12.2f}  {verdict}",
            file=out,
        )
    print(
        f"# auto met its target at {met} of the {chosen} sizes where it chose a schedule "
        f"({len(compared) - chosen} ran one path for every strategy)",
        file=out,
    )
    return met, chosen


def machine() -> dict[str, Any]:
    import os

    import msgpack
    import zmq

    import collective

    return {
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgpack": ".".join(map(str, msgpack.version)),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "collective": collective.__version__,
    }


def write_json(path: str, rows: Sequence[Row], argv: Sequence[str]) -> None:
    record = {"command": list(argv), "machine": machine(), "rows": [row.as_dict() for row in rows]}
    with open(path, "w") as handle:
        json.dump(record, handle, indent=2)
        handle.write("\n")
