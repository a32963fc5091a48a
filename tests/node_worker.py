"""A node of a multi-node test job: run as a process by tests/test_multinode.py.

Usage: python tests/node_worker.py MODE [ARG]   (the job comes from COLLECTIVE_* variables)

Every node knows every peer's input (a function of the peer id), so it checks each result
against a reference it computes itself. Output lines: "OK <collectives>" at the end, or
"ERROR <class> <message>" per failing peer (exit status 3), "READY" when a loop has started.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from typing import Any

import numpy as np

import collective as col

OPS = ["sum", "mean", "max", "min", "prod"]
_print_lock = threading.Lock()


def say(line: str) -> None:
    """One whole line on stdout, never interleaved with another thread's."""
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


ELEMENTS = [0, 1, 2, 17, 1000, (3 << 20) // 8]  # 0, fewer than nodes, ..., a few MiB


def data(peer: int, length: int, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * peer + salt)
    return rng.integers(-3, 4, size=length).astype(np.float64)


def reference(arrays: list[np.ndarray], op: str) -> np.ndarray:
    ufunc = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    total = arrays[0].copy()
    for other in arrays[1:]:
        ufunc(total, other, out=total)
    return total / len(arrays) if op == "mean" else total


def matrix(peer: int, world: int) -> int:
    """Every op for all_reduce, sum and max reduce at every root, broadcast from every root."""
    count = 0
    for salt, length in enumerate(ELEMENTS):
        everyone = [data(p, length, salt) for p in range(world)]
        mine = everyone[peer]
        for op in OPS:
            got = col.all_reduce(peer, mine, op)
            np.testing.assert_allclose(
                got, reference(everyone, op), rtol=1e-12, err_msg=f"all_reduce {op} {length}"
            )
            count += 1
        for root in range(world):
            for op in ("sum", "max"):
                got = col.reduce(peer, mine, op, root=root)
                if peer == root:
                    np.testing.assert_allclose(
                        got, reference(everyone, op), err_msg=f"reduce {op} {length} root {root}"
                    )
                else:
                    assert got is None
                count += 1
            got = col.broadcast(peer, mine if peer == root else None)
            np.testing.assert_array_equal(got, everyone[root], err_msg=f"broadcast {length} root {root}")
            count += 1
    return count


def loop(peer: int, world: int) -> int:
    """All-reduce 1 MiB until something breaks; print READY once running."""
    x = np.ones(1 << 17)
    for i in range(1_000_000):
        col.all_reduce(peer, x)
        if i == 2 and peer == 0:
            say("READY")
    return 0


def mismatch(peer: int, world: int, how: str) -> int:
    """One collective where node 0's peers call differently from the others, then a good one."""
    odd = peer < world // 2  # the first node's peers
    x = np.zeros(5 if (how == "shape" and odd) else 4, np.float32 if (how == "dtype" and odd) else np.float64)
    if how == "collective" and odd:
        col.reduce(peer, x)
    elif how == "op":
        col.all_reduce(peer, x, "max" if odd else "sum")
    elif how == "root":
        col.reduce(peer, x, root=0 if odd else 1)
    else:
        col.all_reduce(peer, x)
    return 1


def crash(peer: int, world: int) -> int:
    """Node 0 fails inside the global step with a plain exception while its process lives on."""
    if peer == 0:
        import collective.transport.zmq_link

        def broken(*args: Any) -> None:
            raise MemoryError("simulated")

        collective.transport.zmq_link.combine = broken  # type: ignore[assignment]
    col.all_reduce(peer, np.ones(1 << 18))  # 2 MiB: moved by the Ring over ZeroMQ
    return 1


def until(peer: int, world: int, stop_file: str, pause: str = "0.1") -> int:
    """Checked all_reduces (small and 1 MiB) until every node sees ``stop_file``; "READY <peer>" after one.

    The nodes decide together (an all_reduce of whether each sees the file), so they stop at the
    same step. Between rounds each node idles (no collective) for ``pause`` seconds, or until the
    file appears: after it appears, one more checked round runs.
    """
    count = 0
    for salt in itertools.count():
        for length in (5, 1 << 17):
            everyone = [data(p, length, salt) for p in range(world)]
            got = col.all_reduce(peer, everyone[peer])
            np.testing.assert_array_equal(got, reference(everyone, "sum"), err_msg=f"round {salt}")
            count += 1
        if salt == 0:
            say(f"READY {peer}")
        stop = col.all_reduce(peer, np.array([float(os.path.exists(stop_file))]))
        count += 1
        if stop[0] > 0:
            return count
        idle_until = time.monotonic() + float(pause)
        while time.monotonic() < idle_until and not os.path.exists(stop_file):
            time.sleep(min(0.05, float(pause)))
    return count


MODES = {"matrix": matrix, "loop": loop, "mismatch": mismatch, "crash": crash, "until": until}


def main() -> int:
    mode = sys.argv[1]
    extra = sys.argv[2:]
    config = col.CollectiveConfig.from_env()
    peers = col.peer_ids_from_env()
    world = config.num_devices * (config.num_nodes or 1)
    results: dict[int, Any] = {}

    def run(peer: int) -> None:
        try:
            col.register(peer, "cpu", config)
            started = time.monotonic()
            try:
                results[peer] = MODES[mode](peer, world, *extra)
            except col.CollectiveError as exc:
                results[peer] = exc
                say(f"ERROR {type(exc).__name__} {time.monotonic() - started:.2f} {exc}")
            if mode == "mismatch":  # the job must still work after a mismatch
                assert col.all_reduce(peer, np.ones(3))[0] == world
            col.finish(peer)
        except BaseException as exc:
            results[peer] = exc
            say(f"ERROR {type(exc).__name__} - {exc}")

    threads = [threading.Thread(target=run, args=(p,)) for p in peers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failures = [r for r in results.values() if isinstance(r, BaseException)]
    if failures or len(results) != len(peers):
        return 3
    say(f"OK {sum(results.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
