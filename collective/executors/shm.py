"""The executor of a group whose peers each run in their own process, all on this host: its steps
are its ShmGroup's (collective.shm.group), each one the call's own (its signature, its rules, its
movement). choose() picks it when every member is the one peer of its process in the group and
every such process runs on this host (the topology's host identities), the same on every process.
"""

from __future__ import annotations

import numpy as np

from collective.algorithms.ops import Array
from collective.arrays import CPU
from collective.calls import rules_of
from collective.calls.movement import Movement
from collective.calls.signature import Rules, Signature
from collective.errors import CollectiveError
from collective.executors.step import Lane, Step
from collective.shm.chunks import Pieces
from collective.shm.group import ShmGroup
from collective.transport.shm_ring import INLINE_BYTES

__all__ = ["ShmExecutor"]


class _CallTask:
    """A collective's step of ``ShmExecutor``: the call's own signature, rules and movement."""

    __slots__ = ("call", "signature", "size", "step")
    source_elsewhere = False
    repeated = False

    def __init__(self, step: Step, size: int) -> None:
        self.call = step.call
        self.step = step
        self.size = size
        self.signature = step.call.signature

    def kept(self) -> _CallTask:
        """The task of each use of this persistent call (collective.persistent): the same buffers."""
        return _KeptTask(self.step, self.size)

    def rules(self, kind: str) -> Rules:
        return rules_of(kind)

    def movement(self, agreed: Signature) -> Movement:
        return self.call.movement(agreed, self.size)

    def source(self) -> np.ndarray | Pieces | None:
        call = self.call
        pieces = call.unpacked()
        if pieces is not None and call.x.nbytes > INLINE_BYTES:
            return Pieces(pieces)  # read in place by the chunks, never packed
        src = call.source()
        return None if src is None else CPU.adopt(src)  # (a CuPy input: through the host)

    def target(self, agreed: Signature, movement: Movement) -> Array | None:
        return self.call.new_result(self.call.device, agreed, self.size, self.step.rank)


class _KeptTask(_CallTask):
    """A persistent call's task, kept on its step for every use: its input and result are the same
    host buffers each time (looked up at the first use; a CuPy input goes through the host anew)."""

    __slots__ = ("_no_target", "_source", "_target")

    def __init__(self, step: Step, size: int) -> None:
        super().__init__(step, size)
        self._source: np.ndarray | Pieces | None = None
        self._target: Array | None = None
        self._no_target = False

    @property
    def repeated(self) -> bool:  # type: ignore[override]
        """Whether every use reads and writes the same host buffers (found by the first use)."""
        sourced = self._source is not None or self.call.src is None
        return sourced and (self._target is not None or self._no_target)

    def source(self) -> np.ndarray | Pieces | None:
        found = self._source
        if found is None:
            found = super().source()
            if found is not None and (type(found) is Pieces or found is self.call.src):
                self._source = found  # (read in place each use: not a copy)
        return found

    def target(self, agreed: Signature, movement: Movement) -> Array | None:
        found = self._target
        if found is None:
            found = super().target(agreed, movement)
            if found is None:
                self._no_target = True
            elif found is self.call.out:
                self._target = found
        return found


class ShmExecutor:
    """The executor of a group whose processes all run on this host: its steps are its ShmGroup's."""

    path = "shm"
    strategy = None  # (no schedule: one exchange)
    runs_again = True  # (its group's steps: each one's numbered and run in run())

    def __init__(self, group: ShmGroup) -> None:
        self.group = group

    def run(self, step: Step) -> Array | None:
        plan = step.plan
        task = step.task
        if task is None:
            task = _CallTask(step, self.group.n)
            if step.call.kept is not None:
                step.task = task = task.kept()
        step.agreed, result = self.group.run(
            plan.number, plan.label, step.deadline, step.timeout, task, plan.error
        )
        return result

    def lane(self, step: Step) -> Lane | None:
        """Its group's lane for the step's kept task (``ShmGroup.lane``), whose slow way is ``run``."""
        task = step.task
        if task is None or not task.repeated:
            return None
        return self.group.lane(task, lambda: self.run(step))

    def abort(self, error: CollectiveError) -> None:
        self.group.abort(error)
