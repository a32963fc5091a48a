"""The steps that make and end a persistent collective (``col.all_reduce_init`` and the others).

A persistent collective's uses are steps of its own kind (an ``all_reduce``); it is made by one step
more, ``<kind>_init``, which carries the call's signature and is agreed under the call's own rules
(so a mismatch fails the making on every peer) while no data moves; and it ends with ``<kind>_free``,
a step of no data: a peer that frees its handle while the others use theirs meets them with a
different collective, and every peer gets the MismatchError naming who did what.
"""

from __future__ import annotations

from typing import Any, ClassVar

from collective.arrays import Device
from collective.calls.base import Call
from collective.calls.collectives import AllGather, AllReduce, Barrier, Broadcast, ReduceScatter
from collective.calls.movement import Movement, Nothing
from collective.calls.signature import Signature

__all__ = ["PERSISTENT", "Agreement", "Release", "agreement_of", "release_of"]

PERSISTENT: tuple[type[Call], ...] = (AllReduce, Broadcast, AllGather, ReduceScatter, Barrier)


class Agreement(Call):
    """``<kind>_init``: the persistent call's signature, agreed as the call's; no data moves."""

    __slots__ = ("call",)
    of: ClassVar[type[Call]]
    reduces = False

    def __init__(self, call: Call) -> None:
        super().__init__(None)
        self.call = call

    @classmethod
    def refused(cls, problem: str, root: Any = None, op: Any = "sum") -> Call:
        return cls(cls.of.refused(problem, root, op))

    def prepare(self, device: Device, members: tuple[int, ...], rank: int) -> Signature:
        self.device, self.rank = device, rank
        signature = self.call.prepare(device, members, rank)
        self.signature = signature._replace(kind=self.kind)
        if self.problem is not None and self.signature.error is None:
            self.signature = self.signature._replace(error=self.problem)
        return self.signature

    def result_shape(self, agreed: Signature, size: int, rank: int) -> tuple[int, ...] | None:
        return None

    def moves(self, agreed: Signature, size: int) -> Movement:
        return Nothing(size, agreed.dtype)


class Release(Barrier):
    """``<kind>_free``: the end of a persistent call, a barrier under a kind of its own."""

    __slots__ = ()


def _kinds() -> tuple[dict[str, type[Agreement]], dict[str, type[Release]]]:
    """One Agreement and one Release class per kind that may be persistent (their kinds are
    collective kinds like any other: the rendezvous and the call exchange between nodes agree
    them by their rules, collective.calls.RULES)."""
    made: dict[str, type[Agreement]] = {}
    freed: dict[str, type[Release]] = {}
    for cls in PERSISTENT:
        made[cls.kind] = type(
            f"{cls.__name__}Init",
            (Agreement,),
            {
                "__slots__": (),
                "of": cls,
                "kind": f"{cls.kind}_init",
                "rules": cls.rules,
                "strategy_kind": cls.strategy_kind,
            },
        )
        freed[cls.kind] = type(
            f"{cls.__name__}Free", (Release,), {"__slots__": (), "kind": f"{cls.kind}_free"}
        )
    return made, freed


AGREEMENTS, RELEASES = _kinds()


def agreement_of(call: Call) -> Agreement:
    return AGREEMENTS[call.kind](call)


def release_of(call: Call) -> Release:
    return RELEASES[call.kind]()
