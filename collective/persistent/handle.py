"""Persistent collectives: a call agreed once, then run again and again on the same buffers.

```python
h = col.all_reduce_init(peer, x, op="sum")  # every peer of the group; a mismatch fails here
for step in range(n):
    x[:] = ...                              # the input: x's contents at each use
    y = h()                                 # or h.start(); ...; y = h.wait()
h.free()                                    # every peer (or: with col.all_reduce_init(...) as h:)
```

Making one is a step of its own (``<kind>_init``, collective.calls.persistent) that agrees the
call's signature across the group as the call itself would be, so a mismatch fails the making on
every peer. Each use is a step of the call's kind that skips what cannot change between uses:
the arguments are parsed and checked once, the signature is made once, the road to the group is
found once, and the result goes to the same buffer every time (``out``, which may be ``x``; else
the array the first use returned). Only what can change is checked at each use: the buffers are
still the same size and dtype (a torch tensor still the same memory); a changed one fails the
use on every peer (InvalidArgumentError), which keeps the group in step. Every failure of a
normal call holds for a use: timeouts, a lost peer, a mismatch with what another peer calls.
``free()`` is a step too (``<kind>_free``): a peer that frees its handle while the others use
theirs meets them with a different collective, a MismatchError on every peer naming who freed,
after which every peer's handle is freed (nobody would meet a use of it again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from collective.calls.base import Call
from collective.calls.persistent import agreement_of, release_of
from collective.errors import InvalidArgumentError, MismatchError
from collective.tensors import writable
from collective.trace import RECORDER, caller
from collective.work import Work

if TYPE_CHECKING:
    from collective.executors.rendezvous import Rendezvous
    from collective.work import Sequencer

__all__ = ["Persistent"]

LANE_TRIES = 4  # first uses after each of which a handle looks for its lane (Rendezvous.lane)


# The road to the group for a timeout (Runtime._road for the peer and group): the peer, its
# rendezvous and sequencer there, the timeout in seconds, a problem with that timeout.
Road = Callable[[float | None], tuple[Any, tuple["Rendezvous", "Sequencer"], float, str | None]]


class Persistent:
    """One peer's handle of a persistent collective (made by ``Runtime.<kind>_init``)."""

    def __init__(self, peer: int, call: Call, given: Any, road: Road, timeout: float | None) -> None:
        self.peer = peer
        self.kind = call.kind
        self._call = call
        unique = {id(item): item for item in given if item is not None}  # (out may be x)
        unfit = next((found for item in unique.values() if (found := Watched.unfit(item))), None)
        self._watched = [] if unfit else [Watched(item, item is call.out_given) for item in unique.values()]
        member, (rendezvous, sequencer), seconds, problem = road(timeout)
        self._road = road
        self._member, self._rendezvous, self._sequencer = member, rendezvous, sequencer
        self._seconds = seconds
        self._work: Work | None = None
        self._freed = False
        self._lane: Callable[[float], Any] | None = None  # each use once the first ones found it
        self._lane_tries = LANE_TRIES
        agreement = agreement_of(call)
        if problem is not None or unfit is not None:  # (refused on every peer, as a call would be)
            agreement.refuse(problem or f"a persistent {call.kind}: {unfit}")
        self._run(agreement, seconds, caller(3) if RECORDER.enabled else None)
        call.kept = call.signature  # (checked and agreed: kept for every use)

    @property
    def out(self) -> Any:
        """Where each use writes its result (None until the first use, where that use makes it)."""
        call = self._call
        return call.out_given if call.out is not None else None

    def __call__(self, timeout: float | None = None) -> Any:
        """Run once: the result (``out``), or the use's error."""
        lane = self._lane
        if lane is not None and timeout is None and self._work is None and not self._freed:
            # the common use, once its lane was found: ``_use``, ``_run`` and ``_kept`` inline (the
            # result buffer was made by then)
            call = self._call
            for watched in self._watched:
                if watched.change() is not None:
                    break  # (refused by ``_use`` below, on every peer)
            else:
                call.origin = caller(2) if RECORDER.enabled else None
                try:
                    return self._sequencer.call(lane, call.kind, self._seconds)
                except MismatchError as exc:
                    self._met_a_free(exc)
                    raise
        seconds, call = self._use(timeout)
        result = self._run(call, seconds, caller(2) if RECORDER.enabled else None)
        if self._lane is None and call is self._call and self._lane_tries:
            self._lane_tries -= 1
            self._lane = self._rendezvous.lane(call)
        return result

    def start(self, timeout: float | None = None) -> None:
        """Start a use; ``wait()`` gives its result. One use at a time."""
        seconds, call = self._use(timeout)
        if RECORDER.enabled:
            call.origin = caller(2)
        rendezvous, member = self._rendezvous, self._member
        self._work = self._sequencer.submit(
            lambda: self._used(rendezvous.again, member, seconds, call), call.kind
        )

    def wait(self, timeout: float | None = None) -> Any:
        """The started use's result (``out``), or its error; CollectiveTimeout after ``timeout``
        seconds of waiting (the use goes on: wait again)."""
        work = self._work
        if work is None:
            raise InvalidArgumentError(
                f"wait() on a persistent {self.kind} with no use started: call start()"
            )
        try:
            return work.wait(timeout)
        finally:
            if work.is_completed():
                self._work = None

    def free(self, timeout: float | None = None) -> None:
        """End it, with every peer of the group (a step of its own); a second free does nothing."""
        if self._freed:
            return
        if self._work is not None:
            raise InvalidArgumentError(
                f"free() on a persistent {self.kind} whose use is running: wait() first"
            )
        self._freed = True
        _, _, seconds, problem = self._road(timeout)
        release = release_of(self._call)
        if problem is not None:
            release.refuse(problem)
        self._run(release, seconds, caller(2) if RECORDER.enabled else None)

    def __enter__(self) -> Persistent:
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if error is None:
            self.free()
            return
        # (the others meet this peer's free and are told, rather than wait for it to time out; the
        # error that ends the block is the one to see)
        with contextlib.suppress(Exception):
            self.free()

    def __repr__(self) -> str:
        state = "freed" if self._freed else ("running" if self._work is not None else "ready")
        return f"<Persistent {self.kind} of peer {self.peer} {state}>"

    def _use(self, timeout: float | None) -> tuple[float, Call]:
        """The timeout of a use, and its call, refused on every peer if a buffer changed."""
        if self._freed:
            raise InvalidArgumentError(f"this persistent {self.kind} was freed: make another")
        if self._work is not None:
            raise InvalidArgumentError(f"a use of this persistent {self.kind} is running: wait() first")
        call = self._call
        seconds = self._seconds
        if timeout is not None:
            _, _, seconds, problem = self._road(timeout)
            if problem is not None:
                return seconds, _refused(call, problem)
        for watched in self._watched:
            change = watched.change()
            if change is not None:
                return seconds, _refused(
                    call,
                    f"a buffer of this persistent {call.kind} changed since it was made: {change}; make a "
                    f"new one for the new buffer",
                )
        return seconds, call

    def _run(self, call: Call, seconds: float, origin: Any) -> Any:
        call.origin = origin
        lane = self._lane
        try:
            if lane is not None and call is self._call:  # (a use, once its lane was found)
                result = self._sequencer.call(lane, call.kind, seconds)
            else:  # (a use, or not: making or freeing the handle, a use refused)
                rendezvous, member = self._rendezvous, self._member
                run = rendezvous.again if call is self._call else rendezvous.run
                result = self._sequencer.call(run, call.kind, member.peer, member.device, seconds, call)
        except MismatchError as exc:
            self._met_a_free(exc)
            raise
        return self._kept(result)

    def _used(self, run: Callable[..., Any], member: Any, seconds: float, call: Call) -> Any:
        """A started use, on the sequencer's thread."""
        try:
            return self._kept(run(member.peer, member.device, seconds, call))
        except MismatchError as exc:
            self._met_a_free(exc)
            raise

    def _met_a_free(self, error: MismatchError) -> None:
        """A use that met another peer's free: this handle is over too (nobody would meet it again)."""
        if f" {self.kind}_free" in str(error):
            self._freed = True

    def _kept(self, result: Any) -> Any:
        """After a use without ``out``: the result's buffer is where every later use writes."""
        call = self._call
        if call.out is None and result is not None:
            call.out_given, call.out, call.out_apart = result, writable(result), True
        return result


def _refused(call: Call, problem: str) -> Call:
    """A use that fails on every peer with ``problem`` (a fresh call: the kept one stays intact)."""
    return type(call).refused(problem, root=call.root_peer, op=call.op_arg)


class Watched:
    """What must not change of one buffer between uses: its shape, dtype and strides (each use
    reads and writes it through the view made when the handle was), a torch tensor's memory
    (``set_`` moves it; numpy and CuPy arrays cannot move), and, for a buffer the uses write
    (``written``), that a numpy array is still writable. Checked at every use: cheap."""

    __slots__ = ("at", "dtype", "item", "numpy", "pointer", "shape", "strides", "written")

    def __init__(self, item: Any, written: bool = False) -> None:
        self.item, self.shape, self.dtype, self.strides = item, item.shape, item.dtype, _strides(item)
        pointer = getattr(item, "data_ptr", None)
        self.pointer = pointer if callable(pointer) else None
        self.at = self.pointer() if self.pointer is not None else None
        self.written = written and isinstance(item, np.ndarray)  # (its flags: read at each use)
        self.numpy = isinstance(item, np.ndarray)  # (its layout read as attributes: the quick check)

    @staticmethod
    def unfit(item: Any) -> str | None:
        """Why ``item`` cannot be a persistent call's buffer (None: it can): each use must read and
        write the same memory, which an array-like without a shape, or a torch view read as a
        copy (conjugate, negative), is not."""
        if not hasattr(item, "shape") or not hasattr(item, "dtype"):
            return f"a {type(item).__name__} is read as a copy: pass a numpy, CuPy or torch array"
        if callable(getattr(item, "is_conj", None)) and (item.is_conj() or item.is_neg()):
            return "a conjugate or negative torch view is read as a copy: pass x.resolve_conj().resolve_neg()"
        return None

    def change(self) -> str | None:
        """How it changed, or None."""
        item = self.item
        if (  # (a numpy array as it was: the common case, in one expression)
            self.numpy
            and item.shape == self.shape
            and item.strides == self.strides
            and item.dtype is self.dtype
            and (not self.written or item.flags.writeable)
        ):
            return None
        shape, dtype = item.shape, item.dtype
        if shape != self.shape or (dtype is not self.dtype and dtype != self.dtype):
            return f"was shape {tuple(self.shape)} {self.dtype}, is shape {tuple(shape)} {dtype}"
        if _strides(item) != self.strides:
            return f"its strides changed (shape {tuple(shape)} {dtype}, was laid out as {self.strides})"
        if self.pointer is not None and self.pointer() != self.at:
            return f"its memory moved (shape {tuple(shape)} {dtype})"
        if self.written and not item.flags.writeable:
            return f"it is read-only now (shape {tuple(shape)} {dtype}): the result cannot be written"
        return None


def _strides(item: Any) -> tuple[int, ...]:
    """numpy's and CuPy's ``strides``, torch's ``stride()``."""
    strides = getattr(item, "strides", None)
    return tuple(item.stride()) if strides is None else strides
