"""``--plot FILE.png``: bus bandwidth and time against size, one line per strategy, one panel per op."""

from __future__ import annotations

from collections.abc import Sequence

from collective.bench.sweep import Row

__all__ = ["MISSING", "plot_rows"]

MISSING = "--plot needs matplotlib: pip install 'collective[plot]' (or pip install matplotlib)"


def plot_rows(rows: Sequence[Row], path: str, title: str) -> None:
    """Write the figure to ``path``; raises ImportError (message: MISSING) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(MISSING) from None
    ops = list(dict.fromkeys(row.case.op for row in rows))
    figure, axes = plt.subplots(2, len(ops), figsize=(5 * len(ops), 7), squeeze=False)
    for column, op in enumerate(ops):
        bandwidth, latency = axes[0][column], axes[1][column]
        for strategy in dict.fromkeys(r.case.strategy for r in rows if r.case.op == op):
            # one point per size: the first root's row (reduce and broadcast may sweep every root)
            points: dict[int, Row] = {}
            for row in rows:
                if row.case.op == op and row.case.strategy == strategy:
                    points.setdefault(row.case.size, row)
            sizes = sorted(size for size in points if size > 0)  # (a log axis has no 0)
            if not sizes:
                continue
            style = "--" if points[sizes[0]].case.system in ("trivial", "gloo") else "-"
            bandwidth.plot(
                sizes, [points[s].busbw for s in sizes], style, marker="o", markersize=3, label=strategy
            )
            latency.plot(
                sizes, [points[s].time_us for s in sizes], style, marker="o", markersize=3, label=strategy
            )
        bandwidth.set_title(op)
        bandwidth.set_ylabel("bus bandwidth (GB/s)")
        latency.set_ylabel("time (us)")
        latency.set_yscale("log")
        for axis in (bandwidth, latency):
            axis.set_xscale("log", base=2)
            axis.set_xlabel("size per peer (bytes)")
            axis.grid(True, which="both", alpha=0.3)
            if axis.get_legend_handles_labels()[0]:  # (no line when every size is 0)
                axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
