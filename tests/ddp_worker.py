"""One process of a data-parallel job (tests/test_ddp.py): GradientSync across real processes.

    python tests/ddp_worker.py VICTIM     (torchrun's variables in the environment)

Every peer syncs mixed-dtype gradients in buckets, step after step. At step 1 peer VICTIM makes
its first bucket ready, prints "MID-STEP" and sleeps until the test kills it. The others print
"LOST <peer> <error type> <peers named>" when their ``wait()`` raises, and exit 3 (4 for any
other error, 0 if the step somehow completes).
"""

from __future__ import annotations

import sys
import time

import numpy as np

import collective as col
from collective.ddp import GradientSync


def params() -> dict[str, np.ndarray]:
    return {
        "layer1.w": np.zeros((64, 64), np.float32),
        "layer1.b": np.zeros(64, np.float64),
        "head.w": np.zeros((10, 64), np.float32),
        "head.b": np.zeros(10, np.float16),
    }


def main() -> int:
    victim = int(sys.argv[1])
    peer = col.init()
    sync = GradientSync(peer, params(), bucket_bytes=1024)
    try:
        for step in range(3):
            grads = {name: np.full(p.shape, peer + step, p.dtype) for name, p in params().items()}
            names = list(reversed(grads))
            if step == 1 and peer == victim:
                for name in sync.buckets[0]:
                    sync.ready(name, grads[name])
                print("MID-STEP", flush=True)
                time.sleep(120)  # (kept: holds the process mid-step) killed here by the test
                return 5
            for name in names:
                sync.ready(name, grads[name])
            synced = sync.wait()
            assert synced is not None
            expected = np.mean([p + step for p in range(col.world_size())])
            assert all(np.allclose(g, expected) and g.dtype == params()[n].dtype for n, g in synced.items())
            print(f"STEP {step} OK", flush=True)
    except col.PeerLostError as exc:
        print(f"LOST {peer} {type(exc).__name__} {sorted(exc.peers)}: {exc}", flush=True)
        return 3
    except col.CollectiveError as exc:
        print(f"OTHER {peer} {type(exc).__name__}: {exc}", flush=True)
        return 4
    col.finish(peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
