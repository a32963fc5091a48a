"""A node of a multi-node test job: run as a process by tests/test_multinode.py.

Usage: python tests/node_worker.py MODE [ARG ...]   (the job comes from COLLECTIVE_* variables)

Every node knows every peer's input (a function of the peer id), so it checks each result
against a reference it computes itself. Output lines: "OK <collectives>" at the end, or
"ERROR <class> <message>" per failing peer (exit status 3), "READY" when a loop has started.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import collective as col

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.matrix, run as a script
from tests.matrix import reduced as reference

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


def matrix(peer: int, world: int) -> int:
    """Every op for all_reduce (the bitwise ones on integers), sum and max reduce at every root,
    broadcast from every root."""
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
        integers = [values.astype(np.int64) * 37 for values in everyone]
        for op in ("band", "bor", "bxor"):
            got = col.all_reduce(peer, integers[peer], op)
            np.testing.assert_array_equal(got, reference(integers, op), err_msg=f"all_reduce {op} {length}")
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


def loop(peer: int, world: int, settle: str = "0") -> int:
    """All-reduce 1 MiB until something breaks; print READY once running (for ``settle`` seconds
    at least: long enough for heartbeats to have told the orchestrator what the peers do)."""
    x = np.ones(1 << 17)
    began, ready = time.monotonic(), False
    for i in range(1_000_000):
        col.all_reduce(peer, x)
        if not ready and i >= 2 and peer == 0 and time.monotonic() - began >= float(settle):
            say("READY")
            ready = True
    return 0


def slow(peer: int, world: int, rounds: str, short: str) -> int:
    """``rounds`` checked 1 MiB all_reduces, "ROUND <i> <seconds>" after each, then one with a
    timeout of ``short`` seconds (too short for the link: it raises)."""
    x = data(peer, 1 << 17)
    everyone = [data(p, 1 << 17) for p in range(world)]
    for i in range(int(rounds)):
        started = time.monotonic()
        np.testing.assert_array_equal(col.all_reduce(peer, x), reference(everyone, "sum"))
        say(f"ROUND {i} {time.monotonic() - started:.2f}")
    col.all_reduce(peer, x, timeout=float(short))
    return int(rounds)


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


def group_mismatch(peer: int, world: int) -> int:
    """3 nodes x 2 peers: in the group of peers 1, 2, 3 and 5, peer 1 passes another shape."""
    group = col.new_group([1, 2, 3, 5])
    if peer in group.members:
        col.all_reduce(peer, np.zeros(4 if peer == 1 else 3), group=group)
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
            time.sleep(min(0.05, float(pause)))  # (kept: the idle time under test; polls the file)
    return count


def persistent(peer: int, world: int, how: str = "uses") -> int:
    """Persistent collectives of every kind, 3 uses each on changing inputs, against references;
    ``how="lost"``: peer 1's process ends after the first use, and the others' next use fails."""
    count = 0
    x, block, row, source = np.zeros(5), np.zeros(3), np.zeros(2 * world), np.zeros(4)
    total = col.all_reduce_init(peer, x, out=x)
    gathered = col.all_gather_init(peer, block)
    scattered = col.reduce_scatter_init(peer, row)
    sent = col.broadcast_init(peer, source if peer == 0 else None)
    met = col.barrier_init(peer)
    for use in range(3):
        everyone = [data(p, 5, use) for p in range(world)]
        x[:] = everyone[peer]
        got = total()
        assert got is x, "the result is written into out=x"
        np.testing.assert_array_equal(got, reference(everyone, "sum"), err_msg=f"all_reduce use {use}")
        if how == "lost" and peer == 1:
            say("LEAVING")
            os._exit(0)  # (no finish: the process ends as a crash ends it)
        blocks = [data(p, 3, 10 + use) for p in range(world)]
        block[:] = blocks[peer]
        np.testing.assert_array_equal(gathered(), np.stack(blocks), err_msg=f"all_gather use {use}")
        rows = [data(p, 2 * world, 20 + use) for p in range(world)]
        row[:] = rows[peer]
        expected = reference(rows, "sum")[2 * peer : 2 * peer + 2]
        np.testing.assert_array_equal(scattered(), expected, err_msg=f"reduce_scatter use {use}")
        source[:] = use
        np.testing.assert_array_equal(sent(), np.full(4, float(use)), err_msg=f"broadcast use {use}")
        met()
        count += 5
    for handle in (total, gathered, scattered, sent, met):
        handle.free()
    # A strided input (packed again at each use), its uses between normal calls of the group
    base = np.zeros(8)
    strided = col.all_reduce_init(peer, base[::2])
    for use in range(3):
        base[::2] = peer + use
        expected = sum(p + use for p in range(world))
        np.testing.assert_array_equal(strided(), np.full(4, float(expected)), err_msg=f"strided use {use}")
        assert col.all_reduce(peer, np.ones(1))[0] == world, "a normal call between uses"
        count += 2
    # Peer 0 uses its handle while the others free theirs: a mismatch on every peer, naming the free
    try:
        strided() if peer == 0 else strided.free()
        raise AssertionError("a use met a free without an error")
    except col.MismatchError as exc:
        assert "all_reduce_free" in str(exc), exc
        count += 1
    strided.free()  # (freed already: nothing to do)
    return count


def kept(peer: int, world: int) -> int:
    """Normal calls that come again on the same arrays (kept, collective.persistent.kept): their
    inputs read at each call, the later ones run as the first one's step again (between processes
    of a host: its last small step published again); a mismatch with a kept call and a read-only
    ``out`` fail every peer, and the group goes on."""
    count = 0
    x, out, block, gathered = np.zeros(5), np.zeros(5), np.zeros(3), np.zeros((world, 3))
    for use in range(4):
        everyone = [data(p, 5, use) for p in range(world)]
        x[:] = everyone[peer]
        assert col.all_reduce(peer, x, out=out) is out
        np.testing.assert_array_equal(out, reference(everyone, "sum"), err_msg=f"all_reduce use {use}")
        blocks = [data(p, 3, 10 + use) for p in range(world)]
        block[:] = blocks[peer]
        col.all_gather(peer, block, out=gathered)
        np.testing.assert_array_equal(gathered, np.stack(blocks), err_msg=f"all_gather use {use}")
        col.all_reduce(peer, x, "max", out=x)
        np.testing.assert_array_equal(x, reference(everyone, "max"), err_msg=f"in place use {use}")
        count += 3
    noted = (col.default_runtime()._kept_calls or {}).values()
    calls = [kept.call for kept in noted if hasattr(kept, "call")]  # (kept: not only noted once)
    assert len(calls) == 3 and all(call.last is not None for call in calls), "kept, and run again"
    out.flags.writeable = peer != 0
    try:
        col.all_reduce(peer, x, out=out)
        raise AssertionError("a read-only out was not refused")
    except col.InvalidArgumentError as exc:
        assert "out" in str(exc), exc
        count += 1
    out.flags.writeable = True
    try:  # peer 0 calls what it kept, the others another op on the same arrays
        col.all_reduce(peer, x, "sum" if peer == 0 else "min", out=out)
        raise AssertionError("a kept call met another without an error")
    except col.MismatchError:
        count += 1
    x[:] = peer
    assert col.all_reduce(peer, x, out=out)[0] == sum(range(world)), "the group goes on"
    return count + 1


def persistent_p2p(peer: int, world: int) -> int:
    """Peers 0 and 1 pass a message back and forth 4 times through persistent sends and receives
    (each use: the contents then, into the same buffer), between processes; a receive started
    takes its message before a recv made after it."""
    other, out, back = 1 - peer, np.zeros(6), np.zeros(6)
    sent = col.send_init(peer, out, dst=other, tag=4 + peer)
    got = col.recv_init(peer, src=other, tag=4 + other, out=back)
    count = 0
    for use in range(4):
        if peer == 0:
            out[:] = np.arange(6) + 10 * use
            sent()
            assert got() is back and back.tolist() == (np.arange(6) + 10 * use + 1).tolist(), (use, back)
        else:
            got()
            out[:] = back + 1
            sent()
        count += 2
    if peer == 0:  # (receives from another process match in the order started too)
        for value in (1.0, 2.0):
            col.send(peer, np.full(6, value), other, tag=9)
    else:
        later = col.recv_init(peer, src=other, tag=9)
        later.start()
        assert col.recv(peer, other, tag=9)[0] == 2.0 and later.wait()[0] == 1.0, "in the order started"
        later.free()
    count += 1
    sent.free()
    got.free()
    return count


# -- the collective set ("collective_set" mode) ---------------------------------------------------

# Elements per block: tiny blocks travel inside the call exchange among leaders; 200 KiB blocks
# (float64) exceed its 64 KiB and move over the ZeroMQ link with the global strategy.
SET_BLOCKS = [0, 1, 3, 17, (200 << 10) // 8]
SET_OPS = ["sum", "mean", "max"]


def _check(got: Any, expected: np.ndarray | None, what: str) -> None:
    if expected is None:
        assert got is None, f"{what}: expected None, got {got!r}"
        return
    assert isinstance(got, np.ndarray), f"{what}: expected an array, got {got!r}"
    assert got.shape == expected.shape and got.dtype == expected.dtype, (
        f"{what}: got {got.shape} {got.dtype}, expected {expected.shape} {expected.dtype}"
    )
    if expected.dtype.kind == "f":
        np.testing.assert_allclose(got, expected, rtol=1e-12, err_msg=what)
    else:
        np.testing.assert_array_equal(got, expected, err_msg=what)


def every_collective(peer: int, members: list[int], group: Any, salt: int) -> int:
    """Every new collective among ``members`` (``group`` None for the whole job), checked here."""
    n, rank, count = len(members), members.index(peer), 0
    for size_index, e in enumerate(SET_BLOCKS):
        tag = f"group {members} block {e}"
        seed = 100 * salt + size_index
        single = [data(p, e, seed) for p in members]
        blocked = [data(p, n * e, seed + 50) for p in members]
        mine, my_rows = single[rank], blocked[rank]
        got = col.all_gather(peer, mine, group=group)
        _check(got, np.stack(single), f"all_gather {tag}")
        for op in SET_OPS:
            got = col.reduce_scatter(peer, my_rows, op, group=group)
            _check(got, reference(blocked, op)[rank * e : (rank + 1) * e], f"reduce_scatter {op} {tag}")
        got = col.all_to_all(peer, my_rows, group=group)
        expected = np.concatenate([x[rank * e : (rank + 1) * e] for x in blocked])
        _check(got, expected, f"all_to_all {tag}")
        for root in members:
            got = col.gather(peer, mine, root=root, group=group)
            _check(got, np.stack(single) if peer == root else None, f"gather root {root} {tag}")
            stack = data(root, n * e, seed + 70).reshape(n, e)
            got = col.scatter(peer, stack if peer == root else None, root=root, group=group)
            _check(got, stack[rank], f"scatter root {root} {tag}")
        assert col.barrier(peer, group=group) is None
        ints = [(np.arange(5) * (p + 1)).astype(np.int32) for p in members]
        got_list = col.all_reduce_coalesced(peer, [mine, my_rows, ints[rank]], "sum", group=group)
        for got, everyone, what in zip(
            got_list, (single, blocked, ints), ("block", "rows", "ints"), strict=True
        ):
            _check(got, reference(everyone, "sum"), f"all_reduce_coalesced {what} {tag}")
        count += 4 + len(SET_OPS) + 2 * n
    return count


SET_DTYPES = ["float32", "int32", "float16", "bfloat16"]
SET_DTYPE_BLOCKS = [3, (100 << 10) // 2]  # elements: in the call exchange; past 64 KiB for every dtype


def _dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def every_dtype(peer: int, world: int) -> int:
    """all_gather, reduce_scatter, all_to_all in place, gather, scatter (with out=) and a coalesced
    list of mixed dtypes, for each dtype on the wire; small integers, so every result is exact."""
    count = 0
    for name in SET_DTYPES:
        dtype = _dtype(name)
        for e in SET_DTYPE_BLOCKS:
            tag = f"{name} block {e}"
            single = [data(p, e, 7).astype(dtype) for p in range(world)]
            blocked = [data(p, world * e, 8).astype(dtype) for p in range(world)]
            out = np.zeros((world, e), dtype)
            got = col.all_gather(peer, single[peer], out=out)
            assert got is out, tag
            _check(got.astype(np.float64), np.stack(single).astype(np.float64), f"all_gather {tag}")
            got = col.reduce_scatter(peer, blocked[peer], "sum")
            expected = reference([x.astype(np.float64) for x in blocked], "sum")[peer * e : (peer + 1) * e]
            assert got.dtype == dtype, tag
            _check(got.astype(np.float64), expected, f"reduce_scatter {tag}")
            mine = blocked[peer].copy()
            got = col.all_to_all(peer, mine, out=mine)
            assert got is mine, tag
            expected = np.concatenate([x[peer * e : (peer + 1) * e] for x in blocked])
            _check(got.astype(np.float64), expected.astype(np.float64), f"all_to_all out=x {tag}")
            got = col.gather(peer, single[peer], root=world - 1)
            if peer == world - 1:
                _check(got.astype(np.float64), np.stack(single).astype(np.float64), f"gather {tag}")
            else:
                assert got is None, tag
            stack = data(0, world * e, 9).astype(dtype).reshape(world, e)
            out = np.zeros(e, dtype)
            got = col.scatter(peer, stack if peer == 0 else None, root=0, out=out)
            assert got is out, tag
            _check(got.astype(np.float64), stack[peer].astype(np.float64), f"scatter {tag}")
            count += 5
    mixed = [data(peer, 5, 10).astype(_dtype(name)) for name in SET_DTYPES]
    everyone = [[data(p, 5, 10).astype(_dtype(name)) for name in SET_DTYPES] for p in range(world)]
    for got, name, index in zip(
        col.all_reduce_coalesced(peer, mixed, "max"), SET_DTYPES, range(4), strict=True
    ):
        expected = reference([row[index].astype(np.float64) for row in everyone], "max")
        assert got.dtype == _dtype(name)
        _check(got.astype(np.float64), expected, f"all_reduce_coalesced {name}")
    return count + 1


def set_groups(world: int) -> list[list[int]]:
    """Groups spanning nodes (3 nodes x 2 peers: node k holds peers 2k, 2k+1): one peer per node;
    nodes 0 and 1; two peers of node 1 with one of node 2 (nodes holding different counts)."""
    if world == 6:
        return [[0, 3, 4], [1, 2], [2, 3, 5]]
    return [[world - 1], list(range(world))]


def collective_set(peer: int, world: int, *parts: str) -> int:
    """The new collectives over the whole job ("world"), for several dtypes ("dtypes"), on groups
    one at a time ("groups"), and on the first two groups (disjoint with 3 nodes x 2 peers) at the
    same time ("concurrent_groups")."""
    count = 0
    if "world" in parts:
        count += every_collective(peer, list(range(world)), None, 1)
    if "dtypes" in parts:
        count += every_dtype(peer, world)
    if "groups" in parts:
        for index, members in enumerate(set_groups(world)):
            if peer in members:
                count += every_collective(peer, members, col.new_group(members), 2 + index)
            col.barrier(peer)  # one group at a time
    if "concurrent_groups" in parts:
        for index, members in enumerate(set_groups(world)[:2]):
            if peer in members:  # each peer runs its own group's calls, the groups at once
                count += every_collective(peer, members, col.new_group(members), 10 + index)
        col.barrier(peer)
    return count


def collective_set_count(world: int, *parts: str) -> int:
    """What every peer of the job adds up to in collective_set (the test's expected total)."""
    per_group = len(SET_BLOCKS) * (4 + len(SET_OPS))
    count = 0
    if "world" in parts:
        count += world * (per_group + len(SET_BLOCKS) * 2 * world)
    if "dtypes" in parts:
        count += world * (5 * len(SET_DTYPES) * len(SET_DTYPE_BLOCKS) + 1)
    groups = set_groups(world)
    for members in (groups if "groups" in parts else []) + (
        groups[:2] if "concurrent_groups" in parts else []
    ):
        count += len(members) * (per_group + len(SET_BLOCKS) * 2 * len(members))
    return count


def _large(src: int, dst: int) -> np.ndarray:
    """9 MiB and a little more from ``src`` to ``dst``: three parts of a network chunk between processes."""
    return np.arange(((9 << 18) // 5 + 1) * 5, dtype=np.float32).reshape(-1, 5) * (src + 1) + dst


def p2p(peer: int, world: int) -> int:
    """Point to point across nodes: a ring with two tags, every pair sending both ways before
    receiving (a small array and one of over 9 MiB), shapes and dtypes that travel, order per
    (src, dst, tag); then the job still works."""
    right, left = (peer + 1) % world, (peer - 1) % world
    count = 0
    for round_ in range(3):
        big = np.full((300, 100), peer * 10 + round_, np.float32)  # 117 KiB: a payload frame of its own
        col.send(peer, big, right, tag=1)
        col.send(peer, np.array(peer + round_, np.int16), right, tag=2)  # 0-d, another dtype
        small = col.recv(peer, left, tag=2)
        assert small.shape == () and small.dtype == np.int16 and int(small) == left + round_, small
        got = col.recv(peer, left, tag=1)
        np.testing.assert_array_equal(got, np.full((300, 100), left * 10 + round_, np.float32))
        count += 2
    for other in range(world):  # every pair: send to each other first, then receive
        if other != peer:
            col.send(peer, np.arange(5.0) + peer, other, tag=7)
            col.send(peer, _large(peer, other), other, tag=8)  # in parts, interleaved with the others'
    for other in range(world):
        if other != peer:
            np.testing.assert_array_equal(col.recv(peer, other, tag=7), np.arange(5.0) + other)
            np.testing.assert_array_equal(col.recv(peer, other, tag=8), _large(other, peer))
            count += 1
    # one tag, sizes that take both paths between processes of a host (shared memory up to 1 MiB,
    # TCP past it, in parts past 4 MiB): received in the order sent
    sizes = [1, 700_000, 3, 300_000, 1_100_000, 5, 0, 2_000_000, 250_000, 7]
    for other in range(world):
        if other != peer:
            for k, size in enumerate(sizes):
                col.send(peer, np.full(size, peer * 100 + k, np.float32), other, tag=10)
    for other in range(world):
        if other != peer:
            for k, size in enumerate(sizes):
                got = col.recv(peer, other, tag=10)
                np.testing.assert_array_equal(got, np.full(size, other * 100 + k, np.float32))
            count += 1
    # from any source: every other peer sends peer 0 two messages; each source's in its order
    if peer != 0:
        for k in range(2):
            col.send(peer, np.array([peer, k]), 0, tag=9)
    else:
        got = [col.recv_any(peer, tag=9, timeout=20) for _ in range(2 * (world - 1))]
        assert all(int(array[0]) == source for source, array in got), got
        for source in range(1, world):
            assert [int(array[1]) for s, array in got if s == source] == [0, 1], got
    np.testing.assert_array_equal(col.all_reduce(peer, np.ones(3)), np.full(3, world))
    return count


def staggered(peer: int, world: int) -> int:
    """2 nodes x 2 peers, timeout 4 s: peer 1 comes at once, peer 0 3 s later, node 1's peers past
    peer 1's deadline and its 2 s of grace but within peer 0's deadline. One outcome for every
    peer: peer 1 timed out while the others completed (each local peer ran to its own deadline)."""
    col.barrier(peer)
    time.sleep({1: 0.0, 0: 3.0}.get(peer, 6.5))  # (kept: the lateness under test)
    try:
        col.all_reduce(peer, np.ones(2), timeout=4.0)
        say(f"COMPLETED {peer}")
    except col.CollectiveTimeout as exc:
        say(f"TIMEOUT {peer} {exc}")
    assert col.all_reduce(peer, np.ones(2))[0] == world  # the job goes on
    return 2


def remote_finish(peer: int, world: int, receiving: str = "receiving") -> int:
    """2 nodes x 2 peers: peer 3 finishes while its node stays (peer 2 is busy). Peer 0's receive
    from it and peer 1's collective on [1, 3] (shared memory) waited their whole timeout.
    ``quiet``: peer 0 receives nothing (its finish notice must arrive though nobody receives)."""
    col.barrier(peer)
    if peer == 2:
        time.sleep(4)  # (kept: the busy peer under test holds its node in the job)
    if peer == 0 and receiving == "quiet":
        return 1
    if peer in (0, 1):
        started = time.monotonic()
        try:
            if peer == 0:
                col.recv(peer, src=3, timeout=20)
            else:
                col.all_reduce(peer, np.ones(2), group=col.new_group([1, 3]), timeout=20)
        except col.PeerLostError as exc:
            say(f"LOST {peer} {time.monotonic() - started:.1f} {exc}")
    return 1


def sent_then_left(peer: int, world: int, left: str) -> int:
    """2 nodes x 1 peer: peer 0 sends a small message (shared memory between processes of a host)
    and its process exits; peer 1 receives it once the file ``left`` says so (the test writes it
    when node 0 exited), past the grace a node that left is given: the message is still read."""
    col.barrier(peer)
    if peer == 0:
        col.send(peer, np.arange(4.0), 1, tag=3)
        return 1
    deadline = time.monotonic() + 30
    while not os.path.exists(left) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.5)  # (kept: the lateness under test, past LEFT_GRACE)
    np.testing.assert_array_equal(col.recv(peer, 0, tag=3, timeout=10), np.arange(4.0))
    say("RECEIVED")
    return 1


def byte_order(peer: int, world: int) -> int:
    """Big-endian arrays across nodes, several peers per node (the node's contribution is reduced
    here): the reduction came back in native byte order and was read as '>f4' (garbage)."""
    count = 0
    for dtype in (">f4", ">i8"):
        for n in (4, 300_000):
            x = (np.arange(n) % 7 + peer + 1).astype(dtype)
            expected = sum((np.arange(n) % 7 + p + 1).astype(np.float64) for p in range(world))
            got = col.all_reduce(peer, x)
            assert got.dtype == np.dtype(dtype) and np.array_equal(got.astype(np.float64), expected), dtype
            y = (np.arange(world * n) % 7 + peer + 1).astype(dtype)
            rows = sum((np.arange(world * n) % 7 + p + 1).astype(np.float64) for p in range(world))
            got = col.reduce_scatter(peer, y)
            assert np.array_equal(got.astype(np.float64), rows[peer * n : (peer + 1) * n]), dtype
            count += 2
    say(f"OK {count}")
    return count


def skip(peer: int, world: int) -> int:
    """One all_reduce by every peer, then a second that the last peer skips (it works on at
    SKIPPED_LINE): the others time out after 1 s."""
    col.all_reduce(peer, np.ones(4))  # LAST_CALL
    if peer == world - 1:
        time.sleep(3)  # SKIPPED_LINE
        return 1
    col.all_reduce(peer, np.ones(4), timeout=1)
    return 2


def straggle(peer: int, world: int) -> int:
    """Five all_reduces, to each of which the last peer comes late (0.05 s)."""
    for _ in range(5):
        if peer == world - 1:
            time.sleep(0.05)  # the condition under test: a slow peer
        col.all_reduce(peer, np.ones(4))
    return 5


MODES = {
    "persistent": persistent,
    "kept": kept,
    "persistent_p2p": persistent_p2p,
    "byte_order": byte_order,
    "remote_finish": remote_finish,
    "sent_then_left": sent_then_left,
    "staggered": staggered,
    "p2p": p2p,
    "matrix": matrix,
    "loop": loop,
    "slow": slow,
    "mismatch": mismatch,
    "group_mismatch": group_mismatch,
    "crash": crash,
    "collective_set": collective_set,
    "until": until,
    "skip": skip,
    "straggle": straggle,
}


def tuning(peer: int, world: int) -> int:
    """Strategy auto across nodes: every node says what explain() predicts and what each call ran
    (the DEBUG line of collective.tuning), for sizes on both sides of what travels with the calls;
    the caller compares the nodes' lines (one peer per node says them)."""
    ran: dict[tuple[str, str], str] = {}  # (kind, bytes) -> the schedule auto ran

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            words = record.getMessage().split()  # auto: ring for all_reduce of 4096 bytes among ...
            if words[0] == "auto:":
                ran[(words[3], words[5])] = words[1]

    logger = logging.getLogger("collective.tuning")
    handler = Keep()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    first = min(col.peer_ids_from_env())
    if peer == first:
        figures = col.explain("all_reduce", 1 << 22)
        say(f"FIGURES {figures.source} {'spent' if figures.spent > 0 else 'free'}")
    try:
        calls = 0
        for kind in ("all_reduce", "all_gather", "broadcast"):
            for length in (1 << 12, 1 << 16, 1 << 18, 1 << 20):
                found = col.explain(kind, length * 4)
                x = np.full(length, peer + 1, np.float32)
                if kind == "all_reduce":
                    got = col.all_reduce(peer, x)
                    _check(got, np.full(length, world * (world + 1) / 2, np.float32), kind)
                elif kind == "all_gather":
                    got = col.all_gather(peer, x)
                    expected = np.repeat(np.arange(1, world + 1, dtype=np.float32), length).reshape(
                        world, length
                    )
                    _check(got, expected, kind)
                else:
                    got = col.broadcast(peer, x if peer == 0 else None)
                    _check(got, np.full(length, 1, np.float32), kind)
                calls += 1
                if peer == first:
                    path = found.path.replace(" ", "_")
                    say(f"EXPLAIN {kind} {length * 4} {path} {found.choice} {found.source}")
                    say(f"RAN {kind} {length * 4} {ran.get((kind, str(length * 4)), '-')}")
        return calls
    finally:
        logger.removeHandler(handler)


MODES["tuning"] = tuning


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
                for note in getattr(exc, "__notes__", ()):
                    say(f"NOTE {peer} {note}")
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
