"""The flight recorder's counters in Prometheus's format (the optional ``prometheus_client``).

``COLLECTIVE_METRICS_PORT=PORT`` makes each process serve them over HTTP at ``/metrics`` (on PORT
plus its LOCAL_RANK where a launcher sets one, so the processes of a host do not collide), from
the moment its first peer registers. A process that serves metrics of its own registers
``Collector()`` in its registry instead. Every series is labelled with the kind of call, the
algorithm (or the path that ran it), the size class, the group, and the ranks of this process's
peers (``rank``; "0,1" for a process of two peers):

    collective_calls_total            calls ended (completed or failed)
    collective_failed_calls_total     calls failed
    collective_bytes_total            bytes the calls held (their inputs, as agreed)
    collective_call_seconds           a histogram of the calls' times (powers of two of a ns)
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from collective.errors import ConfigError

__all__ = ["PORT_VARIABLE", "Collector", "serve_from_env"]

PORT_VARIABLE = "COLLECTIVE_METRICS_PORT"
LABELS = ("kind", "algorithm", "size_class", "group", "rank")

log = logging.getLogger(__name__)
_served: list[int] = []  # the port this process serves on (once)
_lock = threading.Lock()


class Collector:
    """A prometheus_client collector of this process's ``col.stats()``, read when scraped."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        from collective.trace import RECORDER

        rank = ",".join(map(str, RECORDER.peers))
        calls = CounterMetricFamily("collective_calls", "Collective calls ended", labels=LABELS)
        failed = CounterMetricFamily("collective_failed_calls", "Collective calls failed", labels=LABELS)
        moved = CounterMetricFamily("collective_bytes", "Bytes the collective calls held", labels=LABELS)
        times = HistogramMetricFamily("collective_call_seconds", "Collective call times", labels=LABELS)
        for row in RECORDER.snapshot():
            labels = [row["kind"], row["algorithm"], row["size_class"], row["group"], rank]
            calls.add_metric(labels, row["calls"])
            failed.add_metric(labels, row["failed"])
            moved.add_metric(labels, row["bytes"])
            buckets, total = [], 0
            for bound, count in row["histogram"].items():  # (ascending: bins in order)
                total += count
                buckets.append((bound, total))
            buckets.append(("+Inf", row["calls"]))
            times.add_metric(labels, buckets, row["seconds"])
        yield from (calls, failed, moved, times)


def serve_from_env() -> int | None:
    """Serve this process's metrics where COLLECTIVE_METRICS_PORT asks (once); the port, or None
    where it does not. A bad value, or prometheus_client missing, is a ConfigError; a port in use
    is a warning (the job goes on without metrics)."""
    text = os.environ.get(PORT_VARIABLE, "").strip()
    if not text:
        return None
    local = os.environ.get("LOCAL_RANK", "").strip()
    if not text.isdigit() or not 0 < int(text) < 65536 or (local and not local.isdigit()):
        raise ConfigError(f"{PORT_VARIABLE}={text!r} is not a port (1-65535): set it to a free port")
    port = int(text) + (int(local) if local else 0)
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise ConfigError(
            f"{PORT_VARIABLE} serves metrics with prometheus_client, which is not installed: "
            "pip install prometheus_client (or unset the variable)"
        ) from None
    with _lock:
        if _served:
            return _served[0]
        registry = CollectorRegistry()
        registry.register(Collector())
        try:
            start_http_server(port, registry=registry)
        except OSError as exc:
            log.warning("%s: cannot serve metrics on port %d: %s", PORT_VARIABLE, port, exc.strerror)
            return None
        _served.append(port)
    log.info("collective metrics served on port %d (/metrics)", port)
    return port
