"""One process (one peer) of a same-host job: run by tests/test_shm_executor.py.

Usage: python tests/shm_worker.py MODE [ARG]   (the job comes from COLLECTIVE_* variables)

Every process knows every peer's input (a function of the peer id and the call), so it checks
each result bit for bit against a reference it computes itself, combining in rank order. Output:
"RING <segment name>" first, then "OK <collectives> SHM <steps through shared memory>" at the
end, or "ERROR <class> <seconds> <message>" (exit status 3); "READY" once a loop runs.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import collective as col

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.matrix, run as a script
from collective.shm import group as shm_executor
from collective.transport.shm_ring import RingSegment
from collective.transport.shm_segment import NAME
from tests.matrix import reduced

SIZES = [0, 1, 3, 17, 1000, 20_000, 300_001]  # elements: empty .. more than a chunk, odd
DTYPES = ["float32", "float64", "int32", ml_dtypes.bfloat16]


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def until(ready: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``ready`` until it is true; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.01)


def gate(gates: str, peer: int) -> None:
    """Wait until the test opens this peer's gate (creates ``<gates>/go-<peer>``): the test orders
    the processes by what it saw of the others (an exit, a line), never by time."""
    path = os.path.join(gates, f"go-{peer}")
    until(lambda: os.path.exists(path), 60, f"{path} created")


@contextlib.contextmanager
def channels_given() -> Iterator[list[str]]:
    """The groups given a channel of this process's ring while the block runs (its DEBUG log)."""
    given: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "uses channel" in record.getMessage():
                given.append(record.getMessage())

    logger, handler = logging.getLogger("collective.shm.ring"), Keep()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield given
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def data(peer: int, shape: Any, dtype: Any, salt: int) -> np.ndarray:
    rng = np.random.default_rng(7919 * peer + salt)
    return rng.integers(-3, 4, size=shape).astype(dtype)


def same(got: Any, expected: np.ndarray, what: str) -> None:
    assert got is not None, what
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, got.dtype)
    assert got.tobytes() == expected.tobytes(), (what, got.tolist()[:3], expected.tolist()[:3])


def every(peer: int, world: int) -> int:
    """Every collective, several sizes and dtypes, every root, out= and in place."""
    count = 0
    for salt, (length, dtype) in enumerate(itertools.product(SIZES, DTYPES)):
        if length > 20_000 and dtype != "float32":
            continue
        xs = [data(p, world * length, dtype, salt) for p in range(world)]
        x = xs[peer]
        k = length
        ops = ("sum", "max", "mean", "prod") + (("band", "bor", "bxor") if dtype == "int32" else ())
        for op in ops if length < 1000 or dtype == "float32" else ("sum",):
            same(col.all_reduce(peer, x, op), reduced(xs, op), f"all_reduce {op} {length} {dtype}")
            count += 1
        same(col.reduce_scatter(peer, x), reduced(xs, "sum")[peer * k : (peer + 1) * k], "reduce_scatter")
        a2a = np.concatenate([xs[j][peer * k : (peer + 1) * k] for j in range(world)])
        same(col.all_to_all(peer, x), a2a, f"all_to_all {length}")
        inplace = x.copy()
        col.all_to_all(peer, inplace, out=inplace)
        same(inplace, a2a, "all_to_all in place")
        inplace = x.copy()
        col.all_reduce(peer, inplace, out=inplace)
        same(inplace, reduced(xs, "sum"), "all_reduce in place")
        same(col.all_gather(peer, x), np.stack(xs), "all_gather")
        out = np.empty((world, *x.shape), x.dtype)
        same(col.all_gather(peer, x, out=out), np.stack(xs), "all_gather out=")
        count += 6
        for root in range(world):
            got = col.reduce(peer, x, "sum", root=root)
            assert got is None if peer != root else same(got, reduced(xs, "sum"), "reduce") is None
            same(col.broadcast(peer, x if peer == root else None), xs[root], f"broadcast {length} {root}")
            out = np.empty_like(x)
            same(col.broadcast(peer, x if peer == root else None, out=out), xs[root], "broadcast out=")
            got = col.gather(peer, x, root=root)
            assert got is None if peer != root else same(got, np.stack(xs), "gather") is None
            rows = data(root, (world, 3, k), dtype, salt + 1)
            same(col.scatter(peer, rows if peer == root else None, root=root), rows[peer], "scatter")
            count += 5
    # read in pieces, never packed: every rank's slice of a chunk spans several arrays, more than
    # one chunk, two dtypes (two buckets), a non-contiguous array; then a bucket of one chunk (ranks
    # 0 and 1 pack it whole into shared memory, the others read their slice in pieces)
    many = [(3,), (4, 5), (), (70_000,)] + [(5_003,), (7,), (40, 33)] * 60
    one_chunk = [(3,), (40, 33), (), (20_000,), (100, 50), (1,)]
    cases = [
        (many, ["float32"] * 4 + ["float32", "int32", "float32"] * 60),
        (one_chunk, ["float32"] * len(one_chunk)),
    ]
    for (shapes, dtypes), op in itertools.product(cases, ("sum", "max")):
        everyone = [[data(p, s, d, 5) for s, d in zip(shapes, dtypes, strict=True)] for p in range(world)]
        parts = [a.T if a.ndim == 2 else a for a in everyone[peer]]
        results = col.all_reduce_coalesced(peer, parts, op)
        for index, got in enumerate(results):
            expected = reduced([e[index] for e in everyone], op)
            same(got, expected.T if expected.ndim == 2 else expected, f"all_reduce_coalesced {op} {index}")
        floats = np.concatenate([a.reshape(-1) for a, d in zip(parts, dtypes, strict=True) if d == "float32"])
        whole = col.all_reduce(peer, floats, op)  # the same bytes as one array: the same bits
        got = np.concatenate([r.reshape(-1) for r, d in zip(results, dtypes, strict=True) if d == "float32"])
        same(got, whole, f"all_reduce_coalesced {op} vs one array")
        count += 2
    col.barrier(peer)
    return count + 1


def groups(peer: int, world: int) -> int:
    """Every subset of the job twice, in one order everywhere: more groups than channels."""
    count = 0
    subsets = [s for size in range(1, world + 1) for s in itertools.combinations(range(world), size)]
    for round_ in range(2):
        for subset in subsets:
            if peer not in subset:
                continue
            group = col.new_group(list(subset))
            xs = [data(p, 100 + len(subset), "float64", round_) for p in subset]
            same(col.all_reduce(peer, xs[subset.index(peer)], group=group), reduced(xs, "sum"), str(subset))
            count += 1
    return count


def evicted(peer: int, world: int, extra: str = "2", how: str = "calls") -> int:
    """5 processes: peer 0 uses 9 groups, peer 1 only two of them, so peer 0 evicts the channel of
    [0, 1] (8 channels a segment) and gives it to [0, 1, 2], which runs ``extra`` more steps; then
    [0, 1] goes on, and peer 1 must find its new channel (not read [0, 1, 2]'s). ``how``
    "persistent": [0, 1] runs its steps as uses of one persistent all_reduce (each use after the
    first repeats what the last found: the new channel must be found all the same)."""
    others = [(0, 2), (0, 3), (0, 4), (0, 2, 3), (0, 2, 4), (0, 3, 4), (0, 2, 3, 4), (0, 1, 2)]
    plan = [((0, 1), 1.0 + k) for k in range(3 if how == "persistent" else 1)]
    plan += [(m, 10.0 + i) for i, m in enumerate(others)]
    plan += [(others[-1], 100.0 + k) for k in range(int(extra))] + [((0, 1), 20.0 + k) for k in range(3)]
    kept = np.zeros(8)
    handle = None
    if how == "persistent" and peer in (0, 1):
        handle = col.all_reduce_init(peer, kept, out=kept, group=col.new_group([0, 1]))
    count = 0
    for members, value in plan:
        if peer in members:
            expected = np.full(8, value * sum(p + 1 for p in members))
            if handle is not None and members == (0, 1):
                kept[:] = value * (peer + 1)
                same(handle(), expected, f"{members}, a use")
            else:
                got = col.all_reduce(peer, np.full(8, value * (peer + 1)), group=col.new_group(list(members)))
                same(got, expected, str(members))
            count += 1
    if handle is not None:
        handle.free()
    return count


def concurrent(peer: int, world: int) -> int:
    """Two threads of each process: the whole job and the group of peers 0 and 1 at once."""
    pair = col.new_group([0, 1])
    failures: list[BaseException] = []

    def run(group: Any, members: list[int], length: int) -> None:
        try:
            for i in range(60):
                xs = [data(p, length, "float32", i) for p in members]
                got = col.all_reduce(peer, xs[members.index(peer)], group=group)
                same(got, reduced(xs, "sum"), f"group {members} call {i}")
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(None, list(range(world)), 300_000))]
    if peer in (0, 1):
        threads.append(threading.Thread(target=run, args=(pair, [0, 1], 50)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return 60 * len(threads)


def mismatch(peer: int, world: int, how: str) -> int:
    """Two good collectives, then peer 0 calls differently from the others (#2, a host tier's 5th
    step); then a good collective."""
    for _ in range(2):
        col.all_reduce(peer, np.ones(2))
    odd = peer == 0
    x = np.zeros(5 if (how == "shape" and odd) else 4, np.float32 if (how == "dtype" and odd) else np.float64)
    if how == "collective" and odd:
        col.reduce(peer, x)
    elif how == "op":
        col.all_reduce(peer, x, "max" if odd else "sum")
    elif how == "root":
        col.reduce(peer, x, root=0 if odd else 1)
    elif how == "invalid":
        col.all_reduce(peer, np.zeros(4, bool) if odd else x)
    elif how == "broadcast":
        col.broadcast(peer, x if peer < 2 else None)
    elif how == "sources":  # (peer 1 does not lead its host on "aab")
        col.broadcast(peer, x if peer in (1, 2) else None)
    elif how == "out":
        col.broadcast(peer, x if peer == 2 else None, out=np.empty(7) if peer == 1 else None)
    else:
        col.all_reduce(peer, x)
    return 1


def loop(peer: int, world: int, size: str = "2") -> int:
    """Small (or ``size``-element) all_reduce until something breaks; READY once running."""
    x = np.ones(int(size), np.float32)
    for i in range(10_000_000):
        col.all_reduce(peer, x)
        if i == 20 and peer == 0:
            say("READY")
    return 0


def crash(peer: int, world: int) -> int:
    """Peer 0 fails inside a large step with a plain exception while its process lives on; then
    every process runs the same collective again (the job stays usable)."""
    import collective.shm.chunks

    kept = collective.shm.chunks.reduce_all
    if peer == 0:

        def broken(*args: Any) -> None:
            raise MemoryError("simulated")

        collective.shm.chunks.reduce_all = broken  # type: ignore[assignment]
    x = np.ones(1 << 20, np.float32)
    try:
        col.all_reduce(peer, x)
    except (MemoryError, col.CollectiveError) as exc:
        say(f"ERROR {type(exc).__name__} - {exc}")
    collective.shm.chunks.reduce_all = kept  # type: ignore[assignment]
    same(col.all_reduce(peer, x), np.full(1 << 20, world, np.float32), "after the failure")
    say("AFTER")
    return 1


def late(peer: int, world: int, delay: str = "2", who: str = "-1", early: str = "") -> int:
    """Peer ``who`` (the last by default) comes ``delay`` s late: the others time out naming it, so
    does it; then all go on. With ``early``: only peer 0 times out (at 1 s), the others would wait
    on: every peer fails the step all the same (one saw the others come and completed it)."""
    if peer == int(who) % world:
        time.sleep(float(delay))  # (kept: the lateness under test, past the others' timeout)
    try:
        col.all_reduce(peer, np.ones(3), timeout=1.0 if peer == 0 or not early else 20)
        raise AssertionError("a result of a step peer 0 gave up")
    except col.CollectiveTimeout as exc:
        say(f"TIMEOUT {list(exc.missing)} {exc}")
    same(col.all_reduce(peer, np.ones(3)), np.full(3, float(world)), "after the timeout")
    return 1


def crowded(peer: int, world: int, calls: str = "300") -> int:
    """Many small collectives and a few larger ones (oversubscribed: more processes than cores)."""
    started = time.monotonic()
    x, big = np.full(2, peer, np.float32), np.ones(1 << 18, np.float32)
    for i in range(int(calls)):
        same(col.all_reduce(peer, x), np.full(2, world * (world - 1) / 2, np.float32), "small")
        if i % 100 == 0:
            same(col.all_reduce(peer, big), np.full(1 << 18, world, np.float32), "1 MiB")
    say(f"TIME {time.monotonic() - started:.2f}")
    return int(calls)


def many(peer: int, world: int, how: str = "same") -> int:
    """all_reduce_coalesced of 3000 arrays (their list travels as a digest); with "differ", peer
    0's array 1000 has another shape: a MismatchError everywhere, then the job goes on."""
    shapes = [(3,)] * 3000
    if how == "differ" and peer == 0:
        shapes[1000] = (4,)
    xs = [np.full(shape, peer + 1, np.float32) for shape in shapes]
    try:
        results = col.all_reduce_coalesced(peer, xs)
    except col.MismatchError as exc:
        say(f"MISMATCH {exc}")
        results = col.all_reduce_coalesced(peer, [np.full(3, peer + 1, np.float32)] * 3000)
    expected = np.full(3, world * (world + 1) / 2, np.float32)
    assert len(results) == 3000 and all(np.array_equal(r, expected) for r in results)
    return 1


def overlap(peer: int, world: int) -> int:
    """The whole job and the group of peers 0-2 take turns: on a host of peers 0 and 1 both
    groups' host tiers hold the same processes (each its own channel, never the other's data)."""
    trio = col.new_group([0, 1, 2])
    count = 0
    for i in range(20):
        x = data(peer, 5 + i % 3, "float32", i)
        same(
            col.all_reduce(peer, x),
            reduced([data(p, x.shape, "float32", i) for p in range(world)], "sum"),
            "job",
        )
        count += 1
        if peer < 3:
            y = data(peer, 7, "float64", 100 + i)
            expected = reduced([data(p, 7, "float64", 100 + i) for p in range(3)], "sum")
            same(col.all_reduce(peer, y, group=trio), expected, "group")
            count += 1
    return count


def lead_fails(peer: int, world: int) -> int:
    """Peer 0 (its host's leader) fails with a plain exception in its global phase, after its
    host's shared-memory step: every process hears at once; then the job goes on."""
    from collective.calls.movement import Reduction

    kept = Reduction.contribution
    if peer == 0:

        def broken(*args: Any) -> None:
            raise MemoryError("simulated")

        Reduction.contribution = broken  # type: ignore[method-assign]
    try:
        col.all_reduce(peer, np.ones(4, np.float32), timeout=30)
    except (MemoryError, col.CollectiveError) as exc:
        say(f"ERROR {type(exc).__name__} - {exc}")
    Reduction.contribution = kept  # type: ignore[method-assign]
    same(col.all_reduce(peer, np.ones(4, np.float32)), np.full(4, world, np.float32), "after the failure")
    say("AFTER")
    return 1


def byte_order(peer: int, world: int) -> int:
    """Arrays in big-endian byte order (numpy computes in them) through every kind of move: the
    agreement, the arithmetic, inline and chunked data, point to point; then a long double, which
    no process takes (its layout is the platform's), refused on every peer."""
    count = 0
    for dtype, length in itertools.product((">f4", ">i8", ">c16"), (5, 300_001)):
        xs = [data(p, world * length, dtype, length) for p in range(world)]
        x = xs[peer]
        same(col.all_reduce(peer, x), reduced(xs, "sum"), f"all_reduce {dtype} {length}")
        same(col.broadcast(peer, x if peer == 1 else None), xs[1], f"broadcast {dtype}")
        same(col.all_gather(peer, x), np.stack(xs).astype(dtype), f"all_gather {dtype}")  # (stack: native)
        k = length
        same(col.reduce_scatter(peer, x), reduced(xs, "sum")[peer * k : (peer + 1) * k], "reduce_scatter")
        col.send(peer, x, dst=(peer + 1) % world, tag=length)
        same(col.recv(peer, src=(peer - 1) % world, tag=length), xs[(peer - 1) % world], f"recv {dtype}")
        count += 5
    try:
        col.all_reduce(peer, np.ones(3, np.longdouble))
    except col.InvalidArgumentError as exc:
        assert "long double" in str(exc) and f"peer {world - 1}" in str(exc), exc
    else:
        raise AssertionError("a long double all_reduce was not refused")
    same(col.all_reduce(peer, np.ones(3, ">f8")), np.full(3, world, ">f8"), "after the refusal")
    return count + 2


def leaves(peer: int, world: int, gates: str) -> int:
    """Peer 1 finishes at once; the others' first collective is a PeerLostError saying it left.
    Peer 2 comes once peer 0 has failed and ended too: it names both. (The test opens peer 0's
    gate once peer 1's process ended, peer 2's once peer 0's did.)"""
    if peer != 1:
        gate(gates, peer)
        col.all_reduce(peer, np.ones(2))
    return 1


def leaves_after(peer: int, world: int, gates: str) -> int:
    """The last peer's two async all_reduces, then it finishes (waiting for them) and its process
    exits; the others come late (the test opens their gates once it says FINISHING): their third
    all_reduce finds a process that left, not one that died."""
    if peer == world - 1:
        works = [col.all_reduce(peer, np.ones(2), async_op=True) for _ in range(2)]
        say("FINISHING")
        col.finish(peer)
        assert all(work.is_completed() for work in works)
        os._exit(0)
    gate(gates, peer)
    for _ in range(3):
        col.all_reduce(peer, np.ones(2))
    return 3


BUSY = [(0, 1), (0, 2), (0, 3), (0, 4), (0, 1, 2), (0, 1, 3), (0, 1, 4), (0, 2, 3)]  # peer 0's 8 channels


def no_channel(peer: int, world: int, elements: str, gates: str) -> int:
    """Peer 0 keeps 8 groups inside a step (their other members come once the test saw NOCHANNEL),
    so its call on a 9th group G waits for a channel until its 0.5 s timeout. Peers 2 and 4 wait in
    that step of G: they must get peer 0's reason once it gets a channel for G's next step. They
    summed the data the channel's previous group had left in it, as if peer 0 had taken part."""
    n, group = int(elements), col.new_group([0, 2, 4])
    count = 0
    if peer == 0:
        with channels_given() as given:
            works = [
                col.all_reduce(0, np.full(n, 100.0 + k), group=col.new_group(list(m)), async_op=True)
                for k, m in enumerate(BUSY)
            ]
            until(lambda: len(given) == len(BUSY), 30, "each busy group holding a channel")
        try:
            col.all_reduce(0, np.full(n, 1000.0), group=group, timeout=0.5)
            raise AssertionError("a step of G without a channel")
        except col.CollectiveTimeout as exc:
            say(f"NOCHANNEL {exc}")
        for k, work in enumerate(works):
            same(work.wait(), np.full(n, 100.0 + k + sum(p + 1.0 for p in BUSY[k] if p)), "busy")
        count = len(works)
    else:
        gate(gates, peer)
        for members in [m for m in BUSY if peer in m]:
            col.all_reduce(peer, np.full(n, peer + 1.0), group=col.new_group(list(members)))
            count += 1
        if peer in (2, 4):
            try:
                col.all_reduce(peer, np.full(n, peer + 1.0), group=group, timeout=30)
                raise AssertionError("G's step without peer 0 gave a result")
            except col.CollectiveTimeout as exc:
                say(f"TOLD {exc}")
    if peer in (0, 2, 4):  # the next step of G works
        same(col.all_reduce(peer, np.full(n, peer + 1.0), group=group), np.full(n, 9.0), "G after")
    col.barrier(peer)
    return count + 1


def absent(peer: int, world: int) -> int:
    """Peer 1 never comes to the second step of G = [0, 1]: peer 0 times out. Then peer 0 needs its
    channels for 8 other groups: G's, waiting for peer 1, must not be the one given up (its release
    waited for peer 1 until each new group's timeout), nor stall the others."""
    g = col.new_group([0, 1])
    if peer in (0, 1):
        col.all_reduce(peer, np.ones(2), group=g)
    if peer == 0:
        try:
            col.all_reduce(peer, np.ones(2), group=g, timeout=0.5)
        except col.CollectiveTimeout as exc:
            say(f"TIMEOUT {exc}")
    if peer != 1:
        col.barrier(peer, group=col.new_group([0, 2, 3, 4]))
    count = 0
    others = [m for r in (2, 3, 4) for m in itertools.combinations((0, 2, 3, 4), r)]  # 11 groups
    for members in others if peer != 1 else ():
        if peer in members:
            got = col.all_reduce(peer, np.full(2, peer + 1.0), group=col.new_group(list(members)), timeout=20)
            same(got, np.full(2, sum(p + 1.0 for p in members)), f"group {members}")
            count += 1
    col.barrier(peer)
    return count


def gave_up(peer: int, world: int) -> int:
    """G = (0, 1, 2), 6 processes. Peer 0 times out in G's step 0 waiting for the late peer 1 (it
    never looked peer 2's channel up); peer 2 waits on. Peer 0 then needs channels for 8 groups:
    it gave G's to H = (0, 1, 3), whose step 0 was the same call, and peer 2 summed H's data once
    peer 1 came. Every member of G's step must fail; the job goes on."""
    g, others = (0, 1, 2), [(0, 3), (0, 4), (0, 5), (0, 3, 4), (0, 3, 5), (0, 4, 5), (0, 3, 4, 5), (0, 1, 3)]

    def run(members: tuple[int, ...], value: float, timeout: float = 20) -> Any:
        return col.all_reduce(peer, np.full(2, value), group=col.new_group(list(members)), timeout=timeout)

    if peer in (0, 2):
        try:
            run(g, 1000.0 if peer == 0 else 3.0, 0.5 if peer == 0 else 20)
            raise AssertionError("a result of a step peer 0 gave up")
        except col.CollectiveError as exc:
            say(f"GAVE {type(exc).__name__} {exc}")
    for members in others if peer != 2 else ():
        if peer in members:
            same(run(members, peer + 1.0), np.full(2, sum(p + 1.0 for p in members)), f"group {members}")
    if peer == 1:
        try:
            run(g, 2.0, 5)
            raise AssertionError("a result of a step peer 0 gave up")
        except col.CollectiveError as exc:
            say(f"GAVE {type(exc).__name__} {exc}")
    col.barrier(peer)
    return 1


def unmapped(peer: int, world: int, gates: str) -> int:
    """Peer 1 finishes at once: peer 0's first step on [0, 1] (once the test saw peer 1's process
    end) fails mapping peer 1's segment. Then peer 0 needs channels for more groups than it has:
    giving that group's up raised IndexError."""
    if peer == 1:
        return 0
    if peer == 0:
        gate(gates, peer)
        try:
            col.all_reduce(peer, np.ones(2), group=col.new_group([0, 1]))
            raise AssertionError("a step with a peer that left")
        except col.PeerLostError as exc:
            say(f"LEFT {exc}")
    rest = [p for p in range(world) if p != 1]
    count = 0
    for members in [c for r in range(2, len(rest) + 1) for c in itertools.combinations(rest, r) if 0 in c]:
        if peer in members:
            got = col.all_reduce(peer, np.full(2, peer + 1.0), group=col.new_group(list(members)), timeout=10)
            same(got, np.full(2, sum(p + 1.0 for p in members)), f"group {members}")
            count += 1
    return count


MODES = {
    "byte_order": byte_order,
    "leaves": leaves,
    "leaves_after": leaves_after,
    "every": every,
    "many": many,
    "overlap": overlap,
    "lead_fails": lead_fails,
    "groups": groups,
    "evicted": evicted,
    "concurrent": concurrent,
    "mismatch": mismatch,
    "loop": loop,
    "crash": crash,
    "late": late,
    "crowded": crowded,
    "no_channel": no_channel,
    "absent": absent,
    "gave_up": gave_up,
    "unmapped": unmapped,
}


def ring_segment() -> str | None:
    """The name of this process's ring segment (its segment in /dev/shm with the ring's magic)."""
    for name in os.listdir("/dev/shm"):
        match = NAME.fullmatch(name)
        if match is not None and int(match.group(1)) == os.getpid():
            with open(f"/dev/shm/{name}", "rb") as handle:
                if handle.read(8) == RingSegment.MAGIC:
                    return name
    return None


def main() -> int:
    mode, extra = sys.argv[1], sys.argv[2:]
    config = col.CollectiveConfig.from_env()
    (peer,) = col.peer_ids_from_env()
    world = config.num_nodes or 1
    started = time.monotonic()
    try:
        col.register(peer, "cpu", config)
        say(f"RING {ring_segment()}")
        try:
            count = MODES[mode](peer, world, *extra)
        except col.CollectiveError as exc:
            say(f"ERROR {type(exc).__name__} {time.monotonic() - started:.2f} {exc}")
            if mode == "mismatch":  # the job goes on after a mismatch
                same(col.all_reduce(peer, np.ones(3)), np.full(3, float(world)), "after the mismatch")
                say(f"AFTER {dict(shm_executor.STEPS)}")
            col.finish(peer)
            return 3
        say(f"OK {count} SHM {sum(shm_executor.STEPS.values())}")
        col.finish(peer)
        return 0
    except BaseException as exc:
        say(f"ERROR {type(exc).__name__} - {exc}")
        return 3


if __name__ == "__main__":
    sys.exit(main())
