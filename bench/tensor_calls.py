"""What a torch tensor costs a direct call, against the same call with a numpy array.

    python -m collective.bench.tensor_calls                  # 2 and 4 thread peers, 8 B all_reduce
    python -m collective.bench.tensor_calls --peers 4 --bytes 1024 --rounds 9

Thread peers of one process call ``all_reduce`` on float32 arrays of ``--bytes`` bytes: numpy
arrays and CPU torch tensors, each with a new result per call and with ``out=``. Every round
times each variant in turn (a barrier, then ``--calls`` calls back to back, per call time of peer
0); the table reports the median over rounds and the extra time torch costs over numpy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from collective.config import CollectiveConfig
from collective.runtime import Runtime

__all__ = ["main", "measure"]

VARIANTS = ("numpy", "torch", "numpy out=", "torch out=")


def measure(peers: int, size: int, rounds: int, calls: int) -> dict[str, list[float]]:
    """Microseconds per call of peer 0, per variant, one figure per round."""
    import torch

    count = max(1, size // 4)
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    failures: list[BaseException] = []
    with Runtime() as runtime:
        config = CollectiveConfig(num_devices=peers, timeout=120)

        def peer(peer_id: int) -> None:
            try:
                runtime.register(peer_id, "cpu", config)
                x, t = np.ones(count, np.float32), torch.ones(count)
                out_x, out_t = np.empty(count, np.float32), torch.empty(count)
                variants: dict[str, Callable[[], Any]] = {
                    "numpy": lambda: runtime.all_reduce(peer_id, x),
                    "torch": lambda: runtime.all_reduce(peer_id, t),
                    "numpy out=": lambda: runtime.all_reduce(peer_id, x, out=out_x),
                    "torch out=": lambda: runtime.all_reduce(peer_id, t, out=out_t),
                }
                for _ in range(rounds):
                    for name, call in variants.items():
                        for _ in range(calls // 10):
                            call()
                        runtime.barrier(peer_id)
                        started = time.perf_counter()
                        for _ in range(calls):
                            call()
                        if peer_id == 0:
                            results[name].append((time.perf_counter() - started) / calls * 1e6)
                runtime.finish(peer_id)
            except BaseException as exc:
                failures.append(exc)
                runtime.reset()

        threads = [threading.Thread(target=peer, args=(p,), daemon=True) for p in range(peers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if failures:
        raise failures[0]
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collective.bench.tensor_calls", description=__doc__)
    parser.add_argument(
        "--peers", type=int, action="append", help="thread peers (repeatable; default 2 and 4)"
    )
    parser.add_argument("--bytes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args(argv)
    print(f"# all_reduce of {args.bytes} B, us per call (median of {args.rounds} rounds of {args.calls})")
    header = ("peers", 5), ("numpy", 8), ("torch", 8), ("extra", 7), ("numpy out=", 11), ("torch out=", 11)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'extra':>7}")
    for peers in args.peers or [2, 4]:
        medians = {
            k: statistics.median(v) for k, v in measure(peers, args.bytes, args.rounds, args.calls).items()
        }
        print(
            f"{peers:>5} {medians['numpy']:>8.1f} {medians['torch']:>8.1f} "
            f"{medians['torch'] - medians['numpy']:>+7.1f} {medians['numpy out=']:>11.1f} "
            f"{medians['torch out=']:>11.1f} {medians['torch out='] - medians['numpy out=']:>+7.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
