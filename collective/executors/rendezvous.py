"""The rendezvous of one group's local peers: steps, agreement, and the Step every peer leaves with.

Each local peer of a group counts its own calls on the group (its steps); the i-th call of every
peer meets in slot i. The last peer to arrive runs the agreement over every peer's signature and
asks ``executors.choose`` how the step runs; every waiting peer wakes with the same verdict, a
``Step`` or the same error. Because steps are counted per peer, after a timeout or a mismatch all
peers move on together: the group stays usable. Groups are independent: each has its own steps
and its own slots, so calls on different groups run concurrently.
"""

from __future__ import annotations

import logging
import math
import operator
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from collective.algorithms.ops import ReduceOp
from collective.arrays import Device
from collective.calls import Barrier, rules_of
from collective.calls.base import Call
from collective.calls.signature import Signature, agree, describe_peers, unanimous
from collective.errors import CollectiveError, CollectiveTimeout, MismatchError, PeerLostError
from collective.executors import Fused, choose
from collective.executors.step import Executor, Plan, Site, Step
from collective.trace import CLOCK, RECORDER, SEQ
from collective.transport.inproc import Doorbell, claim_armed, clone_error, ring_claimed


class Membership(Protocol):
    """What a rendezvous needs of its job (collective.job.LocalJob)."""

    site: Site
    lock: threading.Lock
    left: set[int]  # peers that left the job (finish)

    @property
    def guard(self) -> AbstractContextManager[None]: ...

    def claim(self, bells: list[Doorbell]) -> None: ...

    def check_member(self, peer: int) -> None: ...

    def gone_among(self, peers: tuple[int, ...]) -> list[int]: ...


__all__ = ["Rendezvous"]

log = logging.getLogger(__name__)


_CAME = Barrier()  # what a failed slot keeps of a call: that it came (no arrays)


class _Slot:
    """Where the local peers' calls of one step meet (created by the first to arrive)."""

    __slots__ = ("calls", "deadline", "number", "outcome", "reporter")

    def __init__(self, number: int, calls: dict[int, Call] | None = None) -> None:
        self.number = number
        self.deadline = math.inf  # the earliest of the peers' deadlines: the step's, for every peer
        self.calls: dict[int, Call] = {} if calls is None else calls  # by local index
        self.outcome: Plan | CollectiveError | None = None
        self.reporter: int | None = None  # multi-node: the local index that tells the other nodes it failed

    def fail(self, error: CollectiveError) -> None:
        """The step failed before every local peer came: the ones that came (the lowest reports it)
        stay counted, their calls (and the arrays those hold) are let go: a peer that never comes
        would otherwise keep every timed-out step's inputs alive."""
        self.outcome = error
        self.reporter = min(self.calls)
        self.calls = dict.fromkeys(self.calls, _CAME)


class Rendezvous:
    """The local peers ``local`` (peer ids, sorted) of the group ``members`` in ``job``."""

    def __init__(self, job: Membership, members: tuple[int, ...], local: tuple[int, ...]) -> None:
        self.job = job
        self.members = members
        self.local = local
        self._index = {peer: i for i, peer in enumerate(local)}
        self._ranks = [members.index(peer) for peer in local]
        self._alone = len(local) == 1  # one local peer: nobody to meet here, it decides at once
        self._next = [0] * len(local)
        self.bells = [Doorbell() for _ in local]  # one per local peer and group: a peer may wait in several
        self._slots: dict[int, _Slot] = {}
        self._sourced: dict[Signature, Signature] = {}  # the lone peer's sourced calls, as agreed
        self._steps = 0  # slots decided so far (for tests of state growth)
        self._live: list[Call | Step | None] = [None] * len(local)  # each local peer's open call (recorded)
        RECORDER.watch(self)

    @property
    def open_slots(self) -> int:
        return len(self._slots)

    def waiting(self) -> tuple[int, ...]:
        """The local peers whose call waits here for the others' (an undecided step), sorted; job
        lock held."""
        return tuple(
            sorted(self.local[i] for slot in self._slots.values() if slot.outcome is None for i in slot.calls)
        )

    def run(self, peer: int, device: Device, timeout: float, call: Call) -> Any:
        """Run ``call`` for ``peer``: check it, meet the others, execute the agreed step (recorded
        in the flight recorder, which dumps itself when the step fails for want of a peer)."""
        index = self._index[peer]
        if not RECORDER.enabled:
            call.prepare(device, self.members, self._ranks[index])
            step = self.step(peer, index, call, time.monotonic() + timeout, timeout)
            result = step.run()
            if call.kept is not None and self._alone and step.plan.executor.runs_again:
                call.last = step  # (the next use runs again as this step: again())
            return result
        # Recorded: while open, the call (then its step) is this peer's live call here, which a dump
        # reads (in_flight); once ended, one tuple in the recorder's ring.
        live = self._live
        call.number = self._next[index]  # (the step this call meets the others at: a peer's calls go in turn)
        created = call.created = CLOCK()  # (the deadline's clock: one read for both)
        live[index] = call
        try:
            call.prepare(device, self.members, self._ranks[index])
            step = self.step(peer, index, call, created * 1e-9 + timeout, timeout)
            call.started = CLOCK()
            live[index] = step
            result = step.run()
        except BaseException as exc:
            self._failed(index, call, exc)
            raise
        live[index] = None
        self._completed(step, created)
        if call.kept is not None and self._alone and step.plan.executor.runs_again:
            call.last = step
        return result

    def again(self, peer: int, device: Device, timeout: float, call: Call) -> Any:
        """A use of a persistent call (``call.kept``): where this peer is the group's one peer in
        this process, its last use's step runs again with the next step's number and a new
        deadline, without agreeing the call or choosing its executor again (both were, and nothing
        they depend on changed: a persistent call's arguments cannot); otherwise ``run``."""
        step = call.last
        if step is None:
            return self.run(peer, device, timeout, call)
        job, plan = self.job, step.plan
        if call.packed:
            call.prepare(device, self.members, step.rank)  # (kept: a strided input is packed again)
        with job.lock:  # (what _decide_alone does first)
            job.check_member(peer)
            number = self._next[0]
            self._next[0] = number + 1
        plan.number = number
        step.timeout = timeout
        if not RECORDER.enabled:
            step.deadline = time.monotonic() + timeout
            return step.run()
        created = call.created = call.started = CLOCK()  # (the deadline's clock: one read for both)
        step.deadline = created * 1e-9 + timeout
        live = self._live
        live[0] = step
        try:
            result = step.run()
        except BaseException as exc:
            self._failed(0, call, exc)
            raise
        live[0] = None
        self._completed(step, created)
        return result

    def lane(self, call: Call) -> Callable[[float], Any] | None:
        """``again`` as one function of a use's timeout in seconds, with what stays the same from
        use to use bound once (the step, its executor's lane, how its result is finished):
        a persistent call's per-use floor. None where ``again`` would run anew (its last step is
        not kept) or the executor has no lane (yet). Its outcome is ``again``'s: a use the lane
        does not take runs the executor's ``run``, and a use's error is recorded as ``again``
        records it."""
        step = call.last
        if step is None or call.packed:  # (a packed input is packed again by ``again``)
            return None
        plan = step.plan
        executor = plan.executor
        run = executor.lane(step)
        if run is None:
            return None
        job, peer, finish, agreed, size = self.job, step.peer, call.finish, step.agreed, plan.size
        next_, live, clock, monotonic = self._next, self._live, CLOCK, time.monotonic
        # what ``_completed``'s entry holds that stays the same from use to use, bound once: a use
        # appends one tuple to the recorder's ring (which folds in place: the list stays the ring)
        recorder, members, kind, path = RECORDER, self.members, call.kind, executor.path
        ring, algorithm = recorder.ring, call.algorithm or executor.strategy
        # ``finish``'s common case, bound: a result in the caller's ``out``, nothing to scale
        plain = type(call).finish is Call.finish and call.out is not None and agreed.op is not ReduceOp.MEAN
        given = call.out_given if plain else None

        def use(seconds: float) -> Any:
            job.check_member(peer)  # (without the lock: it reads; a finish() racing it fails the step)
            number = next_[0]  # (only this peer's steps number this group: it is alone here)
            next_[0] = number + 1
            plan.number = number
            step.timeout = seconds
            if not recorder.enabled:
                step.deadline = monotonic() + seconds
                result = run(number)
                return given if given is not None and result is not None else finish(result, agreed, size)
            created = call.created = call.started = clock()  # (the deadline's clock: one read for both)
            step.deadline = created * 1e-9 + seconds
            live[0] = step
            try:
                result = run(number)
                result = given if given is not None and result is not None else finish(result, agreed, size)
            except BaseException as exc:
                self._failed(0, call, exc)
                raise
            live[0] = None
            ring.append(
                (
                    peer,
                    members,
                    number,
                    kind,
                    call.origin,
                    agreed,
                    path,
                    algorithm,
                    "completed",
                    created,
                    created,
                    clock(),
                    None,
                )
            )
            if len(ring) >= recorder.limit:
                recorder.fold()
            return result

        return use

    def _completed(self, step: Step, created: int) -> None:
        """The recorder's entry of a completed step (one tuple in its ring)."""
        plan, call = step.plan, step.call
        executor = plan.executor
        RECORDER.record(
            (
                step.peer,
                self.members,
                plan.number,
                call.kind,
                call.origin,
                step.agreed,  # (what every peer agreed: a broadcast receiver's shape, the root)
                executor.path,
                call.algorithm or executor.strategy,
                "completed",
                created,
                call.started,
                CLOCK(),
                None,
            )
        )

    def _failed(self, index: int, call: Call, error: BaseException) -> None:
        """Record this peer's failed call, and dump the recorder if it failed for want of a peer
        (the error then says where the dump is)."""
        item = self._live[index]
        self._live[index] = None
        entry = self._entry(index, item if item is not None else call)
        RECORDER.record(RECORDER.closed(entry, error))
        if isinstance(error, CollectiveTimeout | PeerLostError) and hasattr(error, "add_note"):
            missing = error.missing if isinstance(error, CollectiveTimeout) else error.peers
            for line in RECORDER.whereabouts(self.members, entry[SEQ], missing):  # what they do instead
                if line not in str(error):
                    error.add_note(line)
        if isinstance(error, DUMPED_ON):
            where = RECORDER.dump_once(self.members, entry[SEQ], f"{type(error).__name__}: {error}")
            if where is not None and hasattr(error, "add_note"):  # (Python 3.11 and later)
                folder = os.path.dirname(where)
                error.add_note(f"flight recorder dump: {where} (collective trace analyze {folder})")

    def in_flight(self) -> list[list[Any]]:
        """The flight recorder's entries of this group's calls still open here (for a dump)."""
        return [self._entry(index, item) for index, item in enumerate(list(self._live)) if item is not None]

    def _entry(self, index: int, item: Call | Step) -> list[Any]:
        """An open call's entry: ``item`` is its Call until its step is agreed, then its Step."""
        if isinstance(item, Step):
            call, plan = item.call, item.plan
            executor = plan.executor
            signature: Signature | None = item.agreed
            number, path, state = plan.number, executor.path, "started"
            algorithm = call.algorithm or executor.strategy
        else:
            call, path, algorithm, state = item, "", None, "scheduled"
            signature = getattr(call, "signature", None)  # (set once the call is prepared)
            number = call.number
        return [
            self.local[index],
            self.members,
            number,
            call.kind,
            call.origin,
            signature,
            path,
            algorithm,
            state,
            call.created,
            call.started,
            0,
            None,
        ]

    def step(self, peer: int, index: int, call: Call, deadline: float, timeout: float) -> Step:
        """Post ``call`` at this peer's next step and wait for the verdict: a Step, or the shared error.

        Raises MismatchError, InvalidArgumentError, CollectiveTimeout (naming the peers that never
        arrived), PeerLostError and JobClosedError.
        """
        reporter: int | None = 0
        if self._alone:
            number, outcome = self._decide_alone(peer, call)
        else:
            slot, verdict = self._arrive(index, peer, call, deadline)
            outcome = verdict if verdict is not None else self._await(slot, index, call, deadline, timeout)
            number, reporter, deadline = slot.number, slot.reporter, slot.deadline
        if isinstance(outcome, CollectiveError):
            if reporter == index and self.job.site.node is not None:
                return self._reporting(number, peer, index, call, outcome, deadline, timeout)
            raise clone_error(outcome)
        return Step(outcome, peer, index, self._ranks[index], call, deadline, timeout)

    def _reporting(
        self,
        number: int,
        peer: int,
        index: int,
        call: Call,
        error: CollectiveError,
        deadline: float,
        timeout: float,
    ) -> Step:
        """Multi-node: the one local peer that tells the other nodes this step failed here."""
        label = f"{call.kind} #{number}"
        executor = choose(self.job.site, self.members, self.local, call.signature, [], label)
        plan = Plan(number, call.signature, [call], self.members, executor, clone_error(error))
        return Step(plan, peer, index, self._ranks[index], call, deadline, timeout)

    def _arrive(
        self, index: int, peer: int, call: Call, deadline: float
    ) -> tuple[_Slot, Plan | CollectiveError | None]:
        """Post the call at this peer's next step; the last peer to arrive decides the outcome.

        Returns the slot and its verdict, or None: then this peer's bell is armed, and rung with it.
        """
        job = self.job
        wake: list[Doorbell] = []
        try:
            with job.lock:
                job.check_member(peer)
                number = self._next[index]
                slot = self._slots.get(number)
                if job.left and (slot is None or slot.outcome is None):  # (a late peer: the step's
                    self._raise_gone(peer, call)  # error, whoever left since)
                self._next[index] = number + 1
                if slot is None:
                    slot = self._slots[number] = _Slot(number)
                calls = slot.calls
                calls[index] = call
                slot.deadline = min(slot.deadline, deadline)
                if len(calls) < len(self.local) or slot.outcome is not None:
                    if slot.outcome is None:
                        self.bells[index].arm()
                    elif len(calls) == len(self.local):
                        del self._slots[number]
                    return slot, slot.outcome
                del self._slots[number]  # nobody else will look for it
                try:
                    slot.outcome = self._decide(slot)
                except BaseException as exc:  # e.g. MemoryError computing a fused result
                    slot.outcome = PeerLostError(
                        f"{call.kind} #{number}: peer {peer} failed deciding it: {exc!r}", [peer]
                    )
                    raise
                finally:
                    slot.reporter = 0
                    wake = claim_armed(self.bells)
                return slot, slot.outcome
        finally:
            if wake:
                ring_claimed(wake)  # once the lock is released (see transport.inproc.Doorbell)

    def _raise_gone(self, peer: int, call: Call) -> None:
        gone = self.job.gone_among(self.local)
        if gone:
            raise PeerLostError(
                f"{describe_peers(gone)} left the job (finish), so peer {peer}'s {call.kind} cannot "
                f"complete; finish the remaining peers",
                gone,
            )

    def _decide_alone(self, peer: int, call: Call) -> tuple[int, Plan | CollectiveError]:
        """The one local peer's step: what ``_arrive`` does, without a slot to meet in."""
        job = self.job
        with job.lock:  # nothing to ring: no other local peer waits here
            job.check_member(peer)
            number = self._next[0]
            self._next[0] = number + 1
        signature = call.signature
        agreed = signature if not call.rules.sourced else self._sourced.get(signature)
        if signature.error is None and agreed is not None:  # it agrees with itself
            label = f"{signature.kind} #{number}"
            try:
                executor = choose(job.site, self.members, self.local, agreed, [call], label)
            except CollectiveError as exc:
                return number, exc
            return number, Plan(number, agreed, [call], self.members, executor)
        outcome = self._decide(_Slot(number, {0: call}))
        if isinstance(outcome, Plan) and signature.error is None:  # a broadcast, a scatter
            if len(self._sourced) >= 32:
                self._sourced.clear()
            self._sourced[signature] = outcome.agreed  # the same call agrees the same way next time
        return number, outcome

    def _await(
        self, slot: _Slot, index: int, call: Call, deadline: float, timeout: float
    ) -> Plan | CollectiveError:
        """Wait on this peer's armed bell for the verdict; time the step out at the deadline."""
        job = self.job
        bell = self.bells[index]
        bell.wait(deadline - time.monotonic(), job.lock)
        outcome = slot.outcome  # set before the ring: no need to take the lock again
        while outcome is None:  # the wait timed out (the bell is disarmed again)
            with job.guard:  # a time-out wakes the others: rung once the guard is left
                outcome = slot.outcome
                if outcome is None and deadline - time.monotonic() <= 0:
                    outcome = self._time_out(slot, call, timeout)
                elif outcome is None:
                    bell.arm()
            if outcome is None:
                bell.wait(deadline - time.monotonic(), job.lock)
                outcome = slot.outcome
        return outcome

    def _time_out(self, slot: _Slot, call: Call, timeout: float) -> CollectiveTimeout:
        """Fail ``slot`` for the peers that came; late peers find the same error there (lock held)."""
        missing = sorted(set(self.local) - {self.local[i] for i in slot.calls})
        error = CollectiveTimeout(
            f"{call.kind} #{slot.number}: peers waited {timeout:g}s for {describe_peers(missing)} to call it",
            missing,
        )
        slot.fail(error)
        self.ring()
        return error

    def ring(self) -> None:
        """Wake this group's waiting peers once the job lock is released (lock held)."""
        self.job.claim(claim_armed(self.bells))

    def fail_open(self, error: CollectiveError) -> None:
        """Fail every undecided step (a peer left, the job closed) and wake the waiting peers; lock held."""
        for slot in self._slots.values():
            if slot.outcome is None:
                slot.fail(error)
        self.ring()

    def _decide(self, slot: _Slot) -> Plan | CollectiveError:
        calls = [slot.calls[i] for i in range(len(self.local))]
        again = calls[0].fused_with
        if again is not None and all(map(operator.is_, calls[1:], again[0])):  # kept calls fused before
            self._steps += 1
            _, kept, movement, outs = again
            values = movement.fuse([call.source() for call in calls])
            return Plan(slot.number, kept, calls, self.members, Fused(kept, calls, values, outs))
        agreed = unanimous([call.signature for call in calls], calls[0].rules)
        if agreed is None:
            ranks = self._ranks
            try:
                agreed = agree(
                    {ranks[i]: call.signature for i, call in enumerate(calls)},
                    f"#{slot.number}",
                    rules_of,
                    who=self._who,
                    source_elsewhere=self.job.site.node is not None,
                )
            except CollectiveError as exc:
                return exc
        label = f"{agreed.kind} #{slot.number}"
        try:
            executor: Executor = choose(self.job.site, self.members, self.local, agreed, calls, label)
        except CollectiveError as exc:  # found in the agreed call (its movement): every peer's verdict
            return exc
        self._steps += 1
        # Kept calls (persistent, or kept by the runtime) are checked and agreed once and cannot
        # change: met again, all of them, they agree as now and choose the same way (their arrays,
        # sizes and devices are the same), so their next step skips to the fused results.
        if type(executor) is Fused and all(call.kept is not None for call in calls):
            movement = calls[0].movement(agreed, len(self.members))
            calls[0].fused_with = (tuple(calls[1:]), agreed, movement, executor.outs(calls))
        return Plan(slot.number, agreed, calls, self.members, executor)

    def _who(self, ranks: list[int]) -> str:
        return describe_peers([self.members[rank] for rank in ranks])


DUMPED_ON = (CollectiveTimeout, PeerLostError, MismatchError)  # a peer's failure: the dump says whose
