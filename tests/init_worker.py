"""One process of a job started by a launcher: ``col.init()``, a few collectives, checked results.

Run by tests/test_init.py with torchrun-, Slurm- or Open MPI-style variables, or under
``collective launch``. Prints "OK <rank> <world>" when every result matched its reference.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import collective as col


def main() -> int:
    peer = col.init()
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
