"""A group's steps through shared memory, among peers in different processes of one host.

``ShmGroup`` is a typed primitive: ``run(number, label, deadline, timeout, task)`` runs one step
of whatever a ``ShmTask`` says (its call as published, its agreement rules, the movement of the
agreed call, its input and result buffer). collective.executors.shm runs a collective's own steps
on it; collective.executors.host_tier runs a host's part of a larger collective (its inputs to the
host's leader; then the leader's relay). Each process has one ring segment (transport.shm_ring); a
group gets a channel in each member's segment. One step ``s`` of the group, on every member::

    publish   the task's Signature (and the input itself, when it fits the slot: small steps)
              into slot s % 2 of this process's channel; progress = ARRIVE(s)
    meet      wait until every member arrived (one synchronisation), read every Signature, run
              ``signature.agree`` over them by group rank: a mismatch is the same error on every
              member, and every member still moves on to step s + 1 together
    small     every member computes its own result from every member's inline input (in rank
              order; ``Movement.own``): bit-identical results everywhere, no more waits
    large     chunks through two chunk buffers per member, pipelined (``Movement.stream`` over
              collective.shm.chunks)
    end       progress = END(s); no trailing barrier: slot s % 2 is reused at step s + 2, once
              every member has left step s

A member that fails inside a step (an exception, a timeout, a lost peer) records why in its
channel and sets its progress to ABORT(s): the others raise at once (PeerLostError naming it, or
its CollectiveTimeout). A process that dies is noticed from its pid (checked every 0.1 s while
waiting), one that left from its segment, a lost node from the orchestrator's heartbeats.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

import numpy as np

from collective.algorithms.ops import Array
from collective.calls.movement import Movement
from collective.calls.signature import Rules, Signature, agree
from collective.errors import (
    CollectiveError,
    CollectiveTimeout,
    MismatchError,
    PeerLostError,
    describe_peers,
)
from collective.shm.chunks import ABORT, ARRIVE, END, Chunks, Pieces, at
from collective.shm.ring import HostRing, Moved, SignatureCodec
from collective.transport.shm_ring import INLINE_BYTES, MESSAGE_BYTES, RingSegment, Waiting
from collective.transport.wire import ErrorRecord, WireError

__all__ = ["STEPS", "ShmGroup", "ShmTask"]

log = logging.getLogger(__name__)

SPIN_AGAIN = 64  # reads of a member's progress a use waits inline before the general wait
YIELD_AGAIN = 1e-3  # seconds a use waits inline on a crowded host, yielding its CPU between reads
AGAINS = 64  # repeated tasks a group keeps what their last step found for (then lets the longest kept go)

STEPS: Counter[str] = Counter()  # steps this process ran through shared memory, by kind (for tests)


class ShmTask(Protocol):
    """What one shared-memory step moves for this process (a collective's, or the host tier's)."""

    @property
    def signature(self) -> Signature:
        """This process's call, as it publishes it."""
        ...

    @property
    def repeated(self) -> bool:
        """Whether this task is run again and again unchanged (a persistent call's: its signature,
        input and result buffer are the same objects at every step it is passed to)."""
        ...

    @property
    def source_elsewhere(self) -> bool:
        """Whether a sourced call may have its source outside this group (a host tier's)."""
        ...

    def rules(self, kind: str) -> Rules:
        """How the calls of ``kind`` are agreed."""
        ...

    def movement(self, agreed: Signature) -> Movement:
        """How the agreed call's data moves among the members (raises what the call finds wrong)."""
        ...

    def source(self) -> np.ndarray | Pieces | None:
        """This member's input in host memory (pieces read in place: never packed)."""
        ...

    def target(self, agreed: Signature, movement: Movement) -> Array | None:
        """The buffer of this member's result (None: it gets none)."""
        ...


def _spin(progress: Any, target: int, spin: float) -> int:
    """``progress[0]`` once it reached ``target``, or as it was after ``spin`` more reads (a
    negative ``spin``: reads for ``-spin`` seconds, with the CPU yielded between them)."""
    value: int = progress[0]
    if spin >= 0:
        for _ in range(int(spin)):
            value = progress[0]
            if value >= target:
                break
        return value
    stop = time.monotonic() - spin
    while value < target and time.monotonic() < stop:
        os.sched_yield()
        value = progress[0]
    return value


class ShmGroup:
    """The steps of one group through shared memory (one per group, reused every step)."""

    def __init__(self, ring: HostRing, members: tuple[int, ...], me: int, purpose: str = "") -> None:
        self.ring = ring
        self._segment = ring.segment  # this process's own
        self.members = members
        self.n = len(members)
        self.rank = members.index(me)
        named = repr((purpose, members) if purpose else members)  # a purpose: another channel, same peers
        self.key = int.from_bytes(hashlib.blake2b(named.encode(), digest_size=8).digest(), "little") | 1
        self.index: int | None = None
        self.busy = False
        self.last = -1  # the last step this process ran in the group (through a channel)
        self.ended: tuple[int, str | None] = (-1, None)  # the last step it went through, and why it gave
        # it up (a record): a channel given to the group later starts there
        self._active: int | None = None  # the step in flight (for abort)
        self._label = ""
        self._timeout = 0.0
        self._met = -1  # the last step every member arrived at
        self._theirs: list[Any] = [None] * self.n  # other members' channels, by rank
        self._their_index = [0] * self.n  # (their index in their segment)
        self._segments: list[RingSegment] = []  # every member's segment, by rank (mapped at the first step)
        self._others: list[RingSegment] = []
        self.mine: Any = None  # this process's channel for the group
        self.waiting = Waiting(max(self.n, ring.processes), ring.segment)
        self.codec = SignatureCodec()
        self._written: list[bytes | None] = [None, None]  # the message in each slot of this channel
        self._channels: list[Any] = []  # every member's channel, by rank (once all were found)
        self._heads: list[list[Any]] = [[], []]  # every member's slot head, by slot and rank
        self._agreed: dict[tuple[Any, ...], Any] = {}  # (agreed call, inline inputs) by digests and sizes
        self._agains: dict[Any, _Again] = {}  # what each repeated task's last small step found, by task
        # (``_step_again``: every persistent call of the group has its own)

    # -- the step -------------------------------------------------------------------------------

    def run(
        self,
        number: int,
        label: str,
        deadline: float,
        timeout: float,
        task: ShmTask | None,
        error: CollectiveError | None = None,
    ) -> tuple[Signature, Array | None]:
        """Step ``number`` of the group for this process: (the agreed call, this member's result).

        ``error``: this process fails the step, telling the others (``task`` None: before it
        publishes any call; else once its call is published, so the others may still agree).
        """
        s = number
        self._label = label
        self._timeout = timeout
        self.busy = True
        try:
            index = self.ring.channel(self, s, deadline, self._label)
            self.mine = self.ring.segment.channels[index]
            self._active = s
            self.last = s
            if not self._segments:
                self._map(s)
            again = self._agains.get(task) if task is not None else None
            if again is not None and error is None:
                return self._step_again(s, deadline, again)
            return self._step(s, deadline, task, error)
        except CollectiveError as exc:
            if self._active is not None:
                self._give_up(s, exc)
            else:  # (no channel yet: the one the group gets next tells the others)
                self.ended = (s, ErrorRecord.of(exc).line())
            raise
        finally:
            self.busy = False

    def abort(self, error: CollectiveError) -> None:
        """This process failed inside the step: the others learn of it at once."""
        if self._active is not None:
            self._give_up(self._active, error)

    def _step(
        self, s: int, deadline: float, task: ShmTask | None, error: CollectiveError | None
    ) -> tuple[Signature, Array | None]:
        slot = s & 1
        if s >= 2 and self._met != s - 1:
            self._wait_all(at(s - 2, ABORT), deadline, False)  # all left step s-2: slot s % 2 is free
        if task is None:
            assert error is not None
            raise error  # recorded for the others by run(): they raise its class
        source = task.source()
        inline = source if isinstance(source, np.ndarray) and source.nbytes <= INLINE_BYTES else None
        message, digest = self.codec.encode(task.signature)
        self._publish(s, slot, message, digest, inline)
        if error is not None and task.signature.error is None:
            raise error  # recorded for the others by run()
        self._wait_all(at(s, ARRIVE), deadline)
        self._met = s
        agreed, movement, inputs = self._agree(s, slot, message, digest, task)
        result = task.target(agreed, movement)
        target: Any = result if result is None or result.ndim == 1 else result.reshape(-1)  # C-contiguous
        host = target is None or type(target) is np.ndarray
        dst = target if host else np.empty(target.shape, target.dtype)
        if inputs is None:
            movement.stream(Chunks(self, movement.dtype, s, deadline), source, dst)
        elif dst is not None:  # every member computes its own result from every inline input
            movement.own(inputs, self.rank, dst)
        if not host:
            target.set(dst)  # a CuPy result
        self._finished(s)
        STEPS[agreed.kind] += 1
        if task.repeated and inputs is not None and host and (source is None or source is inline):
            others = [rank for rank in range(self.n) if rank != self.rank]
            if len(self._agains) >= AGAINS and task not in self._agains:  # (the longest kept goes)
                del self._agains[next(iter(self._agains))]
            self._agains[task] = _Again(task, message, digest, inline, result, dst, others)
        return agreed, result

    def _step_again(self, s: int, deadline: float, again: _Again) -> tuple[Signature, Array | None]:
        """Step ``s`` of a repeated task whose last step was small (a persistent call's use): ``_step``
        less what that step found and cannot have changed: the message, the input's bytes and
        the result's buffer. The agreement is the same ``_agree`` (a member that calls something
        else this time, or frees its handle, fails it the same way)."""
        slot = s & 1
        if s >= 2 and self._met != s - 1:
            self._wait_all((s - 2) << 32 | ABORT, deadline, False)  # all left step s-2: slot s % 2 is free
        self._publish(s, slot, again.message, again.digest, again.source)
        found = self._arrived_again(s, slot, again)
        if found is None:  # (not all there yet, or not as last time: the general wait and agreement)
            self._wait_all(s << 32 | ARRIVE, deadline)
            found = self._agree_again(s, slot, again)
        self._met = s
        agreed, movement, inputs = found
        if inputs is None:  # (a large step: cannot be, the sizes agree as last time; as _step would)
            movement.stream(Chunks(self, movement.dtype, s, deadline), again.task.source(), again.dst)
        elif again.dst is not None:
            movement.own(inputs, self.rank, again.dst)
        self._finished(s)
        STEPS[agreed.kind] += 1
        return agreed, again.result

    def lane(self, task: ShmTask, slow: Callable[[], Array | None]) -> Callable[[int], Array | None] | None:
        """A repeated task's use (step ``s``) as one function: ``_step_again``'s parts (``_publish``,
        ``_arrived_again``, the movement's ``own``, bound once per slot, ``_finished``) for the
        common case alone (this group still holds its channel, ``HostRing.hold``, every member met
        the last step, and each one is in step ``s`` within a short spin, through the channel read
        last time, having published what it published last time in this slot). Anything else is
        ``slow()``: ``run`` (the general wait with its timeout and watch of lost peers, the
        agreement that names who calls something else), which publishes the same again. None until
        a use was agreed as repeated (the lane reads what each slot's found)."""
        again = self._agains.get(task)
        if again is None or self._channels is not again.channels:
            return None
        ring, group, me, agains = self.ring, self, self.rank, self._agains
        # how long a use waits inline for the others before the general wait: a spin of reads where
        # each process has a CPU; on a crowded host, reads with the CPU yielded between them (the
        # members it waits for may be queued behind it), for at most YIELD_AGAIN seconds
        spin = 16 * SPIN_AGAIN if not self.waiting.crowded else -YIELD_AGAIN
        kind = task.signature.kind  # (its steps, counted as the step agreed counts them)
        agreements: list[Any] = [None, None]  # what each slot's use last found agreed
        owns: list[Callable[[], Any] | None] = [None, None]  # and its movement.own into dst, bound
        channels, message, digest, source, result, dst = [], b"", 0, None, None, None

        def bind(found: _Again) -> None:
            """Read what the task's last step found (again after a general step found it anew:
            made again once the group let it go, or for other channels)."""
            nonlocal again, channels, message, digest, source, result, dst
            again, channels = found, found.channels
            message, digest, source = found.message, found.digest, found.source
            result, dst = found.result, found.dst
            agreements[:] = [None, None]
            owns[:] = [None, None]

        bind(again)

        def use(s: int) -> Array | None:
            if not ring.hold(group):
                return slow()
            try:
                found = agains.get(task)
                if found is not again or found.channels is not channels:  # (let go and found anew,
                    # or read again through channels that moved)
                    if found is None or found.channels is not group._channels:
                        return slow()
                    bind(found)
                if group._met != s - 1 or group._channels is not channels:
                    return slow()  # (after a step that failed, or channels that moved: the general path)
                group._active = group.last = s
                slot = s & 1
                self._publish(s, slot, message, digest, source)
                agreement = self._arrived_again(s, slot, again, spin)
                if agreement is None:  # (a member late past the spin, or not as last time; or a slot
                    return slow()  # not agreed yet: the general step waits, or agrees it)
                if agreement is not agreements[slot]:  # (its first use in this slot, or agreed anew)
                    agreements[slot] = agreement
                    _, movement, inputs = agreement
                    owns[slot] = None
                    if dst is not None and inputs is not None:
                        owns[slot] = movement.own_bound(inputs, me, dst)
                group._met = s
                own = owns[slot]
                if own is not None:
                    own()
                self._finished(s)
                STEPS[kind] += 1
                return result
            finally:
                group.busy = False

        return use

    def _map(self, s: int) -> None:
        """Map every other member's segment (a failure is this process giving up the step)."""
        self._segments = self.ring.segments_of(self.members, self.members[self.rank], self._label)
        self._others = [segment for rank, segment in enumerate(self._segments) if rank != self.rank]

    def _publish(self, s: int, slot: int, message: bytes, digest: int, data: np.ndarray | None) -> None:
        mine = self.mine
        head = mine.slot_heads[slot]
        if self._written[slot] is not message:  # the same call as last time in this slot: in place
            mine.messages[slot][: len(message)] = message
            self._written[slot] = message
            head[1] = len(message)
            head[3] = digest
        if data is None:
            head[2] = -1
        else:
            nbytes = data.nbytes
            if nbytes:  # (as bytes: bfloat16 has no buffer format; a small copy's fastest way)
                mine.data[slot][:nbytes] = data.tobytes() if nbytes <= 1024 else data.view(np.uint8)
            head[2] = nbytes
        head[0] = s
        self.post((s << 32) | ARRIVE)

    def _agree(
        self, s: int, slot: int, message: bytes, digest: int, task: ShmTask
    ) -> tuple[Signature, Movement, list[np.ndarray | None] | None]:
        """The agreed call, its movement and every member's inline input for a small step (None
        for a large one).

        When every member published the digest of this process's message and the call has neither
        a problem nor a source to find, that is the agreed call; otherwise every message is decoded
        and ``signature.agree`` decides, the same way on every member. Both are remembered by the
        members' digests and input sizes and the kind of task (its movement is a function of those:
        ``ShmTask.movement`` has no other input): a group repeats the same few calls.
        """
        channels = self._channels or self._all_channels()
        heads = self._heads[slot]
        me = self.rank
        key: list[Any] = [slot, type(task)]  # (a kind of task: its rules and movements)
        for rank, head in enumerate(heads):
            if rank != me:
                self._still_in(s, rank, channels[rank])
            seq, length, size, digested = head[0], head[1], head[2], head[3]
            if seq != s or not 0 <= length <= MESSAGE_BYTES:
                problem = f"{self._label}: {self._who([rank])} published step {seq}, not {s}"
                self._finish_with(s, MismatchError(problem))
            key += (digested, size)
        found = self._agreed.get(tuple(key))
        if found is None:
            found = self._agreed_anew(s, slot, message, digest, channels, heads, task)
            if len(self._agreed) > 32:
                self._agreed.clear()
            self._agreed[tuple(key)] = found
        return found

    def _still_in(self, s: int, rank: int, channel: Any) -> None:
        """Raise unless member ``rank``, which arrived at step ``s``, is still in it through this
        group's channel: it gave the step up since it came (and may be on), or left the channel."""
        value = channel.progress[0]
        gave_up = value >= (s << 32 | ABORT) and value != (s << 32 | END) and channel.record(s)
        if gave_up:
            raise self._theirs_error(rank, gave_up)
        if self._segments[rank].keys[self._their_index[rank]] != self.key:
            raise self._theirs_error(rank, "||left the step")  # (and let its channel go)

    def _agree_again(
        self, s: int, slot: int, again: _Again
    ) -> tuple[Signature, Movement, list[np.ndarray | None] | None]:
        """``_agree`` for a repeated task: when every other member published what it published at
        the last step in this slot (its digest and input size), and the channels are the ones
        read then, what was agreed then; else ``_agree`` (which names a member calling something
        else, or freeing its handle, or gave the step up)."""
        found = self._arrived_again(s, slot, again)
        if found is not None:
            return found
        found = self._agree(s, slot, again.message, again.digest, again.task)
        if self._channels is not again.channels:  # (the other slot's views are of channels gone too)
            again.found, again.published, again.channels = [None, None], [[], []], self._channels
        again.found[slot] = found
        again.published[slot] = [(head[3], head[2]) for head in self._heads[slot]]
        return found

    def _arrived_again(
        self, s: int, slot: int, again: _Again, spin: float = SPIN_AGAIN
    ) -> tuple[Signature, Movement, list[np.ndarray | None] | None] | None:
        """``_wait_all`` and ``_agree_again`` in one pass, for the common case of a use: every other
        member is in step ``s`` already (or within ``spin`` more reads of its progress; a negative
        ``spin``: within ``-spin`` seconds of reads with the CPU yielded between them), through
        the channel read last time, having published what it published last time in this slot:
        what was agreed then. A member already in a later step counts as one in ``s`` unless it
        recorded giving ``s`` up (it may have ended ``s`` before this process looked: its slot of
        ``s`` stays as it was until this process arrives at ``s + 1``). None for anything else
        (nothing was changed: the general path reads it all again)."""
        found = again.found[slot]
        channels = self._channels
        if found is None or channels is not again.channels:
            return None
        arrived, end = s << 32 | ARRIVE, s << 32 | END
        heads, published = self._heads[slot], again.published[slot]
        segments, indices = self._segments, self._their_index
        for rank in again.others:
            progress = channels[rank].progress
            value = progress[0]
            if value < arrived:
                value = _spin(progress, arrived, spin)
                if value < arrived:
                    return None
            if value >= arrived | ABORT and value != end and (value < end or channels[rank].record(s)):
                return None  # (it gave step s up)
            if segments[rank].keys[indices[rank]] != self.key:
                return None
            head, (digest, size) = heads[rank], published[rank]
            if head[0] != s or head[3] != digest or head[2] != size:
                return None
        return found

    def _agreed_anew(
        self,
        s: int,
        slot: int,
        message: bytes,
        digest: int,
        channels: list[Any],
        heads: list[Any],
        task: ShmTask,
    ) -> tuple[Signature, Movement, list[np.ndarray | None] | None]:
        try:
            agreed = self.codec.decode(message)
            same = all(head[3] == digest for head in heads)
            if not same or agreed.error is not None or task.rules(agreed.kind).sourced:
                messages = [bytes(c.messages[slot][: h[1]]) for c, h in zip(channels, heads, strict=True)]
                specs = {rank: self.codec.decode(message) for rank, message in enumerate(messages)}
                elsewhere = task.source_elsewhere
                number = "#" + self._label.rpartition("#")[2]  # the caller's (a host tier: 2 steps a call)
                agreed = agree(specs, number, task.rules, who=self._who, source_elsewhere=elsewhere)
            movement = task.movement(agreed)
        except WireError as exc:
            self._finish_with(s, MismatchError(f"{self._label}: a member published an unusable call: {exc}"))
        except CollectiveError as exc:
            self._finish_with(s, exc)
        itemsize = np.dtype(movement.dtype).itemsize if movement.dtype is not None else 0
        sizes = [movement.source_size(rank) for rank in range(self.n)]
        if max((size for size in sizes if size is not None), default=0) * itemsize > INLINE_BYTES:
            return agreed, movement, None
        inputs: list[np.ndarray | None] = []
        for rank, (channel, head, size) in enumerate(zip(channels, heads, sizes, strict=True)):
            nbytes = -1 if size is None else size * itemsize
            if nbytes >= 0 and head[2] != nbytes:
                problem = f"{self._label}: {self._who([rank])} published {head[2]} bytes, not {nbytes}"
                self._finish_with(s, MismatchError(problem))
            inputs.append(None if nbytes < 0 else channel.slots[slot][:nbytes].view(movement.dtype))
        return agreed, movement, inputs

    def _all_channels(self) -> list[Any]:
        channels = [self.mine if rank == self.rank else self._theirs[rank] for rank in range(self.n)]
        self._channels = channels
        self._heads = [[channel.slot_heads[slot] for channel in channels] for slot in (0, 1)]
        return channels

    def _finish_with(self, s: int, error: CollectiveError) -> NoReturn:
        """A verdict every member reaches by itself: leave the step normally, then raise it."""
        self._finished(s)
        raise error

    def _finished(self, s: int) -> None:
        self._active = None
        self.ended = (s, None)
        self.post(s << 32 | END)

    # -- progress -------------------------------------------------------------------------------

    def post(self, value: int) -> None:
        """Raise this process's progress in the group to ``value`` and wake members that sleep."""
        self.mine.progress[0] = value
        segment = self._segment
        segment.bump()
        for other in self._others:
            if other.sleepers[0]:
                segment.wake()
                return

    def buffer(self, rank: int, parity: int) -> np.ndarray:
        channel = self.mine if rank == self.rank else self._theirs[rank]
        buffer: np.ndarray = channel.buffers[parity]
        return buffer

    def wait(self, rank: int, target: int, deadline: float, aborts: bool = True) -> None:
        """Until member ``rank`` reached ``target``; raises if it is gone, or gave up that step (with
        ``aborts``). What was read must be ours."""
        channel = self._theirs[rank]
        while True:  # (again when its process evicted this group's channel, and gives it another)
            channel = channel if channel is not None else self._find(rank, deadline)
            try:
                if channel.progress[0] < target and not self.waiting.until(
                    channel.progress, target, self._segments[rank], deadline, lambda: self._watch(rank)
                ):
                    self._time_out(target)
                if self._segments[rank].keys[self._their_index[rank]] == self.key:
                    break
                raise Moved
            except Moved:  # (what was cached of its channel goes: agreed calls hold views of it)
                channel = self._theirs[rank] = None
                self._channels, self._agreed = [], {}
        value = channel.progress[0]
        s = target >> 32
        if aborts and value >= (s << 32 | ABORT):
            reason = channel.record(s) if value > (s << 32 | END) or value == (s << 32 | ABORT) else None
            if reason is not None:
                raise self._theirs_error(rank, reason)

    def _wait_all(self, target: int, deadline: float, aborts: bool = True) -> None:
        for rank in range(self.n):
            if rank != self.rank:
                self.wait(rank, target, deadline, aborts)

    def _find(self, rank: int, deadline: float) -> Any:
        """Member ``rank``'s channel for this group (it assigns one when it first gets here)."""
        segment = self._segments[rank]
        index = segment.find(self.key)
        if index is None:
            if not self.waiting.ready(
                lambda: segment.find(self.key) is not None, segment, deadline, self._watch
            ):
                self._time_out(at(self._active or 0, ARRIVE))
            index = segment.find(self.key)
            assert index is not None
        channel = self._theirs[rank] = segment.channels[index]
        self._their_index[rank] = index
        return channel

    def releasable(self) -> bool:
        """Whether every member left this group's last step here (it may give its channel up now):
        a member whose channel was never looked up is looked up (it may be reading this one)."""
        for rank in range(self.n) if self.last >= 0 and self._segments else ():
            channel = None if rank == self.rank else self._channel_now(rank)  # (None: it reads none of ours)
            busy = channel is not None and channel.progress[0] < at(self.last, ABORT)
            if busy and self._segments[rank].alive() and not self._segments[rank].closed:
                return False
        return True

    def _channel_now(self, rank: int) -> Any:
        """Member ``rank``'s channel for this group as its segment tells it now (None: it has none)."""
        segment = self._segments[rank]
        index = segment.find(self.key)
        return None if index is None else segment.channels[index]

    def release(self) -> None:
        """Give up this group's channel (lock held; only once ``releasable``: nobody reads it)."""
        self._active = None
        self.index = None
        self._met = -1
        self._theirs = [None] * self.n
        self._channels = []
        self._agreed = {}
        self._written = [None, None]

    def _watch(self, rank: int | None = None) -> None:
        """Raise if the job closed or a member is gone (while blocked), or if ``rank``'s channel moved."""
        if rank is not None and self._segments[rank].keys[self._their_index[rank]] != self.key:
            raise Moved  # (its process gave this group's channel to another)
        ring = self.ring
        if ring.closed is not None:
            raise ring.closed
        for rank, peer in enumerate(self.members):
            if rank == self.rank:
                continue
            segment = self._segments[rank]
            lost = ring.lost_peer(peer)
            alive = lost is None and segment.alive()
            s, theirs = self._active, self._channel_now(rank)  # it may leave once its part of step s is
            done = s is not None and theirs is not None and theirs.progress[0] >= at(s, END)
            if (alive and not segment.closed) or done:  # done (its channel looked up: maybe never yet)
                continue
            reason = self._given_up(rank)
            if reason is not None:  # it gave this step up (and then exited): its reason is the news
                raise self._theirs_error(rank, reason)
            if lost is not None:
                raise lost
            if segment.closed:  # (checked first: a process that finished may have exited since)
                raise PeerLostError(f"{self._label}: peer {peer} left the job while others needed it", [peer])
            raise PeerLostError(f"{self._label}: peer {peer} (process {segment.pid}) died", [peer])

    def _given_up(self, rank: int) -> str | None:
        """Why member ``rank`` gave up the step in flight, if it recorded that."""
        channel, s = self._theirs[rank], self._active
        if channel is None or s is None:
            return None
        value = channel.progress[0]
        if value < at(s, ABORT) or value == at(s, END):
            return None
        reason: str | None = channel.record(s)
        return reason

    def _time_out(self, target: int) -> None:
        missing = []
        for rank in range(self.n):  # (a channel not looked up yet is looked up now)
            channel = None if rank == self.rank else self._channel_now(rank)
            if rank != self.rank and (channel is None or channel.progress[0] < target):
                missing.append(self.members[rank])
        who = describe_peers(missing) if missing else "the others"
        raise CollectiveTimeout(
            f"{self._label}: peer {self.members[self.rank]} waited {self._timeout:g}s for {who} "
            f"({'to call it' if target & 0xFFFFFFFF == ARRIVE else 'to move its data'})",
            missing,
        )

    def _give_up(self, s: int, error: CollectiveError) -> None:
        """Tell the other members this process left step ``s`` without finishing it."""
        self._active = None
        self.ended = (s, ErrorRecord.of(error).line())
        self.mine.write_record(s, self.ended[1])
        self.post(at(s, ABORT))

    def _theirs_error(self, rank: int, reason: str) -> CollectiveError:
        """The error a member recorded when it gave a step up, as its class (a lost peer by default)."""
        peer = self.members[rank]
        return ErrorRecord.from_line(reason).error(f"{self._label}: peer {peer} gave up", [peer])

    def _who(self, ranks: list[int]) -> str:
        return describe_peers([self.members[rank] for rank in ranks])


class _Again:
    """What a repeated task's small step found, for its next (ShmGroup._step_again): its published
    message and digest, its inline input (None: it has none), its result and that as flat host
    memory, the other members' ranks."""

    __slots__ = (
        "channels",
        "digest",
        "dst",
        "found",
        "message",
        "others",
        "published",
        "result",
        "source",
        "task",
    )

    def __init__(
        self,
        task: ShmTask,
        message: bytes,
        digest: int,
        source: np.ndarray | None,
        result: Array | None,
        dst: np.ndarray | None,
        others: list[int],
    ) -> None:
        self.task, self.message, self.digest, self.source = task, message, digest, source
        self.result, self.dst, self.others = result, dst, others
        # what each slot agreed last, while the group read ``channels`` (every member's, by rank),
        # and what every member published for it (digest, input size)
        self.found: list[tuple[Signature, Movement, list[np.ndarray | None] | None] | None] = [None, None]
        self.published: list[list[tuple[int, int]]] = [[], []]
        self.channels: list[Any] = []
