"""One rank of a torch.distributed job on the "collective" backend (run by tests/test_torch_backend.py).

    python tests/torch_worker.py ops           every dist op against a reference, on the world and a
                                               subgroup; async work and futures; object collectives;
                                               errors; prints "OK <rank>"
    python tests/torch_worker.py ddp BACKEND OUT  DDP training runs (plain, no_sync, comm hook) under
                                               BACKEND ("collective" through tcp://, or "gloo");
                                               rank R saves its final parameters to OUT.R
    python tests/torch_worker.py kill          DDP training; the last rank SIGKILLs itself in step 3;
                                               the others print "RAISED <seconds> <error>"
    python tests/torch_worker.py reuse         col.init() first: init_process_group reuses its peer
    python tests/torch_worker.py repeats       all_reduces repeated on the same tensors (kept calls)
    python tests/torch_worker.py fsdp          FSDP2 on our group and on gloo's: the same parameters
    python tests/torch_worker.py mends         groups of the same ranks, receives from several
                                               sources, coalesced errors, split checks, in-place
                                               forms, futures' values, a subgroup's timeout

Rank and world size come from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import copy
import gc
import math
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import collective as col
import collective.torch  # registers the backend
from collective.bench.ddp_step import train

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes on *_tensor ops
R = dist.ReduceOp
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.complex64,
]


def value(rank: int, shape: tuple[int, ...], dtype: Any, salt: int = 0) -> Any:
    """Rank ``rank``'s deterministic input: small integers, exact in every dtype."""
    count = int(np.prod(shape)) if shape else 1
    return ((torch.arange(count) * (salt + 1) + rank) % 4 + 1).reshape(shape).to(dtype)


def combine(tensors: list[Any], op: Any) -> Any:
    """The reference: ``op`` over ``tensors`` (in their dtype; mean in complex128)."""
    if op == R.AVG:
        total = torch.stack([t.to(torch.complex128) for t in tensors]).sum(0) / len(tensors)
        return (total if tensors[0].dtype.is_complex else total.real).to(tensors[0].dtype)
    combine_two = {
        R.SUM: torch.add,
        R.PRODUCT: torch.mul,
        R.MIN: torch.minimum,
        R.MAX: torch.maximum,
        R.BAND: torch.bitwise_and,
        R.BOR: torch.bitwise_or,
        R.BXOR: torch.bitwise_xor,
    }[op]
    result = tensors[0].clone()
    for t in tensors[1:]:
        result = combine_two(result, t)
    return result


def same(actual: Any, expected: Any, what: str) -> None:
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", atol=1e-2, rtol=1e-2)


def check_ops(group: Any, ranks: list[int]) -> None:
    """Every op on ``group`` (global ranks ``ranks``), against references built from value()."""
    rank, n = dist.get_rank(), len(ranks)
    me = ranks.index(rank)
    kw = {"group": group}
    # all_reduce: every dtype x op, 17 elements (not divisible by the group size), 0-d and empty
    for dtype in DTYPES:
        ops = [R.SUM] if dtype.is_complex else [R.SUM, R.PRODUCT, R.MIN, R.MAX]  # torch: complex as real
        ops += [R.AVG] if dtype.is_floating_point or dtype.is_complex else [R.BAND, R.BOR, R.BXOR]
        for op in ops:
            t = value(rank, (17,), dtype)
            dist.all_reduce(t, op, **kw)
            same(t, combine([value(r, (17,), dtype) for r in ranks], op), f"all_reduce {dtype} {op}")
    for shape in [(), (0,), (3, 5)]:
        t = value(rank, shape, torch.float32)
        dist.all_reduce(t, **kw)
        same(t, combine([value(r, shape, torch.float32) for r in ranks], R.SUM), f"all_reduce {shape}")
    flags = torch.tensor([me == 0, False, True])
    dist.all_reduce(flags, R.MAX, **kw)
    assert flags.tolist() == [True, False, True], flags
    flags = torch.tensor([me == 0, False, True])
    dist.all_reduce(flags, R.MIN, **kw)
    assert flags.tolist() == [n == 1, False, True], flags
    flags = torch.tensor([me == 0, False, True, me % 2 == 1])
    dist.all_reduce(flags, R.BXOR, **kw)
    assert flags.tolist() == [True, False, n % 2 == 1, (n // 2) % 2 == 1], flags  # (odd counts)
    if hasattr(dist, "_make_nccl_premul_sum"):
        t = value(rank, (5,), torch.float32)
        dist.all_reduce(t, dist._make_nccl_premul_sum(2.0), **kw)
        same(t, 2 * combine([value(r, (5,), torch.float32) for r in ranks], R.SUM), "premul_sum")
    grid = value(rank, (6, 4), torch.float32)
    column = grid[:, 1]  # not contiguous: written back in place
    dist.all_reduce(column, **kw)
    same(grid[:, 1], combine([value(r, (6, 4), torch.float32)[:, 1] for r in ranks], R.SUM), "strided")
    same(grid[:, 0], value(rank, (6, 4), torch.float32)[:, 0], "strided neighbours untouched")
    leaf = value(rank, (4,), torch.float32).requires_grad_()
    dist.all_reduce(leaf, **kw)
    same(leaf.detach(), combine([value(r, (4,), torch.float32) for r in ranks], R.SUM), "requires_grad")
    # broadcast and reduce from every root
    for i, root in enumerate(ranks):
        for dtype in (torch.float32, torch.bfloat16, torch.bool):
            t = value(rank, (7,), dtype)
            dist.broadcast(t, src=root, **kw)
            same(t, value(root, (7,), dtype), f"broadcast {dtype} from {root}")
        t = value(rank, (9,), torch.int64)
        dist.reduce(t, dst=root, op=R.MAX, **kw)
        if me == i:
            same(t, combine([value(r, (9,), torch.int64) for r in ranks], R.MAX), f"reduce to {root}")
    # all_gather: list, into one tensor (concatenated and stacked)
    outs = [torch.empty(3, 2) for _ in ranks]
    dist.all_gather(outs, value(rank, (3, 2), torch.float32), **kw)
    for r, out in zip(ranks, outs, strict=True):
        same(out, value(r, (3, 2), torch.float32), f"all_gather from {r}")
    every = torch.cat([value(r, (3, 2), torch.bfloat16) for r in ranks])
    out = torch.empty(3 * n, 2, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, value(rank, (3, 2), torch.bfloat16), **kw)
    same(out, every, "all_gather_into_tensor")
    out = torch.empty(n, 3, 2, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, value(rank, (3, 2), torch.bfloat16), **kw)
    same(out.reshape(3 * n, 2), every, "all_gather_into_tensor (stacked)")
    # reduce_scatter: list and tensor
    out = torch.empty(4)
    dist.reduce_scatter(out, [value(rank, (4,), torch.float32, salt=j) for j in range(n)], **kw)
    same(out, combine([value(r, (4,), torch.float32, salt=me) for r in ranks], R.SUM), "reduce_scatter")
    out = torch.empty(4, dtype=torch.int32)
    dist.reduce_scatter_tensor(out, value(rank, (4 * n,), torch.int32), op=R.MIN, **kw)
    expected = combine([value(r, (4 * n,), torch.int32) for r in ranks], R.MIN)[4 * me : 4 * me + 4]
    same(out, expected, "reduce_scatter_tensor")
    # all_to_all_single: equal and uneven splits; all_to_all with tensors of different sizes
    out = torch.empty(2 * n, 3)
    dist.all_to_all_single(out, value(rank, (2 * n, 3), torch.float32), **kw)
    for j, r in enumerate(ranks):
        same(out[2 * j : 2 * j + 2], value(r, (2 * n, 3), torch.float32)[2 * me : 2 * me + 2], "all_to_all")
    sent = [j + 1 + me for j in range(n)]  # rows to rank j
    got = [me + 1 + j for j in range(n)]  # rows from rank j (its sent[me])
    source = value(rank, (sum(sent), 2), torch.float64)
    out = torch.empty(sum(got), 2, dtype=torch.float64)
    dist.all_to_all_single(out, source, got, sent, **kw)
    offset = 0
    for j, r in enumerate(ranks):  # rank j sent k + 1 + j rows to each rank k, in rank order
        theirs = value(r, (sum(k + 1 + j for k in range(n)), 2), torch.float64)
        start = sum(k + 1 + j for k in range(me))
        same(out[offset : offset + got[j]], theirs[start : start + got[j]], f"uneven all_to_all from {r}")
        offset += got[j]
    outputs = [torch.empty(me + 1) for _ in ranks]
    dist.all_to_all(outputs, [torch.full((j + 1,), 10.0 * rank + j) for j in range(n)], **kw)
    for r, out in zip(ranks, outputs, strict=True):
        same(out, torch.full((me + 1,), 10.0 * r + me), f"all_to_all list from {r}")
    # gather and scatter from every root
    for i, root in enumerate(ranks):
        gathered = [torch.empty(5, dtype=torch.int16) for _ in ranks] if me == i else None
        dist.gather(value(rank, (5,), torch.int16), gathered, dst=root, **kw)
        if gathered is not None:
            for r, got_row in zip(ranks, gathered, strict=True):
                same(got_row, value(r, (5,), torch.int16), f"gather to {root}")
        out = torch.empty(2, 2)
        parts = [value(root, (2, 2), torch.float32, salt=j) for j in range(n)] if me == i else None
        dist.scatter(out, parts, src=root, **kw)
        same(out, value(root, (2, 2), torch.float32, salt=me), f"scatter from {root}")
    dist.barrier(**kw)
    # point to point: a ring with isend/irecv, then blocking send/recv of bfloat16
    if n > 1:
        nxt, prev = ranks[(me + 1) % n], ranks[(me - 1) % n]
        incoming = torch.empty(6)
        works = [dist.isend(value(rank, (6,), torch.float32), nxt, **kw), dist.irecv(incoming, prev, **kw)]
        for work in works:
            work.wait()
        same(incoming, value(prev, (6,), torch.float32), "isend/irecv ring")
        if me == 0:
            dist.send(value(rank, (3,), torch.bfloat16), ranks[1], tag=7, **kw)
        elif me == 1:
            received = torch.empty(3, dtype=torch.bfloat16)
            dist.recv(received, ranks[0], tag=7, **kw)
            same(received, value(ranks[0], (3,), torch.bfloat16), "send/recv")
    # asynchronous work: several in flight, futures with the result tensors, then-callbacks
    tensors = [value(rank, (8,), torch.float32, salt=k) for k in range(4)]
    works = [dist.all_reduce(t, async_op=True, **kw) for t in tensors]
    doubled = works[-1].get_future().then(lambda fut: fut.value()[0] * 2)
    torch.futures.wait_all([w.get_future() for w in works])
    for k, (t, work) in enumerate(zip(tensors, works, strict=True)):
        assert work.wait() and work.is_completed()
        expected = combine([value(r, (8,), torch.float32, salt=k) for r in ranks], R.SUM)
        same(t, expected, f"async all_reduce {k}")
        assert work.get_future().value()[0] is t
    same(doubled.wait(), 2 * tensors[-1], "then-callback")
    work = dist.broadcast(value(rank, (2,), torch.float32), src=ranks[0], async_op=True, **kw)
    work.wait()
    # object collectives
    objects: list[Any] = [None] * n
    dist.all_gather_object(objects, {"rank": rank, "data": list(range(rank))}, **kw)
    assert objects == [{"rank": r, "data": list(range(r))} for r in ranks], objects
    box: list[Any] = [f"from {rank}", rank * 1.5] if me == n - 1 else [None, None]
    dist.broadcast_object_list(box, src=ranks[-1], **kw)
    assert box == [f"from {ranks[-1]}", ranks[-1] * 1.5], box
    gathered_objects: list[Any] | None = [None] * n if me == 0 else None
    dist.gather_object(("g", rank), gathered_objects, dst=ranks[0], **kw)
    if me == 0:
        assert gathered_objects == [("g", r) for r in ranks], gathered_objects
    scattered: list[Any] = [None]
    dist.scatter_object_list(scattered, [f"to {r}" for r in ranks] if me == 0 else None, src=ranks[0], **kw)
    assert scattered == [f"to {rank}"], scattered
    # errors: a mismatch is a DistBackendError with our message on every rank; the group goes on
    expect_error(lambda: dist.all_reduce(torch.ones(3 if me == 0 else 4), **kw), "MismatchError")
    expect_error(lambda: dist.all_reduce(torch.ones(2), op=R.BAND, **kw), "(bitwise) takes integer dtypes")
    t = torch.ones(2)
    dist.all_reduce(t, **kw)
    same(t, torch.full((2,), float(n)), "after the errors")


def expect_error(call: Callable[[], Any], text: str) -> None:
    try:
        call()
    except dist.DistBackendError as exc:
        assert text in str(exc), exc
        return
    raise AssertionError(f"no DistBackendError mentioning {text!r}")


def ops() -> None:
    dist.init_process_group("collective")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "collective"
    check_ops(None, list(range(world)))
    members = [0, world - 1]
    subgroup = dist.new_group(members)
    if rank in members:
        assert dist.get_backend(subgroup) == "collective"
        check_ops(subgroup, members)
    check_group_methods(rank, world)
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK {rank}", flush=True)


def check_group_methods(rank: int, world: int) -> None:
    """The group object's own methods, in torch's short forms too (as some libraries call them)."""
    pg = dist.group.WORLD
    total, first = float(world * (world + 1) // 2), [1.0, 1.0]
    product = float(math.factorial(world))
    for call, expected, where in [  # (where: the ranks that get the result)
        (lambda t: pg.allreduce(t), [total] * 2, range(world)),
        (lambda t: pg.allreduce(t, dist.ReduceOp.MAX), [float(world)] * 2, range(world)),
        (lambda t: pg.allreduce([t], dist.ReduceOp.MIN), first, range(world)),
        (lambda t: pg.allreduce([t], dist.AllreduceOptions()), [total] * 2, range(world)),
        (lambda t: pg.broadcast(t, world - 1), [float(world)] * 2, range(world)),
        (lambda t: pg.broadcast([t], 0), first, range(world)),
        (lambda t: pg.reduce(t, 0, dist.ReduceOp.PRODUCT), [product] * 2, [0]),
        (lambda t: pg.reduce(t, world - 1), [total] * 2, [world - 1]),
    ]:
        t = torch.full((2,), float(rank + 1))
        call(t).wait()
        if rank in where:
            same(t, torch.tensor(expected), "a method of the group object")
    gathered = [torch.zeros(2) for _ in range(world)]
    pg.allgather(gathered, torch.full((2,), float(rank))).wait()
    ranks = torch.arange(world, dtype=torch.float32)[:, None]
    same(torch.stack(gathered), ranks.expand(world, 2), "pg.allgather")


def ddp(backend: str, out: str) -> None:
    """Train the shared models; collective joins through tcp://, gloo through env://."""
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "collective":
        address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group(backend, init_method=address, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    results = {
        "plain-1.3m": train("mlp-1.3m", 30, rank)[0],
        "plain-12x128": train("mlp-12x128", 30, rank)[0],
        "no_sync": train("mlp-12x128", 10, rank, accumulate=3)[0],
        "fp16-hook": train("mlp-12x128", 10, rank, hook=default_hooks.fp16_compress_hook)[0],
    }
    if backend == "collective":
        kept = dist.distributed_c10d._get_default_group()._kept
        assert any(call.last is not None for call in kept.values()), "no bucket of DDP's ran kept"
        check_no_sync_is_local(rank, world)
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()
    print(f"OK {rank}", flush=True)


def check_no_sync_is_local(rank: int, world: int) -> None:
    """Under no_sync() gradients stay each rank's own; the next backward averages them."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    x = torch.full((2, 4), float(rank + 1))
    with model.no_sync():
        model(x).sum().backward()
    local = model.module.weight.grad.clone()
    locals_ = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(locals_, local)
    assert not torch.equal(locals_[0], locals_[1]), locals_
    model(x).sum().backward()  # the same gradient again, added to the local one, then averaged
    synced = model.module.weight.grad.clone()
    everyone = [torch.empty_like(synced) for _ in range(world)]
    dist.all_gather(everyone, synced)
    assert all(torch.equal(everyone[0], g) for g in everyone), everyone
    same(synced, 2 * torch.stack(locals_).mean(0), "no_sync accumulation")


def kill() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("collective")
    rank, world = dist.get_rank(), dist.get_world_size()
    started = [time.monotonic()]

    def on_step(step: int) -> None:
        started[0] = time.monotonic()
        if step == 3 and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)

    try:
        train("mlp-12x128", 100_000, rank, on_step=on_step)
    except RuntimeError as exc:  # DDP's reducer re-raises our DistBackendError as a RuntimeError
        message = str(exc).splitlines()[0]
        print(f"RAISED {time.monotonic() - started[0]:.2f} {message}", flush=True)
        os._exit(0)
    print("NO ERROR", flush=True)


def reuse() -> None:
    peer = col.init()
    dist.init_process_group("collective")
    assert dist.get_rank() == peer and dist.get_world_size() == col.world_size()
    t = torch.ones(3)
    dist.all_reduce(t)
    direct = col.all_reduce(peer, torch.ones(3))
    assert torch.equal(t, direct) and isinstance(direct, torch.Tensor), (t, direct)
    dist.destroy_process_group()  # the peer stays registered: col.init() registered it
    np.testing.assert_array_equal(
        col.all_gather(peer, np.array([peer])), [[r] for r in range(col.world_size())]
    )
    col.finish(peer)
    print(f"OK {peer}", flush=True)


def repeats() -> None:
    """All_reduces repeated on the same tensor run their first call kept (Runtime.repeat)."""
    dist.init_process_group("collective")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.distributed_c10d._get_default_group()
    assert group.repeats and not group._kept
    # one tensor, its contents new at each call, three ops, blocking and async: kept once per op,
    # then run again (the kept step)
    x = torch.zeros(5)
    for step in range(6):
        op = (R.SUM, R.MAX, R.AVG)[step % 3]
        x.copy_(torch.arange(5.0) * (step + 1) + rank)
        expected = combine([torch.arange(5.0) * (step + 1) + r for r in range(world)], op)
        if step % 2:
            dist.all_reduce(x, op, async_op=True).wait()
        else:
            dist.all_reduce(x, op)
        same(x, expected, f"a kept all_reduce, step {step}")
    assert len(group._kept) == 3 and all(call.last is not None for call in group._kept.values())
    # one rank keeps its tensor, the other makes a new one at each call: the same steps
    kept = torch.zeros(3, dtype=torch.int64)
    for step in range(4):
        tensor = kept if rank == 0 else torch.zeros(3, dtype=torch.int64)
        tensor.fill_(10 * rank + step)
        dist.all_reduce(tensor)
        assert tensor.tolist() == [sum(10 * r + step for r in range(world))] * 3, (step, tensor)
    # the tensor's memory moved, or read as another dtype or shape: not the kept call's
    z = torch.ones(4)
    dist.all_reduce(z)
    dist.all_reduce(z)
    z.set_(torch.full((4,), float(rank + 2)))
    dist.all_reduce(z)
    assert z.tolist() == [float(sum(r + 2 for r in range(world)))] * 4, z
    as_int = z.view(torch.int32)
    as_int.fill_((rank + 1) << 24)  # (as float32 bits these add up to other bits)
    dist.all_reduce(as_int)
    assert as_int.tolist() == [sum((r + 1) << 24 for r in range(world))] * 4, as_int
    shorter = z[:2]
    shorter.fill_(rank + 3)
    dist.all_reduce(shorter)
    assert shorter.tolist() == [float(sum(r + 3 for r in range(world)))] * 2, shorter
    # a kept call meeting another call fails on every rank, and the group goes on in step
    m = torch.ones(4)
    dist.all_reduce(m)
    dist.all_reduce(m)
    other = torch.ones(6)
    expect_error(lambda: dist.all_reduce(m if rank == 0 else other), "shape")
    m.fill_(1)
    dist.all_reduce(m)
    assert m.tolist() == [float(world)] * 4, m
    # a kept call does not keep its tensor alive, nor do the other collectives (their views are
    # made for each call: the runtime keeps none of their calls)
    w = torch.ones(1000)
    dist.all_reduce(w)
    dist.all_reduce(w)
    gone = [weakref.ref(w)]
    del w
    for _ in range(3):
        b, gathered, scattered = torch.ones(1000), torch.zeros(world * 10), torch.zeros(10)
        dist.broadcast(b, src=0)
        dist.all_gather_into_tensor(gathered, torch.ones(10))
        dist.reduce_scatter_tensor(scattered, torch.ones(world * 10))
        gone += [weakref.ref(b), weakref.ref(gathered), weakref.ref(scattered)]
        del b, gathered, scattered
    gc.collect()
    assert all(ref() is None for ref in gone), "a collective keeps its tensor alive"
    assert not col.default_runtime()._kept_calls, "the runtime kept calls on views made for one call"
    # a queued call whose tensor moves before its body runs (rank 1 comes to the group only once
    # rank 0 has moved it, through a gloo barrier): found kept, or kept by its first run, it runs
    # on the memory the tensor has then, and keeps its call under that memory's key
    gate = dist.new_group(backend="gloo")
    for first in (False, True):
        q = torch.zeros(6)
        if not first:
            dist.all_reduce(q)
            dist.all_reduce(q)  # (kept: the next is a kept use)
        if rank == 1:
            dist.barrier(group=gate)
        held = dist.all_reduce(torch.zeros(1), async_op=True)  # (rank 0's queue waits here for rank 1)
        q.fill_(rank + 1)
        work = dist.all_reduce(q, async_op=True)
        if rank == 0:
            q.set_(torch.full((6,), 1.0))  # (its memory moved; the old is freed)
            dist.barrier(group=gate)
        held.wait()
        work.wait()
        total = 1.0 + sum(r + 1 for r in range(1, world))  # (rank 0's moved tensor holds 1s)
        assert q.tolist() == [total] * 6, (first, q)
        for found, kept_call in group._kept.items():
            address = kept_call.x.__array_interface__["data"][0]
            assert found[0] == address, f"a call kept under {found[0]:#x} runs on {address:#x}"
    # COLLECTIVE_TORCH_REPEAT=0: a group made then checks and agrees every call anew
    os.environ["COLLECTIVE_TORCH_REPEAT"] = "0"
    plain = dist.new_group(list(range(world)))
    del os.environ["COLLECTIVE_TORCH_REPEAT"]
    v = torch.ones(2)
    dist.all_reduce(v, group=plain)
    dist.all_reduce(v, group=plain)
    assert v.tolist() == [float(world * world)] * 2 and not plain.repeats and not plain._kept, v
    dist.destroy_process_group()
    print(f"OK {rank}", flush=True)


def fsdp() -> None:
    """FSDP2 (fully_shard: all_gather_into_tensor, reduce_scatter_tensor) trains the same model on a
    mesh of our default group and on one of a gloo group of the same ranks, to the same bits."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("collective")
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")

    def trained(group: Any) -> dict[str, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1 + rank)  # (each rank its own batches)
        for _ in range(4):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return {name: value.full_tensor() for name, value in model.state_dict().items()}

    ours, theirs = trained(dist.group.WORLD), trained(gloo)
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), f"{name}: {value} under ours, {theirs[name]} under gloo"
    dist.destroy_process_group()
    print(f"OK {rank}", flush=True)


def _bad_argument_call(culprit: int, mine: bool, world: int) -> Callable[[], Any]:
    """A collective whose arguments only the backend can find wrong: on the culprit rank, an
    expanded tensor (0), an output list one short (1), split sizes of the wrong length (2)."""
    if culprit == 0:
        tensor = torch.ones(1).expand(4) if mine else torch.ones(4)
        return lambda: dist.all_reduce(tensor)
    if culprit == 1:
        outs = [torch.zeros(2) for _ in range(world - (1 if mine else 0))]
        return lambda: dist.all_gather(outs, torch.ones(2))
    splits = [1, 1] if mine else [1] * world
    return lambda: dist.all_to_all_single(torch.zeros(world), torch.zeros(world), splits, splits)


def mends() -> None:
    """3 ranks: groups of the same ranks, receives from several sources, coalesced errors and bool
    with float tensors, split checks, the in-place forms, futures' values and a subgroup's own
    timeout."""
    from datetime import timedelta

    dist.init_process_group("collective")
    rank, world = dist.get_rank(), dist.get_world_size()
    # two groups of the same ranks, async calls interleaved: each its own values
    first, second = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    for it in range(30):
        a, b = torch.full((4,), 1.0 + it), torch.full((4,), 100.0 + it)
        works = [
            dist.all_reduce(a, group=first, async_op=True),
            dist.all_reduce(b, group=second, async_op=True),
        ]
        for work in works:
            work.wait()
        same(a, torch.full((4,), world * (1.0 + it)), "first of two groups of the same ranks")
        same(b, torch.full((4,), world * (100.0 + it)), "second of two groups of the same ranks")
    # a receive matches dtype and elements, as gloo's bytes (pipelining sends a 0-d tensor into (1,))
    if rank == 0:
        dist.send(torch.tensor(7.0), 1, tag=8)
        dist.send(torch.arange(6.0).reshape(2, 3), 1, tag=8)
    if rank == 1:
        one, rows = torch.zeros(1), torch.zeros(3, 2)
        dist.recv(one, 0, tag=8)
        dist.recv(rows, 0, tag=8)
        same(one, torch.tensor([7.0]), "a 0-d tensor into (1,)")
        same(rows, torch.arange(6.0).reshape(3, 2), "(2, 3) into (3, 2)")
    # a pending irecv from rank 0 does not hold up a receive from rank 2 (rank 1)
    if rank == 2:
        dist.send(torch.full((2,), 42.0), 1, tag=5)
    if rank == 1:
        early = torch.zeros(2)
        pending = dist.irecv(early, 0, tag=5)
        late = torch.zeros(2)
        dist.recv(late, 2, tag=5)
        same(late, torch.full((2,), 42.0), "a receive behind a pending one")
        dist.send(torch.ones(1), 0, tag=6)
        pending.wait()
        same(early, torch.full((2,), 7.0), "the pending receive")
    if rank == 0:
        dist.recv(torch.zeros(1), 1, tag=6)
        dist.send(torch.full((2,), 7.0), 1, tag=5)
    # a receive runs on the thread that waits on it (no thread between: gloo's latency); one whose
    # work is asked after otherwise (its future, is_completed) runs on its pair's thread
    if rank == 0:
        for value in (3.0, 4.0, 5.0):
            dist.send(torch.full((1,), value), 1, tag=9)
    if rank == 1:
        started: list[str] = []
        start = threading.Thread.start

        def counted(thread: threading.Thread) -> None:
            started.append(thread.name)
            start(thread)

        threading.Thread.start = counted  # type: ignore[method-assign]
        try:
            got = torch.zeros(1)
            dist.recv(got, 0, tag=9)
            dist.irecv(got, 0, tag=9).wait()
            assert not started, started
            same(got, torch.full((1,), 4.0), "received on the waiting thread")
            work = dist.irecv(got, 0, tag=9)
            assert work.get_future().wait() == [got]  # torch's future: no wait() of ours
            assert [name for name in started if "-recv-" in name], started
            same(got, torch.full((1,), 5.0), "received on the pair's thread")
        finally:
            threading.Thread.start = start  # type: ignore[method-assign]
    # coalesced async: an error in the first op reaches the joined work
    from torch.distributed.distributed_c10d import _coalescing_manager  # what FSDP uses

    bad = torch.ones(2 if rank == 0 else 3)
    with _coalescing_manager(async_ops=True) as manager:
        dist.all_gather_into_tensor(torch.zeros(world * bad.numel()), bad)
        dist.all_gather_into_tensor(torch.zeros(world * 2), torch.ones(2))
    expect_error(manager.wait, "MismatchError")
    # coalesced bool and float tensors: bool takes SUM as max, so one list cannot have one op. It
    # took one of the two (a MAX of the floats, or a false mismatch); now an error on every rank,
    # nothing written, even where a rank's list has no bool (the bool on rank 0 only)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT):
        flags = torch.tensor([True, False, True]) if rank == 0 else torch.tensor([1.0, 0.0, 1.0])
        numbers = torch.full((3,), rank + 1.0)

        def mixed(op: Any = op, flags: Any = flags, numbers: Any = numbers) -> None:
            with _coalescing_manager():
                dist.all_reduce(flags, op=op)
                dist.all_reduce(numbers, op=op)

        expect_error(mixed, f"the list mixes bool tensors with others, which ReduceOp.{op.name} reduces")
        same(numbers, torch.full((3,), rank + 1.0), f"the floats of a refused list ({op})")
    flags = torch.tensor([rank == 0, False, True])  # a list of bools alone: SUM is "any"
    with _coalescing_manager():
        dist.all_reduce(flags)
        dist.all_reduce(flags2 := torch.tensor([False, rank == 1]))
    assert flags.tolist() == [True, False, True] and flags2.tolist() == [False, True], (flags, flags2)
    premul = dist._make_nccl_premul_sum(2.0)
    expect_error(lambda: dist.all_reduce(torch.tensor([True, False]), op=premul), "PREMUL_SUM on torch.bool")
    # one rank's bad argument, found by the backend before the call: the same error on every rank,
    # at once, and the group stays in step (it used to raise on that rank alone)
    bad = {0: "has elements that share memory", 1: "all_gather takes a list of 3", 2: "must be 3 sizes"}
    # in a coalescing manager (FSDP's all_gather_into_tensor): the first of two calls bad on rank 1
    short, whole_pair = torch.zeros(world * 2 - (1 if rank == 1 else 0)), torch.zeros(world * 2)

    def pair() -> None:
        with _coalescing_manager():
            dist.all_gather_into_tensor(short, torch.ones(2))
            dist.all_gather_into_tensor(whole_pair, torch.ones(2))

    expect_error(pair, "peer 1: all_gather")
    same(whole_pair, torch.ones(world * 2), "the second call of the coalesced pair")
    parts = [torch.zeros(2), torch.zeros(3), torch.zeros(2)] if rank == 2 else None  # (the root's alone)
    expect_error(lambda: dist.scatter(torch.zeros(2), parts, src=2), "peer 2: scatter: the root passes 3")
    for culprit, text in bad.items():
        call = _bad_argument_call(culprit, rank == culprit, world)
        started = time.monotonic()
        expect_error(call, f"invalid arguments, so no peer ran it: peer {culprit}: ")
        assert time.monotonic() - started < 5, f"rank {rank} waited for culprit {culprit}"
        expect_error(call, text)  # (the same again: its text names the problem on every rank)
        ok = torch.ones(2)
        dist.all_reduce(ok)
        same(ok, torch.full((2,), float(world)), f"the group after culprit {culprit}'s bad argument")
    # all_to_all_single: split sizes that do not add up, or that the ranks disagree on
    expect_error(
        lambda: dist.all_to_all_single(torch.zeros(world), torch.zeros(world + 1), [1] * world, [1] * world),
        "input_split_sizes",
    )
    sends = [1] * world
    receives = [1] * world if rank != 1 else [2] + [1] * (world - 2) + [0]
    expect_error(
        lambda: dist.all_to_all_single(torch.zeros(world), torch.zeros(world), receives, sends),
        "all_to_all_v: rank 1 expects 2 rows from rank 0, which sends 1",
    )
    # the in-place forms FSDP and ZeRO use
    whole = torch.arange(world * 3, dtype=torch.float32)
    whole[rank * 3 : (rank + 1) * 3] += 100 * (rank + 1)
    dist.all_gather_into_tensor(whole, whole[rank * 3 : (rank + 1) * 3].clone().zero_() + 100 * (rank + 1))
    for r in range(world):
        same(whole[r * 3 : (r + 1) * 3], torch.full((3,), 100.0 * (r + 1)), "all_gather_into_tensor in place")
    grads = torch.ones(world * 3) * (rank + 1)
    dist.reduce_scatter_tensor(grads[rank * 3 : (rank + 1) * 3], grads)
    same(grads[rank * 3 : (rank + 1) * 3], torch.full((3,), float(sum(range(1, world + 1)))), "in place rs")
    inplace = torch.full((3,), float(rank))
    outs = [torch.zeros(3) for _ in range(world)]
    outs[rank] = inplace
    # futures carry the output tensors themselves (as gloo's)
    work = dist.all_gather(outs, inplace, async_op=True)
    value = work.get_future().wait()
    assert len(value) == world and all(isinstance(v, torch.Tensor) for v in value), value
    same(value[world - 1], torch.full((3,), float(world - 1)), "all_gather's future")
    # a subgroup's own timeout applies to its collectives
    quick = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    if rank == 0:
        started = time.monotonic()
        expect_error(lambda: dist.all_reduce(torch.ones(1), group=quick), "CollectiveTimeout")
        assert time.monotonic() - started < 10, time.monotonic() - started
    if rank == 1:
        time.sleep(1.5)  # (past rank 0's timeout: this call meets nobody either)
        expect_error(lambda: dist.all_reduce(torch.ones(1), group=quick), "CollectiveTimeout")
        # a receive's timeout names torch's tag (not the one that carries the group's key)
        expect_error(lambda: dist.recv(torch.zeros(1), 0, group=quick, tag=5), "with tag 5;")
    expect_error(lambda: dist.all_reduce(torch.ones(1).expand(3)), "elements that share memory")
    try:  # every error of the backend is caused by ours
        dist.all_reduce(torch.ones(2), op=R.BXOR)
    except dist.DistBackendError as exc:
        assert isinstance(exc.__cause__, col.InvalidArgumentError), repr(exc.__cause__)
        assert "takes integer dtypes" in str(exc), exc
    else:
        raise AssertionError("BXOR of floats is not served")
    # a tag per message: the receives' threads end with their receives
    if rank == 0:
        for tag in range(40):
            dist.send(torch.full((1,), float(tag)), 1, tag=100 + tag)
    if rank == 1:
        for tag in range(40):
            got = torch.zeros(1)
            dist.recv(got, 0, tag=100 + tag)
            same(got, torch.full((1,), float(tag)), "a receive of its own tag")
        for _ in range(100):
            receiving = [t for t in threading.enumerate() if "-recv-" in t.name]
            if not receiving:
                break
            time.sleep(0.02)
        assert not receiving, receiving
    # point to point on the world and on a subgroup of the same pair, same tag: each group's
    # messages are its own (as gloo's; the receive on the subgroup took the world's message)
    pair = dist.new_group([0, 1])
    if rank == 0:
        dist.send(torch.full((3,), 1.0), 1)
        dist.send(torch.full((3,), 2.0), 1, group=pair)
    if rank == 1:
        on_pair, on_world = torch.zeros(3), torch.zeros(3)
        dist.recv(on_pair, 0, group=pair)
        dist.recv(on_world, 0)
        same(on_pair, torch.full((3,), 2.0), "a receive on a subgroup")
        same(on_world, torch.full((3,), 1.0), "a receive on the world")

    # a sparse (COO) all_reduce sums as gloo's: indices and values gathered, then coalesced
    def coo(r: int) -> Any:  # ranks 0 and 2 share index (0, 2)
        return torch.sparse_coo_tensor(
            torch.tensor([[r % 2, 2], [r, 1]]).t(), torch.tensor([1.0 + r, 10.0]), (world, 3)
        )

    mine, dense_sum = coo(rank), sum(coo(r).to_dense() for r in range(world))
    dist.all_reduce(mine)
    assert mine.is_sparse and mine.is_coalesced(), mine
    same(mine.to_dense(), dense_sum, "sparse all_reduce")
    expect_error(lambda: dist.all_reduce(coo(rank), op=dist.ReduceOp.MAX), "only ReduceOp.SUM")
    expect_error(lambda: dist.broadcast(torch.ones(3).to_sparse(), 0), "takes dense tensors")
    # a dtype the backend does not move: a TypeError on this rank alone, the others left waiting
    expect_error(lambda: dist.all_reduce(torch.zeros(2, dtype=torch.float8_e4m3fn)), "not supported")
    # point to point: a receive into an expanded tensor is refused before it takes the message
    # (torch's copy failed after it: the message was lost), a sparse send is named
    if rank == 0:
        expect_error(
            lambda: dist.send(torch.ones(3).to_sparse(), 1, tag=12),
            "InvalidArgumentError: send: a torch.sparse_coo",
        )
        dist.send(torch.arange(6.0).reshape(2, 3), 1, tag=12)
    if rank == 1:
        expect_error(lambda: dist.recv(torch.zeros(1, 3).expand(2, 3), 0, tag=12), "share memory")
        kept = torch.zeros(2, 3)
        dist.recv(kept, 0, tag=12)
        same(kept, torch.arange(6.0).reshape(2, 3), "the message a refused receive left")
    # all_gather_coalesced: outputs[r][j] is rank r's tensor j (it was read transposed: wrong results
    # with as many tensors as ranks, a ValueError otherwise)
    for count in (world, world + 1):
        mine = [torch.arange(j + 1.0) + 10 * rank for j in range(count)]
        lists = [[torch.zeros(j + 1) for j in range(count)] for _ in range(world)]
        dist.all_gather_coalesced(lists, mine)
        for r in range(world):
            for j in range(count):
                same(lists[r][j], torch.arange(j + 1.0) + 10 * r, f"all_gather_coalesced [{r}][{j}]")
    expect_error(  # a rank whose output lists are not one per rank: an error on every rank
        lambda: dist.all_gather_coalesced([[torch.zeros(1)]] * (world + (rank == 0)), [torch.ones(1)]),
        "all_gather_coalesced takes",
    )
    # all_gather into tensors of different sizes (rank i's of its input's size): all_gather_v
    mine = torch.arange(rank + 2.0).reshape(1, rank + 2) * (rank + 1)
    gathered = [torch.zeros(1, r + 2) for r in range(world)]
    dist.all_gather(gathered, mine)
    for r, got in enumerate(gathered):
        same(got, torch.arange(r + 2.0).reshape(1, r + 2) * (r + 1), f"uneven all_gather from {r}")
    expect_error(  # rank 1 expects 3 elements from rank 0, which sends 2: an error on every rank
        lambda: dist.all_gather([torch.zeros(r + 2 + (rank == 1 and r == 0)) for r in range(world)], mine[0]),
        "all_gather_v: rank 1 expects 3 rows from rank 0, which sends 2",
    )
    # reduce_scatter of lists of tensors of different sizes (rank i's of its output's size), as gloo
    uneven = [torch.arange(r + 1.0) + rank for r in range(world)]
    out = torch.zeros(rank + 1)
    dist.reduce_scatter(out, uneven)
    same(out, world * torch.arange(rank + 1.0) + sum(range(world)), "uneven reduce_scatter")
    sizes = [2, 1, 1] if rank == 1 else [1, 2, 1]  # rank 1 disagrees: an error on every rank
    expect_error(
        lambda: dist.reduce_scatter(torch.zeros(sizes[rank]), [torch.ones(k) for k in sizes]),
        "peers disagree on sizes: peers 0, 2 passed (1, 2, 1), peer 1 passed (2, 1, 1)",
    )
    # collectives issued from a callback of a work's future (DDP's PowerSGD hook does): they hung
    nested = torch.ones(4) * (rank + 1)

    def chained(_: Any) -> Any:
        dist.all_reduce(nested)  # blocking, on the same group, from its worker's thread
        return dist.all_reduce(nested, async_op=True).get_future().wait()

    dist.all_reduce(torch.ones(2), async_op=True).get_future().then(chained).wait()
    same(nested, torch.full((4,), world * sum(range(1, world + 1)) * 1.0), "collectives from a callback")
    # a receive from any rank: dist.recv returns the sender (in a subgroup, its global rank)
    if rank != 0:
        dist.send(torch.full((2,), float(rank)), 0, tag=11)
    else:
        senders = set()
        for _ in range(world - 1):
            got = torch.zeros(2)
            sender = dist.recv(got, tag=11)
            same(got, torch.full((2,), float(sender)), "a receive from any rank")
            senders.add(sender)
        assert senders == set(range(1, world)), senders
    upper = dist.new_group([1, 2])
    if rank == 2:
        dist.send(torch.ones(1), 1, group=upper, tag=12)
    if rank == 1:
        work = dist.irecv(torch.zeros(1), group=upper, tag=12)
        work.wait()
        assert work._source_rank() == 1, work._source_rank()  # rank 2 is rank 1 of the group
    # a subgroup can be destroyed on its own
    passing = dist.new_group(list(range(world)))
    dist.barrier(group=passing)
    dist.destroy_process_group(passing)
    t = torch.ones(2)
    dist.all_reduce(t)
    same(t, torch.full((2,), float(world)), "after the errors")
    dist.destroy_process_group()
    print(f"OK {rank}", flush=True)


def sparse() -> None:
    """DDP over a model with a sparse embedding (its gradients are COO tensors): the same steps
    under our backend and under a gloo group of the same ranks give the same parameters."""
    dist.init_process_group("collective")
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    models = []
    for group in (None, gloo):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 1))
        models.append(torch.nn.parallel.DistributedDataParallel(model, process_group=group))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]
    for step in range(4):
        generator = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, 50, (16,), generator=generator)
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad()
            model(tokens).pow(2).mean().backward()
            optimizer.step()
    for ours, theirs in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    dist.destroy_process_group()
    print(f"OK {rank}", flush=True)


def pipelines() -> None:
    """torch.distributed.pipelining on our backend, 2 stages: stages built by hand under 1F1B and
    GPipe, and the pipeline() frontend (traced, split at a layer) under 1F1B; each trains 3 steps
    and ends with the parameters of the whole model trained in one process on the same batches."""
    from torch.distributed import pipelining

    dist.init_process_group("collective")
    rank = dist.get_rank()
    width, rows, microbatches = 16, 4, 4
    torch.manual_seed(0)
    whole = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))
    data = torch.Generator().manual_seed(1)
    batches = [torch.randn(rows * microbatches, width, generator=data) for _ in range(3)]
    reference = copy.deepcopy(whole)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x), x.flip(1)).backward()
        optimizer.step()
    expected = list(reference[2 * rank : 2 * rank + 2].parameters())

    def train(stage: Any, kind: Any, what: str) -> None:
        # (every stage names the loss: without it a stage runs the forward passes alone)
        schedule = kind(stage, microbatches, loss_fn=torch.nn.functional.mse_loss)
        optimizer = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
        for x in batches:
            optimizer.zero_grad()
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=x.flip(1))
            optimizer.step()
        trained = list(stage.submod.parameters())
        assert len(trained) == len(expected), (what, len(trained))
        for value, wanted in zip(trained, expected, strict=True):
            torch.testing.assert_close(value, wanted, rtol=1e-5, atol=1e-6, msg=what)

    for kind in (pipelining.Schedule1F1B, pipelining.ScheduleGPipe):
        mine = copy.deepcopy(whole)[2 * rank : 2 * rank + 2]
        train(pipelining.PipelineStage(mine, rank, 2, torch.device("cpu")), kind, f"by hand, {kind.__name__}")
    pipe = pipelining.pipeline(
        copy.deepcopy(whole),
        mb_args=(torch.randn(rows, width),),
        split_spec={"2": pipelining.SplitPoint.BEGINNING},
    )
    train(pipe.build_stage(rank, torch.device("cpu")), pipelining.Schedule1F1B, "pipeline() frontend")
    dist.destroy_process_group()
    print(f"OK {rank}", flush=True)


def main() -> int:
    scenario = sys.argv[1]
    if scenario == "ops":
        ops()
    elif scenario == "ddp":
        ddp(sys.argv[2], sys.argv[3])
    elif scenario == "kill":
        kill()
    elif scenario == "reuse":
        reuse()
    elif scenario == "repeats":
        repeats()
    elif scenario == "fsdp":
        fsdp()
    elif scenario == "mends":
        mends()
    elif scenario == "sparse":
        sparse()
    elif scenario == "pipelines":
        pipelines()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
