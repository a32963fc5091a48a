"""The ``<kind>_init`` methods of the Runtime: a persistent call of each kind (collective.persistent)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from collective.algorithms.ops import Array, ReduceOp
from collective.calls import AllGather, AllReduce, Barrier, Broadcast, ReduceScatter
from collective.calls.base import Call
from collective.groups import Group
from collective.persistent.handle import Persistent

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
