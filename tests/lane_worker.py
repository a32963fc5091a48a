"""One process of a job whose persistent uses run in their lane (collective.shm.group's
``ShmGroup.lane``): run by tests/test_persistent_lane.py, one peer per process.

Usage: python tests/lane_worker.py MODE   (the job comes from COLLECTIVE_* variables)

Every peer knows every peer's input (a function of the peer and the use), so it checks each
result itself. ``ShmExecutor.run`` is counted per call: the general step, which a use runs where
its lane does not take it. Output: "GENERAL <handle> <uses> <lane found: 1 or 0> <general steps>" per handle,
"ERROR <class> <message>" for a collective's error (exit status 3), "OK <checks>" at the end.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from typing import Any

import numpy as np

import collective as col
import collective.shm.group as group_module
from collective.executors.shm import ShmExecutor
from collective.shm.group import ShmGroup
from collective.trace import RECORDER

GENERAL: Counter[int] = Counter()  # general steps by the id of their call
_general_run = ShmExecutor.run


def _counted(self: ShmExecutor, step: Any) -> Any:
    GENERAL[id(step.call)] += 1
    return _general_run(self, step)


ShmExecutor.run = _counted  # type: ignore[method-assign]


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def inputs(world: int, length: int, use: int) -> list[np.ndarray]:
    """Every peer's input at ``use``: a different one each time."""
    return [np.arange(length, dtype=np.float64) * (p + 1) + 10 * use + p for p in range(world)]


def general(handle: Any) -> str:
    """Whether ``handle`` found its lane (1 or 0), and the general steps its uses ran."""
    return f"{int(handle._lane is not None)} {GENERAL[id(handle._call)]}"


def uses(peer: int, world: int) -> int:
    """Every kind's uses read their input anew and write the same result buffer, whatever lies
    between them: other calls of the group (every use in one of the group's two slots, then in
    the other, then in both by turns), a mean (scaled in its buffer), a result made by the first
    use (no ``out``), a normal call made again on the same arrays (kept: collective.persistent.kept).
    Each handle finds its lane, and uses run in it (the rest: the general step)."""
    checks = 0
    x, block, row, source, y = np.zeros(5), np.zeros(3), np.zeros(2 * world), np.zeros(4), np.zeros(6)
    z, kept_out = np.zeros(2), np.zeros(2)
    handles = {
        "all_reduce": col.all_reduce_init(peer, x, out=x),
        "mean": col.all_reduce_init(peer, y, op="mean"),
        "all_gather": col.all_gather_init(peer, block),
        "reduce_scatter": col.reduce_scatter_init(peer, row),
        "broadcast": col.broadcast_init(peer, source if peer == 0 else None),
        "barrier": col.barrier_init(peer),
    }
    made: dict[str, Any] = {}  # the result buffer the first use made
    for use in range(24):
        between = use < 8 or (use >= 16 and use % 2 == 0)  # (one slot, the other, then both by turns)
        for name, handle in handles.items():
            if name == "all_reduce":
                everyone = inputs(world, 5, use)
                x[:] = everyone[peer]
                assert handle() is x, "the result is written into out=x"
                np.testing.assert_array_equal(x, np.sum(everyone, axis=0), err_msg=f"{name} use {use}")
            elif name == "mean":
                everyone = inputs(world, 6, use)
                y[:] = everyone[peer]
                got = handle()
                assert got is made.setdefault(name, got), "every use writes the first use's result"
                np.testing.assert_allclose(got, np.mean(everyone, axis=0), err_msg=f"{name} use {use}")
            elif name == "all_gather":
                everyone = inputs(world, 3, use)
                block[:] = everyone[peer]
                np.testing.assert_array_equal(handle(), np.stack(everyone), err_msg=f"{name} use {use}")
            elif name == "reduce_scatter":
                everyone = inputs(world, 2 * world, use)
                row[:] = everyone[peer]
                expected = np.sum(everyone, axis=0)[2 * peer : 2 * peer + 2]
                np.testing.assert_array_equal(handle(), expected, err_msg=f"{name} use {use}")
            elif name == "broadcast":
                source[:] = use
                np.testing.assert_array_equal(handle(), np.full(4, float(use)), err_msg=f"{name} use {use}")
            else:
                assert handle() is None
            checks += 1
            if between:
                assert col.all_reduce(peer, np.ones(1))[0] == world, "a normal call between uses"
        everyone = inputs(world, 2, use)  # a normal call on the same arrays: kept, then in its lane
        z[:] = everyone[peer]
        assert col.all_reduce(peer, z, out=kept_out) is kept_out
        np.testing.assert_array_equal(kept_out, np.sum(everyone, axis=0), err_msg=f"kept use {use}")
        checks += 1
    for name, handle in handles.items():
        say(f"GENERAL {name} 24 {general(handle)}")
        handle.free()
    (kept,) = [kept for kept in col.default_runtime()._kept_calls.values() if hasattr(kept, "call")]
    say(f"GENERAL kept 24 {int(kept.lane is not None)} {GENERAL[id(kept.call)]}")
    return checks


def lost(peer: int, world: int) -> int:
    """Peer 1's process ends while every use runs in its lane: the others' next use is a
    PeerLostError naming it (the lane's short spin, then the general wait that watches peers)."""
    x = np.zeros(4)
    handle = col.all_reduce_init(peer, x, out=x)
    for use in range(12):
        x[:] = peer + use
        handle()
    say(f"GENERAL all_reduce 12 {general(handle)}")
    if peer == 1:
        say("LEAVING")
        os._exit(0)  # (no finish: the process ends as a crash ends it)
    handle()
    raise AssertionError("a use went on without peer 1")


def freed(peer: int, world: int) -> int:
    """Peer 0 uses a handle whose uses run in its lane while the others free theirs: a
    MismatchError on every peer naming the free, and the group goes on."""
    x = np.zeros(3)
    handle = col.all_reduce_init(peer, x, out=x)
    for _ in range(12):
        handle()
    say(f"GENERAL all_reduce 12 {general(handle)}")
    try:
        handle() if peer == 0 else handle.free()
        raise AssertionError("a use met a free without an error")
    except col.MismatchError as exc:
        assert "all_reduce_free" in str(exc), exc
    assert col.all_reduce(peer, np.ones(2))[0] == world, "the group goes on"
    return 1


def late(peer: int, world: int) -> int:
    """A use peer 1 makes after the handle's timeout (0.5 s), its earlier uses in their lane: a
    CollectiveTimeout naming peer 1 on every peer, and the group goes on."""
    x = np.zeros(3)
    handle = col.all_reduce_init(peer, x, out=x, timeout=0.5)
    for _ in range(12):
        handle()
    say(f"GENERAL all_reduce 12 {general(handle)}")
    if peer == 1:
        time.sleep(1.5)  # (kept: the lateness under test, past the handle's timeout)
    try:
        handle()
        raise AssertionError("a use waited past its timeout")
    except col.CollectiveTimeout as exc:
        say(f"TIMEOUT {exc}")
    assert col.all_reduce(peer, np.ones(1), timeout=20)[0] == world  # (where the late peer catches up)
    x[:] = 1
    handle()  # (the next use meets on every peer: the group goes on)
    assert x[0] == world, x
    return 1


def behind(peer: int, world: int) -> int:
    """Peer 1 reads the others late in each use, once they may have ended it and arrived at their
    next use: its uses still run in their lane (a member in a later step counts as one in this
    step, its slot of this step as it was, unless it gave this step up). Output: "BEHIND <general
    steps peer 1's uses ran>"."""
    x = np.zeros(3)
    handle = col.all_reduce_init(peer, x, out=x)
    for _ in range(12):
        handle()
    before = GENERAL[id(handle._call)]
    if peer == 1:
        read = ShmGroup._arrived_again

        def read_late(self: ShmGroup, *args: Any) -> Any:
            time.sleep(0.02)  # (the case under test, whenever the others got this far by now)
            return read(self, *args)

        ShmGroup._arrived_again = read_late  # type: ignore[method-assign]
    for use in range(8):
        x[:] = peer + use
        handle()  # (the line each use is recorded as called from)
        assert x[0] == sum(p + use for p in range(world)), x
    say(f"BEHIND {GENERAL[id(handle._call)] - before}")
    return 8 + recorded(peer, world)


def evicted(peer: int, world: int) -> int:
    """More repeated calls than a group keeps what their last step found for (AGAINS, 4 here):
    a handle whose step the group let go finds its lane again after a few general steps (the
    first finds the step anew, the next its slots). Output: "EVICTED <general steps of its 32
    uses after>"."""
    group_module.AGAINS = 4
    x = np.zeros(3)
    handle = col.all_reduce_init(peer, x, out=x)
    for _ in range(12):
        handle()
    assert handle._lane is not None, "its uses run in the lane"
    for size in range(6):  # (each one's step is kept in its place: the oldest goes)
        y = np.zeros(size + 1)
        with col.all_reduce_init(peer, y, out=y) as other:
            for _ in range(4):
                other()
    before = GENERAL[id(handle._call)]
    for use in range(32):
        x[:] = peer + use
        handle()
        assert x[0] == sum(p + use for p in range(world)), x
    say(f"EVICTED {GENERAL[id(handle._call)] - before}")
    return 32


def recorded(peer: int, world: int) -> int:
    """The flight recorder's entries of a handle's uses in its lane are a call's: numbered in
    turn in the group, completed, with the call's kind, shapes, path and the caller's line."""
    x = np.zeros(3, np.float32)
    handle = col.all_reduce_init(peer, x, out=x)
    for _ in range(12):
        handle()
    assert handle._lane is not None, "its uses run in the lane"
    line = sys._getframe().f_lineno + 2
    for _ in range(4):
        handle()
    entries = [e for e in RECORDER.document("test")["entries"] if e["peer"] == peer][-4:]
    numbers = [e["collective_seq_id"] for e in entries]
    assert numbers == list(range(numbers[0], numbers[0] + 4)), numbers
    for entry in entries:
        assert entry["kind"] == "all_reduce" and entry["state"] == "completed", entry
        assert entry["input_sizes"] == [[3]] and entry["input_dtypes"] == ["float32"], entry
        assert entry["path"] == "shm" and entry["ranks"] == list(range(world)), entry
        assert entry["frames"][0]["line"] == line and entry["duration_ms"] >= 0, entry
    return 1


MODES = {"uses": uses, "lost": lost, "freed": freed, "late": late, "behind": behind, "evicted": evicted}


def main() -> int:
    (peer,) = col.peer_ids_from_env()
    config = col.CollectiveConfig.from_env()
    col.register(peer, "cpu", config)
    try:
        checks = MODES[sys.argv[1]](peer, col.world_size())
    except col.CollectiveError as exc:
        say(f"ERROR {type(exc).__name__} {exc}")
        return 3
    col.finish(peer)
    say(f"OK {checks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
