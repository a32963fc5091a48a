"""``collective trace analyze DIR``: every process's flight recorder dump merged, the culprit named.

What it says, first things first:

1. who never entered the call the others wait in: for each group, the newest call some peer is
   still in (or failed in) is the call waited in; a member whose newest call on the group is older
   never entered it ("peer 3 never entered all_reduce #512 of group world; its last call was
   broadcast #511 at train.py:88"), and a member no dump holds left none (its process may have died);
2. the first call the peers of a group disagree on (kind, op, shapes, dtypes);
3. stragglers: a peer whose calls start later than the group's first arrival by more than
   STRAGGLER_FACTOR times the median peer's lateness and more than STRAGGLER_FLOOR_S, over at
   least STRAGGLER_CALLS calls (fewer, or a few milliseconds, are the scheduler's doing);
4. per peer: its calls, how many completed and failed, and its last call.

Exit status 0 when all is consistent, 1 when it found a culprit, a disagreement, a straggler or a
failed call, 2 when there is nothing to read. Dumps are read whatever their number: a peer that died
without one is named as such.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from collective.trace.recorder import FORMAT, VERSION

__all__ = [
    "STRAGGLER_CALLS",
    "STRAGGLER_FACTOR",
    "STRAGGLER_FLOOR_S",
    "Dump",
    "Report",
    "analyze",
    "load_dumps",
    "main",
    "runs",
]

STRAGGLER_FACTOR = 4.0
# A peer later by less than this, or over fewer calls, is no straggler: threads and processes of a
# busy machine are scheduled milliseconds apart (seen: 3-4 ms over 1-2 calls of a healthy job).
STRAGGLER_FLOOR_S = 0.010
STRAGGLER_CALLS = 3
MAX_DUMP_BYTES = 256 << 20


@dataclass
class Dump:
    path: str
    pid: int
    host: str
    job: str
    peers: list[int]
    world: int
    reason: str
    entries: list[dict[str, Any]]
    serial: int = 0  # which of its process's jobs (COLLECTIVE_TRACE_EVERY_JOB dumps one per job)
    dumped_ns: int = 0


@dataclass
class Report:
    culprits: list[str] = field(default_factory=list)  # who never entered, who left no dump
    disagreements: list[str] = field(default_factory=list)
    stragglers: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)

    @property
    def consistent(self) -> bool:
        return not (self.culprits or self.disagreements or self.stragglers or self.failures)

    def lines(self) -> list[str]:
        out: list[str] = []
        for title, items in (
            ("never entered the call the others wait in", self.culprits),
            ("first disagreeing call", self.disagreements),
            ("stragglers", self.stragglers),
            ("failed calls", self.failures),
        ):
            if items:
                out.append(f"# {title}")
                out.extend(f"  {item}" for item in items)
        out.append("# per peer" if out else "# consistent: every peer made the same calls and none failed")
        if out[-1] != "# per peer":
            out.append("# per peer")
        out.extend(f"  {line}" for line in self.summary)
        return out


def load_dumps(folder: str) -> tuple[list[Dump], list[str]]:
    """Every dump in ``folder`` (its *.json files) and a problem per file that is not one."""
    dumps: list[Dump] = []
    problems: list[str] = []
    names = sorted(name for name in os.listdir(folder) if name.endswith(".json"))
    for name in names:
        path = os.path.join(folder, name)
        try:
            if os.path.getsize(path) > MAX_DUMP_BYTES:
                raise ValueError("larger than a dump can be")
            with open(path, encoding="utf-8") as file:
                document = json.load(file)
            if isinstance(document, dict) and "traceEvents" in document:
                continue  # (a Chrome trace written beside the dumps: collective bench --trace)
            if document.get("schema") != FORMAT or document.get("version") != VERSION:
                raise ValueError(f"not a flight recorder dump of version {VERSION}")
            dumps.append(
                Dump(
                    path,
                    int(document["pid"]),
                    str(document["host"]),
                    str(document["job"]),
                    [int(p) for p in document["peers"]],
                    int(document["world"]),
                    str(document.get("reason", "")),
                    [e for e in document["entries"] if isinstance(e, dict)],
                    int(document.get("job_serial", 0)),
                    int(document.get("dumped_ns", 0)),
                )
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"{name}: {exc}")
    return dumps, problems


def _where(entry: dict[str, Any]) -> str:
    frames = entry.get("frames") or [{}]
    frame = frames[0]
    return f"{frame.get('filename', '-')}:{frame.get('line', 0)}"


def _call(entry: dict[str, Any]) -> str:
    return f"{entry['kind']} #{entry['collective_seq_id']}"


def _who(peers: Sequence[int]) -> str:
    return ("peer " if len(peers) == 1 else "peers ") + ", ".join(map(str, peers))


def analyze(dumps: list[Dump]) -> Report:
    """The verdicts on these dumps (see the module's docstring)."""
    report = Report()
    dumped = {peer for dump in dumps for peer in dump.peers}
    by_group: dict[str, dict[int, list[dict[str, Any]]]] = {}
    ranks_of: dict[str, list[int]] = {}
    for dump in dumps:
        for entry in dump.entries:
            if entry.get("is_p2p"):
                continue  # (sends and receives: in the per-peer summary, not in a group's calls)
            group = str(entry.get("pg_id"))
            ranks_of.setdefault(group, [int(r) for r in entry.get("ranks", [])])
            by_group.setdefault(group, {}).setdefault(int(entry["peer"]), []).append(entry)
    for group, peers in sorted(by_group.items()):
        for entries in peers.values():
            entries.sort(key=lambda e: (e["collective_seq_id"], e["record_id"]))
        _never_entered(report, group, ranks_of[group], peers, dumped)
        _disagreement(report, group, peers)
        _stragglers(report, group, ranks_of[group], peers)
    for dump in dumps:
        for peer in dump.peers:
            mine = [e for peers in by_group.values() for e in peers.get(peer, [])]
            mine += [e for e in dump.entries if e.get("is_p2p") and e["peer"] == peer]
            mine.sort(key=lambda e: e["time_created_ns"])
            failed = [e for e in mine if e.get("state") == "failed"]
            if failed:
                first = failed[0]
                where = f"{_call(first)} of group {first['pg_id']} at {_where(first)}"
                report.failures.append(f"peer {peer}: {where}: {first.get('error')}")
            last = (
                f"last {_call(mine[-1])} ({mine[-1]['state']}) at {_where(mine[-1])}" if mine else "no calls"
            )
            done = sum(e.get("state") == "completed" for e in mine)
            report.summary.append(
                f"peer {peer} (pid {dump.pid} on {dump.host}): {len(mine)} calls recorded, {done} completed, "
                f"{len(failed)} failed; {last}"
            )
    return report


def _never_entered(
    report: Report, group: str, ranks: list[int], peers: dict[int, list[dict[str, Any]]], dumped: set[int]
) -> None:
    open_calls = [e for entries in peers.values() for e in entries if e.get("state") != "completed"]
    if not open_calls:
        return
    waited = max(open_calls, key=lambda e: e["collective_seq_id"])
    seq = waited["collective_seq_id"]
    call = f"{waited['kind']} #{seq} of group {group}"
    for peer in ranks:
        entries = peers.get(peer)
        if peer not in dumped:
            report.culprits.append(
                f"peer {peer} left no dump (did its process die?); the others wait in {call}"
            )
        elif not entries:
            report.culprits.append(f"peer {peer} never entered {call}; it made no call on this group")
        elif entries[-1]["collective_seq_id"] < seq:
            last = entries[-1]
            report.culprits.append(
                f"peer {peer} never entered {call}; its last call was {_call(last)} at {_where(last)} "
                f"({last['state']})"
            )


def _disagreement(report: Report, group: str, peers: dict[int, list[dict[str, Any]]]) -> None:
    by_seq: dict[int, dict[int, dict[str, Any]]] = {}
    for peer, entries in peers.items():
        for entry in entries:
            by_seq.setdefault(entry["collective_seq_id"], {})[peer] = entry
    for seq in sorted(by_seq):
        calls = by_seq[seq]
        if len(calls) < 2:
            continue
        stated: dict[tuple[Any, ...], list[int]] = {}
        for peer, entry in sorted(calls.items()):
            sizes = tuple(map(tuple, entry.get("input_sizes") or []))
            what = (entry["kind"], entry.get("op"), sizes, tuple(entry.get("input_dtypes") or []))
            stated.setdefault(what, []).append(peer)
        if len({what[:2] for what in stated}) > 1 or len({what for what in stated if what[2]}) > 1:
            parts = [
                f"{_who(who)} called {kind}{'' if op is None else ' ' + op} {list(map(list, sizes))} "
                f"{'/'.join(dtypes) or '-'} at {_where(calls[who[0]])}"
                for (kind, op, sizes, dtypes), who in stated.items()
            ]
            report.disagreements.append(f"#{seq} of group {group}: " + "; ".join(parts))
            return


def _stragglers(report: Report, group: str, ranks: list[int], peers: dict[int, list[dict[str, Any]]]) -> None:
    late: dict[int, list[float]] = {peer: [] for peer in peers}
    by_seq: dict[int, dict[int, int]] = {}
    for peer, entries in peers.items():
        for entry in entries:
            by_seq.setdefault(entry["collective_seq_id"], {})[peer] = entry["time_created_ns"]
    for arrivals in by_seq.values():
        if len(arrivals) == len(ranks) > 1:
            first = min(arrivals.values())
            for peer, when in arrivals.items():
                late[peer].append((when - first) / 1e9)
    medians = {
        peer: statistics.median(values) for peer, values in late.items() if len(values) >= STRAGGLER_CALLS
    }
    if len(medians) < 2:
        return
    for peer, lateness in sorted(medians.items()):
        others = statistics.median([m for p, m in medians.items() if p != peer])
        if lateness > max(STRAGGLER_FACTOR * others, STRAGGLER_FLOOR_S):
            report.stragglers.append(
                f"peer {peer} of group {group} enters its calls {lateness * 1e3:.1f} ms after the first peer "
                f"(median over {len(late[peer])} calls; the others {others * 1e3:.1f} ms)"
            )


def main(folder: str, out: IO[str]) -> int:
    if not os.path.isdir(folder):
        print(f"collective trace analyze: no directory {folder}", file=out)
        return 2
    dumps, problems = load_dumps(folder)
    for problem in problems:
        print(f"# skipped {problem}", file=out)
    if not dumps:
        print(f"collective trace analyze: no flight recorder dumps in {folder}", file=out)
        return 2
    status = 0
    every = runs(dumps)
    for run in every:
        calls = sum(len(d.entries) for d in run)
        which = f"job {run[0].job}"
        if sum(other[0].job == run[0].job for other in every) > 1:
            which += f", its job #{run[0].serial} in each process"
        print(f"# {len(run)} dumps of {which} ({calls} calls)", file=out)
        report = analyze(run)
        for line in report.lines():
            print(line, file=out)
        status = max(status, 0 if report.consistent else 1)
    return status


def runs(dumps: list[Dump]) -> list[list[Dump]]:
    """The dumps by job, each analysed apart: by name, and where a process left several dumps of
    one name (a job after another, COLLECTIVE_TRACE_EVERY_JOB), by its number in each process
    (processes that make the same jobs in the same order number them alike). Of several dumps of
    one process and job (SIGUSR1, then a failure), the newest."""
    found: dict[tuple[str, int], dict[int, Dump]] = {}
    for job in sorted({d.job for d in dumps}):
        mine = [d for d in dumps if d.job == job]
        pids = [d.pid for d in mine]
        apart = len(set(pids)) < len(pids) and len({d.serial for d in mine}) > 1
        for dump in mine:
            newest = found.setdefault((job, dump.serial if apart else 0), {})
            if dump.pid not in newest or newest[dump.pid].dumped_ns < dump.dumped_ns:
                newest[dump.pid] = dump
    return [list(run.values()) for _, run in sorted(found.items())]
