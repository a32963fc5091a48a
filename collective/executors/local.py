"""The executors of one process: every peer of the group is a thread here.

* ``Fused``: small numpy arrays. The last peer at the rendezvous computes every peer's result
  (``Movement.fuse``) and writes it where that peer gets it. One wake-up per peer.
* ``Shared``: mid-size numpy arrays. Every peer reads the others' inputs directly and does its
  share (``Movement.part``: e.g. its slice of a reduction), all meet at one barrier, then each
  finishes (``Movement.after``: e.g. copies the shared result out).
* ``Linked``: anything else (large arrays, CuPy): the configured strategy's schedule
  (collective.algorithms) over the in-process Link.
"""

from __future__ import annotations

import numpy as np

from collective.algorithms.ops import Array, array_module, copy_into
from collective.algorithms.strategies import Strategy
from collective.arrays import CPU, flat
from collective.calls.base import Call, Outs
from collective.calls.movement import Movement
from collective.calls.signature import Signature
from collective.errors import CollectiveError
from collective.executors.step import Step
from collective.transport.inproc import Exchange, InProcessLink

__all__ = ["Fused", "Linked", "Shared", "numpy_within"]


def numpy_within(calls: list[Call], inputs: list[Array | None], limit: int) -> bool:
    """Every peer is on the host and every input is a numpy array of at most ``limit`` bytes (peers
    without an input, e.g. a broadcast's receivers, are fine)."""
    for call, a in zip(calls, inputs, strict=True):
        if call.device is not CPU or (a is not None and (type(a) is not np.ndarray or a.nbytes > limit)):
            return False
    return True


def _target(step: Step, movement: Movement) -> tuple[Array | None, Array | None, Array | None]:
    """(the result, the flat buffer the work writes, a scratch buffer to copy back from or None).

    A scratch stands in for the result when the movement's schedules may not write ``out`` while
    it is also ``x`` (an exchange reads x's blocks while it writes the result).
    """
    call, plan = step.call, step.plan
    result = call.new_result(call.device, plan.agreed, plan.size, step.rank)
    if result is None:
        return None, None, None
    buffer = flat(result)
    if (
        not movement.alias_safe
        and call.x is not None
        and array_module(buffer).may_share_memory(buffer, call.x)
    ):
        scratch = array_module(buffer).empty_like(buffer)
        return result, scratch, scratch
    return result, buffer, None


class Fused:
    """The last peer at the rendezvous computed every peer's result and wrote it into that peer's
    ``out`` or a new array, so a woken peer only returns it: a woken peer with work left would queue
    for the GIL behind the others (measured: the slower the path after the wake-up, the more
    wake-ups wait for the GIL). In one process every member is local, so local index = rank.

    ``fused`` holds fresh arrays (never views of an input), so writing a result into ``out = x``
    cannot change what another rank reads, even for an exchange in place.
    """

    path = "fused"
    strategy = None  # (no schedule: one exchange)
    runs_again = False  # (the results are computed when it is chosen)

    def __init__(
        self, agreed: Signature, calls: list[Call], fused: list[Array | None], outs: Outs | None = None
    ) -> None:
        self.results: list[Array | None] = []
        if outs is not None:  # (every call's out and its flat view, as ``outs()`` found them last time)
            for target, value in zip(outs[1], fused, strict=True):
                target[...] = value
            self.results.extend(outs[0])
            return
        size = len(calls)
        for rank, call in enumerate(calls):
            value = fused[rank]
            if call.out is None and value is not None and value.dtype == agreed.dtype:  # a new result:
                shape = call.result_shape(agreed, size, rank)  # a copy of the value, in one call
                if shape is not None and value.shape != shape:
                    value = value.reshape(shape)
                result = None if shape is None else value.copy()
            else:
                result = call.new_result(call.device, agreed, size, rank)
                if result is not None:
                    result.reshape(-1)[...] = value  # results are C-contiguous numpy arrays
            self.results.append(result)

    def outs(self, calls: list[Call]) -> Outs | None:
        """(every call's ``out``, its flat view) where this step wrote each result into its call's
        ``out``, a C-contiguous numpy array (a step of the same calls is then made with them, and
        writes its results through the flat views); else None."""
        outs: list[Array] = []
        for result, call in zip(self.results, calls, strict=True):
            if result is None or result is not call.out or type(result) is not np.ndarray:
                return None
            if not result.flags.c_contiguous:
                return None
            outs.append(result)
        return outs, [out.reshape(-1) for out in outs]

    def run(self, step: Step) -> Array | None:
        return self.results[step.rank]

    def abort(self, error: CollectiveError) -> None:
        """Nobody waits for anybody on this path."""

    def lane(self, step: Step) -> None:
        """None: a use is a step of its own here (the results are computed when it is chosen)."""
        return None


class Shared:
    """Each peer does its part reading the others' inputs, all meet at one barrier, each finishes."""

    path = "shared"
    strategy = None  # (no schedule: one exchange)
    runs_again = False  # (an exchange, and inputs, of one step)

    def __init__(
        self, exchange: Exchange, inputs: list[Array | None], movement: Movement, state: object
    ) -> None:
        self.exchange = exchange
        self.inputs = inputs
        self.movement = movement
        self.state = state

    def run(self, step: Step) -> Array | None:
        movement = self.movement
        result, buffer, scratch = _target(step, movement)
        movement.part(self.inputs, self.state, step.rank, buffer)
        self.exchange.barrier(step.index, step.deadline)
        movement.after(self.state, step.rank, buffer)
        if scratch is not None:
            copy_into(flat(result), scratch)
        return result

    def abort(self, error: CollectiveError) -> None:
        self.exchange.abort(error)

    def lane(self, step: Step) -> None:
        """None: a use is a step of its own here (an exchange of one step)."""
        return None


class Linked:
    """The configured strategy's schedule over the in-process Link."""

    path = "linked"
    runs_again = False  # (an exchange of one step)

    def __init__(self, exchange: Exchange, strategy: Strategy, movement: Movement) -> None:
        self.exchange = exchange
        self.strategy = strategy
        self.movement = movement

    def run(self, step: Step) -> Array | None:
        result, buffer, scratch = _target(step, self.movement)
        link = InProcessLink(self.exchange, step.index, step.deadline)
        self.movement.run_link(self.strategy, link, step.call.source(), buffer)
        link.flush()
        if scratch is not None:
            copy_into(flat(result), scratch)
        return result

    def abort(self, error: CollectiveError) -> None:
        self.exchange.abort(error)

    def lane(self, step: Step) -> None:
        """None: a use is a step of its own here (an exchange of one step)."""
        return None
