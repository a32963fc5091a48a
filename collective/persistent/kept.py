"""Normal calls that come again on the same arrays run as uses of a persistent call.

A training or decoding loop calls the same collective on the same buffers step after step::

    for step in range(n):
        ...                                      # x's contents change
        col.all_reduce(peer, x, out=out)         # the same x, out, op and group each time

A blocking all_reduce, broadcast, all_gather or reduce_scatter given numpy arrays of at most
KEPT_BYTES (``out`` among them: where every use writes) is kept, by its peer, kind, the identity
of its arrays, its op and the road to its group (the job and group it ran in); a blocking
barrier, which has no arrays, by its peer and group. When a call of the
same kind comes again on the same arrays, with the same op and group, and the arrays still have
the shape, strides and dtype they had (``out`` still writable), it runs as a use of a persistent
call (``Runtime.repeat``): the argument checks, the signature and the agreement of its first run
hold for it (nothing they depend on changed) and are not made again; its input is read anew. For
the other peers it is the same step as a call made anew, so they need not keep theirs. Anything
else is a call made anew. A call is kept the second time it comes on the same arrays (the first
time it is only noted, weakly: a loop that passes new arrays each time keeps nothing, and pays
only for the noting), and one kept whose arrays changed is kept anew in its place.

A kept call holds its arrays (at most KEPT_CALLS calls noted or kept per runtime, the oldest let
go first: a few MiB at most), so an array kept cannot be resized in place (``ndarray.resize``; numpy refuses
it for an array another one references). ``COLLECTIVE_REPEAT=0`` turns keeping off (read when a
runtime first keeps a call): every call is then checked and agreed anew.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from collective.algorithms.ops import ReduceOp
from collective.calls.base import Call
from collective.calls.collectives import Barrier
from collective.groups import Group
from collective.persistent.handle import LANE_TRIES
from collective.trace import RECORDER, caller

if TYPE_CHECKING:
    from collective.executors.rendezvous import Rendezvous
    from collective.work import Sequencer

__all__ = ["KEPT_BYTES", "KEPT_CALLS", "REPEAT_VARIABLE", "KeptCalls"]

KEPT_CALLS = 64
KEPT_BYTES = 64 << 10  # arrays up to this size (larger calls spend their time moving data)
REPEAT_VARIABLE = "COLLECTIVE_REPEAT"  # 0: no call is kept (every call checked and agreed anew)


_OFF: dict[Any, Any] = {}  # the kept calls of a runtime that keeps none (never written)


class _Kept:
    """A kept call, the arrays it runs on (held: their identities key it) and their layouts then,
    and its road: the peer's registration it was kept in, its rendezvous and sequencer there, the
    job's timeout."""

    __slots__ = (
        "call",
        "lane",
        "lane_tries",
        "layout",
        "member",
        "out",
        "out_layout",
        "rendezvous",
        "seconds",
        "sequencer",
        "x",
    )
    member: Any

    def __init__(
        self, call: Call, x: np.ndarray | None, out: np.ndarray | None, road: tuple[Any, Any, Any, float]
    ) -> None:
        self.call, self.x, self.out = call, x, out
        self.member, self.rendezvous, self.sequencer, self.seconds = road
        self.layout = None if x is None else (x.shape, x.strides, x.dtype)
        self.out_layout = None if out is None else (out.shape, out.strides, out.dtype)
        self.lane: Callable[[float], Any] | None = None  # its runs once the first ones found it
        self.lane_tries = LANE_TRIES

    def holds(self, x: np.ndarray | None, out: np.ndarray | None) -> bool:
        """Whether ``x`` and ``out`` (the kept arrays; None for a barrier's) are laid out as they
        were, ``out`` writable (one expression: this is every kept call's; a dtype set anew, even
        to an equal one, is a change)."""
        if out is None:
            return True  # (a barrier)
        shape, strides, dtype = self.out_layout  # type: ignore[misc]
        if out.shape != shape or out.strides != strides or out.dtype is not dtype or not out.flags.writeable:
            return False
        if x is None:
            return True
        shape, strides, dtype = self.layout  # type: ignore[misc]
        return x.shape == shape and x.strides == strides and x.dtype is dtype


# A call that came once on these arrays: weak references to its x and out (an array let go frees
# its id for a new one, which must not count as the same), kept if it comes again on them.
_Seen = tuple[Callable[[], Any], Callable[[], Any]]


def _none() -> None:
    """The weak reference of a call's x (or a barrier's out) that is None."""


def _weak(item: Any) -> Callable[[], Any]:
    return _none if item is None else weakref.ref(item)


class KeptCalls:
    """The Runtime's keeping of its normal calls (a mixin of collective.runtime.Runtime)."""

    _kept_calls: dict[tuple[Any, ...], _Kept | _Seen] | None = None  # (made at the first call kept)
    _peers: dict[int, Any]  # the Runtime's registered peers (a kept call is its registration's)

    def _road(
        self, peer_id: int, group: Any, timeout: float | None
    ) -> tuple[Any, tuple[Rendezvous, Sequencer], float, str | None]:
        raise NotImplementedError

    def _start(
        self,
        peer_id: int,
        call: Call,
        group: Any,
        timeout: float | None,
        async_op: bool,
        strategy: Any,
    ) -> Any:
        raise NotImplementedError

    def _again_or_start(
        self,
        peer_id: int,
        make: Callable[..., Call],
        args: tuple[Any, ...],
        out: Any,
        group: Any,
        timeout: float | None,
        async_op: bool,
        strategy: Any,
    ) -> Any:
        """``make(*args, out=out)`` (``args``: x, then op for a reduction; none for a barrier, whose
        ``out`` is None) run by ``_start``, or the call kept for these arguments run again (see the
        module's docstring)."""
        x = args[0] if args else None
        op = args[1] if len(args) > 1 else None
        calls = self._kept_calls if self._kept_calls is not None else self._keeping()
        if (
            calls is _OFF
            or async_op
            or strategy is not None
            or (out is None and make is not Barrier)
            or (out is not None and (type(out) is not np.ndarray or out.nbytes > KEPT_BYTES))
            or (x is not None and (type(x) is not np.ndarray or x.nbytes > KEPT_BYTES))
            or (op is not None and type(op) is not str and type(op) is not ReduceOp)
            or (group is not None and type(group) is not Group)  # (a list of ids: made anew)
        ):
            return self._start(peer_id, make(*args, out=out), group, timeout, async_op, strategy)
        key = (peer_id, make, id(x), id(out), op, group)
        kept = calls.pop(key, None)  # (taken while it runs)
        if not isinstance(kept, _Kept):
            if kept is None or kept[1]() is not out or kept[0]() is not x:  # (first seen: made anew)
                self._keep(key, (_weak(x), _weak(out)))
                return self._start(peer_id, make(*args, out=out), group, timeout, False, None)
        elif kept.holds(x, out) and kept.member is self._peers.get(peer_id):
            seconds, problem = kept.seconds, None
            if timeout is not None:  # (checked as any call's; a bad one fails every peer, anew)
                _, _, seconds, problem = self._road(peer_id, group, timeout)
            if problem is None:
                call = kept.call
                call.origin = caller(3) if RECORDER.enabled else None
                lane = kept.lane
                if lane is not None:  # (Rendezvous.lane: the per-use floor)
                    result = kept.sequencer.call(lane, call.kind, seconds)
                else:
                    member: Any = kept.member
                    again = kept.rendezvous.again
                    result = kept.sequencer.call(again, call.kind, peer_id, member.device, seconds, call)
                    if kept.lane_tries:
                        kept.lane_tries -= 1
                        kept.lane = kept.rendezvous.lane(call)
                calls[key] = kept  # (back once it ran: one that failed is made anew next time)
                return result
        member, (rendezvous, sequencer), seconds, _ = self._road(peer_id, group, None)  # (before: finish
        call = make(*args, out=out)  # may come while it runs, and the call is kept under its road)
        result = self._start(peer_id, call, group, timeout, False, None)
        if call.out is not None or make is Barrier:  # (it ran: checked and agreed, every later use runs it)
            call.kept = call.signature
            self._keep(key, _Kept(call, x, out, (member, rendezvous, sequencer, seconds)))
        return result

    def _keeping(self) -> dict[tuple[Any, ...], _Kept | _Seen]:
        """The kept calls (``_OFF``: COLLECTIVE_REPEAT=0), made the first time."""
        off = os.environ.get(REPEAT_VARIABLE, "1").strip() == "0"
        calls = self._kept_calls = _OFF if off else {}
        return calls

    def _keep(self, key: tuple[Any, ...], kept: _Kept | _Seen) -> None:
        calls = self._kept_calls
        assert calls is not None
        calls[key] = kept
        if len(calls) > KEPT_CALLS:
            with contextlib.suppress(RuntimeError, StopIteration):  # (another peer's thread changed it)
                calls.pop(next(iter(calls)), None)  # (the oldest kept)

    def _let_go(self, peer_id: int | None) -> None:
        """Forget the calls kept for ``peer_id`` (None: every peer), as it leaves its job."""
        calls = self._kept_calls
        if calls:
            for key in [key for key in list(calls) if peer_id is None or key[0] == peer_id]:
                calls.pop(key, None)
