"""A worker torchrun starts (tests/test_rendezvous.py): its agents met through the orchestrator
(``--rdzv-backend collective``), and so does it, with nothing else to meet at.

The first local worker of each node joins through ``col.init()`` and torch then uses its peer; the
other through ``init_process_group("collective")``'s own store. Each prints "ROUND <job> <rank>
<world> <sum>" after an all_reduce; then it ends once the file FINISH (argv[1]) is there and the
world is whole (4), or else waits in barriers until a peer is lost or torchrun restarts it.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import collective as col
import collective.torch  # (the backend)

if os.environ["LOCAL_RANK"] == "0":
    col.init()
dist.init_process_group("collective")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"ROUND {os.environ['COLLECTIVE_JOB']} {rank} {world} {total.item():g}", flush=True)
while not (world == 4 and os.path.exists(sys.argv[1])):
    dist.barrier()  # (raises once a peer is lost)
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
