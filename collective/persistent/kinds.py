"""The ``<kind>_init`` methods of the Runtime: a persistent call of each kind (collective.persistent);
and ``repeat``, which runs a call kept by its caller as a persistent use each time it comes again."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from collective.algorithms.ops import Array, ReduceOp
from collective.calls import AllGather, AllReduce, Barrier, Broadcast, ReduceScatter
from collective.calls.base import Call
from collective.groups import Group
from collective.persistent.handle import Persistent
from collective.trace import RECORDER, caller

if TYPE_CHECKING:
    from collective.executors.rendezvous import Rendezvous
    from collective.work import Sequencer

__all__ = ["Persistents"]

Op = ReduceOp | str


class Persistents:
    """The ``<kind>_init`` methods of collective.runtime.Runtime: a persistent call of each kind,
    made on the road to the group that Runtime finds (``_road``)."""

    def _road(
        self, peer_id: int, group: Any, timeout: float | None
    ) -> tuple[Any, tuple[Rendezvous, Sequencer], float, str | None]:
        raise NotImplementedError

    def start(
        self, peer_id: int, call: Call, group: Group | None, timeout: float | None, async_op: bool
    ) -> Any:
        raise NotImplementedError

    def repeat(
        self, peer_id: int, call: Call, group: Group | None = None, timeout: float | None = None
    ) -> Any:
        """Run ``call`` (with ``out``) as ``start`` does; once it has run, each time it is passed
        again it runs as a use of a persistent call: its checks, signature and agreement are not
        made again, and its result goes to ``out`` again.

        For a caller that keeps its calls by what they run on, and so vouches that their arrays
        are the same memory, shape and dtype each time (the torch backend keeps its all_reduces
        by the tensor's address and layout). A use is, for the other peers, the same step as the
        call made anew: they need not keep theirs. A call without ``out`` is never kept (its
        result would be overwritten by the next use).
        """
        if call.kept is None:
            result = self.start(peer_id, call, group, timeout, False)
            if call.out is not None:
                call.kept = call.signature  # (checked and agreed: every use runs it)
            return result
        member, (rendezvous, sequencer), seconds, problem = self._road(peer_id, group, timeout)
        if problem is not None:  # (a timeout this call was not kept with: fails on every peer)
            refused = type(call).refused(problem, root=call.root_peer, op=call.op_arg)
            return self.start(peer_id, refused, group, timeout, False)
        call.origin = caller(2) if RECORDER.enabled else None
        return sequencer.call(rendezvous.again, call.kind, member.peer, member.device, seconds, call)

    def all_reduce_init(
        self,
        peer_id: int,
        x: Array,
        op: Op = "sum",
        *,
        out: Array | None = None,
        group: Group | None = None,
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent all_reduce: each use combines x's contents then into ``out`` (which may be
        ``x``; else the array the first use returns). Raises as all_reduce does (a mismatch here)."""
        return self._persistent(peer_id, AllReduce(x, op, out=out), (x, out), group, timeout)

    def broadcast_init(
        self,
        peer_id: int,
        x: Array | None,
        *,
        out: Array | None = None,
        group: Group | None = None,
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent broadcast from the one peer that passes ``x`` (the others pass None)."""
        return self._persistent(peer_id, Broadcast(x, out=out), (x, out), group, timeout)

    def all_gather_init(
        self,
        peer_id: int,
        x: Array,
        *,
        out: Array | None = None,
        group: Group | None = None,
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent all_gather of ``x``."""
        return self._persistent(peer_id, AllGather(x, out=out), (x, out), group, timeout)

    def reduce_scatter_init(
        self,
        peer_id: int,
        x: Array,
        op: Op = "sum",
        *,
        out: Array | None = None,
        group: Group | None = None,
        timeout: float | None = None,
    ) -> Persistent:
        """A persistent reduce_scatter of ``x``."""
        return self._persistent(peer_id, ReduceScatter(x, op, out=out), (x, out), group, timeout)

    def barrier_init(
        self, peer_id: int, *, group: Group | None = None, timeout: float | None = None
    ) -> Persistent:
        """A persistent barrier."""
        return self._persistent(peer_id, Barrier(), (), group, timeout)

    def _persistent(
        self, peer_id: int, call: Call, given: tuple[Any, ...], group: Group | None, timeout: float | None
    ) -> Persistent:
        return Persistent(peer_id, call, given, partial(self._road, peer_id, group), timeout)
