"""``collective trace chrome DIR -o trace.json``: the dumps as a Chrome trace (opens in Perfetto,
https://ui.perfetto.dev, or chrome://tracing): a process per dumped process, a track per peer, a
slice per call (its kind and number, bytes, path, algorithm, group, state, caller), and an arrow
(a flow) from each send to the receive that took it."""

from __future__ import annotations

import json
from typing import Any

from collective.trace.analyze import Dump

__all__ = ["chrome_trace", "write"]


def chrome_trace(dumps: list[Dump]) -> dict[str, Any]:
    """The Chrome trace-event document of ``dumps``; times in microseconds from the first call."""
    starts = [e["time_created_ns"] for d in dumps for e in d.entries]
    origin = min(starts) if starts else 0
    events: list[dict[str, Any]] = []
    for dump in dumps:
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": dump.pid,
                "args": {"name": f"{dump.host} pid {dump.pid}"},
            }
        )
        for peer in dump.peers:
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": dump.pid,
                    "tid": peer,
                    "args": {"name": f"peer {peer}"},
                }
            )
        ended = max((e["time_created_ns"] for e in dump.entries), default=origin)
        for entry in dump.entries:
            end = entry.get("time_discovered_completed_ns") or ended
            frame = (entry.get("frames") or [{}])[0]
            events.append(
                {
                    "name": f"{entry['kind']} #{entry['collective_seq_id']}",
                    "cat": entry.get("path") or "collective",
                    "ph": "X",
                    "ts": (entry["time_created_ns"] - origin) / 1e3,
                    "dur": max(end - entry["time_created_ns"], 0) / 1e3,
                    "pid": dump.pid,
                    "tid": int(entry["peer"]),
                    "args": {
                        "group": entry.get("pg_id"),
                        "bytes": entry.get("bytes"),
                        "algorithm": entry.get("algorithm"),
                        "state": entry.get("state"),
                        "error": entry.get("error"),
                        "caller": f"{frame.get('filename', '-')}:{frame.get('line', 0)}",
                    },
                }
            )
    events += _flows(dumps, origin)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _flows(dumps: list[Dump], origin: int) -> list[dict[str, Any]]:
    """A flow from each send's slice to its receive's: the n-th send from a peer to another with a
    tag met the n-th receive of that pair and tag (a receive from any peer is matched by none)."""
    sends: dict[tuple[Any, ...], tuple[Dump, dict[str, Any]]] = {}
    receives: dict[tuple[Any, ...], tuple[Dump, dict[str, Any]]] = {}
    for dump in dumps:
        for entry in dump.entries:
            if entry.get("is_p2p") and entry.get("state") == "completed":
                key = (*entry["ranks"], entry.get("tag"), entry["collective_seq_id"])
                (sends if entry["kind"] == "send" else receives)[key] = (dump, entry)
    flows: list[dict[str, Any]] = []
    for number, key in enumerate(sorted(set(sends) & set(receives), key=str)):
        for phase, (dump, entry) in (("s", sends[key]), ("f", receives[key])):
            at = entry["time_created_ns"] if phase == "s" else entry["time_discovered_completed_ns"] - 1
            flow = {"name": "p2p", "cat": "p2p", "ph": phase, "id": number, "pid": dump.pid}
            flow.update(tid=int(entry["peer"]), ts=(at - origin) / 1e3)
            if phase == "f":
                flow["bp"] = "e"  # (bound to the receive's slice, which encloses its end)
            flows.append(flow)
    return flows


def write(dumps: list[Dump], path: str) -> int:
    """Write the trace of ``dumps`` to ``path``; the number of calls in it."""
    document = chrome_trace(dumps)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(document, file)
    return sum(1 for event in document["traceEvents"] if event["ph"] == "X")
