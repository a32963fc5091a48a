"""A worker torchrun starts (tests/test_rendezvous.py): its agents met through the orchestrator
(``--rdzv-backend collective``), and so does it, with nothing else to meet at.

Even ranks join through ``col.init()`` and torch then uses their peer; odd ranks through
``init_process_group("collective")``'s own store. Each prints "ROUND <job> <rank> <world> <sum>"
after an all_reduce; then it ends once the file FINISH (argv[1]) is there and the world is whole
(argv[2] processes), or else waits in barriers until a peer is lost or torchrun restarts it.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import collective as col
import collective.torch  # (the backend)

if int(os.environ["RANK"]) % 2 == 0:
    col.init()
dist.init_process_group("collective")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"ROUND {os.environ['COLLECTIVE_JOB']} {rank} {world} {total.item():g}", flush=True)
while not (world == int(sys.argv[2]) and os.path.exists(sys.argv[1])):
    dist.barrier()  # (raises once a peer is lost)
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
