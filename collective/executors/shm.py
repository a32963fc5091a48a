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
from collective.executors.step import Step
from collective.shm.chunks import Pieces
from collective.shm.group import ShmGroup
from collective.transport.shm_ring import INLINE_BYTES

__all__ = ["ShmExecutor"]


class _CallTask:
    """A collective's step of ``ShmExecutor``: the call's own signature, rules and movement."""

    __slots__ = ("call", "signature", "size", "step")
    source_elsewhere = False

    def __init__(self, step: Step, size: int) -> None:
        self.call = step.call
        self.step = step
        self.size = size
        self.signature = step.call.signature

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


class ShmExecutor:
    """The executor of a group whose processes all run on this host: its steps are its ShmGroup's."""

    path = "shm"
    strategy = None  # (no schedule: one exchange)

    def __init__(self, group: ShmGroup) -> None:
        self.group = group

    def run(self, step: Step) -> Array | None:
        plan = step.plan
        task = _CallTask(step, self.group.n)
        step.agreed, result = self.group.run(
            plan.number, plan.label, step.deadline, step.timeout, task, plan.error
        )
        return result

    def abort(self, error: CollectiveError) -> None:
        self.group.abort(error)
