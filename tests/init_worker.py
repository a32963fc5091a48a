"""One process of a job started by a launcher: ``col.init()``, a few collectives, checked results.

Run by tests/test_init.py with torchrun-, Slurm- or Open MPI-style variables, or under
``collective launch``. Prints "OK <rank> <world>" when every result matched its reference.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import collective as col


def send_then_leave(peer: int, how: str, mib: int) -> int:
    """Rank 0 sends ``mib`` MiB to rank 1 and at once finishes, or ends without finish (``how``):
    what it sent must still arrive (it was dropped, or the process crashed at exit)."""
    col.barrier(peer)
    count = mib << 18
    if peer == 0:
        col.send(peer, np.arange(count, dtype=np.float32), dst=1)
        if how == "finish":
            col.finish(peer)
        return 0
    got = col.recv(peer, src=0, timeout=30)
    assert got.shape == (count,) and np.array_equal(got, np.arange(count, dtype=np.float32))
    print(f"RECEIVED {peer}", flush=True)
    col.finish(peer)
    return 0


def the_orchestrator_leaves(peer: int) -> int:
    """Rank 0 (hosting the orchestrator) leaves; ranks 1 and 2 go on in a group of this host through
    the moment they notice: every call completes on both (one of them raised, the other did not)."""
    col.all_reduce(peer, np.ones(1))
    if peer == 0:
        col.finish(peer)
        os._exit(0)  # (at once: a normal exit serves the orchestrator to the others until they finish)
    pair = col.new_group([1, 2])
    for _ in range(400):  # about 5 s: the loss of the orchestrator is noticed in 2-3 s
        assert col.all_reduce(peer, np.ones(1), group=pair)[0] == 2.0
        time.sleep(0.0125)  # (kept: paces the calls across the moment the loss is noticed)
    print(f"PAIR OK {peer}", flush=True)
    col.finish(peer)
    return 0


def late_finish(peer: int) -> int:
    """Rank 0 finishes and its process ends while the others still work, then finish."""
    col.all_reduce(peer, np.ones(1))
    if peer != 0:
        time.sleep(4)  # (kept: a window, not an order) a lost orchestrator would be noticed in 2-3 s
        assert col.all_reduce(peer, np.ones(1), group=col.new_group([1, 2]))[0] == 2.0
    print(f"LATE OK {peer}", flush=True)
    col.finish(peer)
    return 0


def rank_0_crashes(peer: int) -> int:
    """Rank 0 raises after one collective, without finish(): the others learn it at once."""
    col.all_reduce(peer, np.ones(1))
    if peer == 0:
        raise RuntimeError("rank 0 crashed")
    try:
        col.all_reduce(peer, np.ones(1))
    except col.PeerLostError as exc:
        print(f"LOST {peer} {exc}", flush=True)
    return 0


def main() -> int:
    peer = col.init()
    if sys.argv[1:] == ["late_finish"]:
        return late_finish(peer)
    if sys.argv[1:] == ["rank_0_crashes"]:
        return rank_0_crashes(peer)
    if sys.argv[1:] == ["orchestrator_leaves"]:
        return the_orchestrator_leaves(peer)
    if len(sys.argv) > 1:
        return send_then_leave(peer, sys.argv[1], int(sys.argv[2]))
    world = col.world_size()
    everyone = [np.arange(6, dtype=np.float64) * (p + 1) for p in range(world)]
    mine = everyone[peer]
    np.testing.assert_array_equal(col.all_reduce(peer, mine), sum(everyone))
    np.testing.assert_array_equal(col.all_gather(peer, mine), np.stack(everyone))
    np.testing.assert_array_equal(col.broadcast(peer, mine if peer == world - 1 else None), everyone[-1])
    large = np.full(1 << 16, peer, np.float32)  # 256 KiB: the data service, not the call exchange
    np.testing.assert_array_equal(col.all_reduce(peer, large, "max"), np.full(1 << 16, world - 1))
    col.barrier(peer)
    print(f"OK {peer} {world} {os.environ.get('RANK', '-')}", flush=True)
    col.finish(peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
