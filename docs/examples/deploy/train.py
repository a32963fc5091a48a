"""One process per device, started by any launcher: init() reads its variables (Slurm's,
torchrun's, Open MPI's, collective launch's) and meets the others."""

import numpy as np

import collective as col

rank = col.init()
world = col.world_size()
grad = np.full(1000, float(rank), np.float32)  # (a gradient that differs per process)
mean = col.all_reduce(rank, grad, op="mean")
assert np.allclose(mean, (world - 1) / 2), mean[:4]
if rank == 0:
    print(f"all_reduce over {world} processes: mean {mean[0]:.2f}", flush=True)
col.finish(rank)
