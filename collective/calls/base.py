"""The base of every call object: one peer's side of one collective (collective.calls has them all).

A peer's call (``AllReduce(x, op)``, ``Gather(x, root)``, ...) is made by the API, checked here
(``prepare``: a problem becomes the signature's ``error``, so every peer fails together), agreed
at the rendezvous (its ``rules``), then run by an executor (collective.executors), which asks the
call only what the call knows:

* ``movement``: how the agreed call's data moves (a family of collective.calls.movement: a reduction,
  a copy, stacked blocks, ...), which every path runs without knowing the collective's name;
* ``result_shape`` / ``new_result``: this peer's result (None: it gets none, e.g. off the root);
* ``source`` / ``unpacked``: this peer's input, flat;
* ``finish``: the last touch (mean divides by the group's size; the caller's kind or ``out``).

Flat arrays are 1-D C-contiguous views; a collective of a group of ``n`` peers sees its blocks in
group-rank order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from collective.algorithms.ops import Array, ReduceOp, array_module
from collective.arrays import (
    CPU,
    Device,
    check_array,
    check_out,
    flat,
    integer,
    placement,
    scale_for_mean,
)
from collective.calls.movement import Movement
from collective.calls.signature import Rules, Signature, describe_peers
from collective.errors import InvalidArgumentError
from collective.pool import pool
from collective.tensors import Back, identity, native, writable

__all__ = ["Call", "Strategies", "parse_op"]

Strategies = Callable[[str], Any]  # collective kind -> the strategy configured for it


_SPELLED: dict[Any, ReduceOp] = {**{op.value: op for op in ReduceOp}, **{op: op for op in ReduceOp}}


def parse_op(op: Any) -> tuple[ReduceOp | None, str | None]:
    if type(op) is str or type(op) is ReduceOp:
        found = _SPELLED.get(op)
        if found is not None:
            return found, None
    try:
        return ReduceOp.parse(op), None
    except InvalidArgumentError as exc:
        return None, str(exc)


class Call:
    """One peer's side of one collective. Subclasses set ``kind`` and override what differs."""

    kind: ClassVar[str]
    strategy_kind: ClassVar[str]  # whose configured strategy it runs (CollectiveConfig: local_<kind>_...)
    rules: ClassVar[Rules] = Rules(("op", "shape", "dtype"))
    reduces: ClassVar[bool] = True  # takes an op
    rooted: ClassVar[bool] = False  # takes a root

    __slots__ = (
        "algorithm",
        "back",
        "created",
        "device",
        "fused_with",
        "kept",
        "last",
        "number",
        "op",
        "op_arg",
        "origin",
        "out",
        "out_apart",
        "out_given",
        "packed",
        "problem",
        "rank",
        "root",
        "root_peer",
        "signature",
        "src",
        "started",
        "strategy",
        "x",
    )

    def __init__(self, x: Any = None, op: Any = "sum", root: Any = None, out: Any = None) -> None:
        problem = None
        try:
            viewed, back = native(x)
        except InvalidArgumentError as exc:  # still a step, failed on every peer: the group keeps in step
            viewed, back, problem = None, identity, f"x: {exc}"
        self.x: Any = viewed  # a numpy or CuPy view of x
        self.back: Back = back  # how results go back to x's kind
        self.op_arg = op
        self.root = root
        self.out_given = out
        try:
            self.out = writable(out)
        except InvalidArgumentError as exc:
            self.out, problem = None, problem or f"out: {exc}"
        self.out_apart = False  # out shares no byte with x (so its checks skip the overlap test)
        if self.out is not None and self.x is not None:
            where = placement(self.out, self.x)
            if where == "same":
                self.out = self.x  # out is exactly x's memory: in place
            self.out_apart = where == "apart"
        self.root_peer = root  # the root as the caller named it (a peer id); ``root`` becomes its rank
        self.src: Array | None = None  # this peer's flat input, once prepared
        self.packed = False  # src is a contiguous copy of x (x is not contiguous)
        self.device = CPU
        self.rank = 0  # this peer's rank in the group, once prepared
        self.problem: str | None = problem  # set by refuse(): found before this call was made
        self.op: ReduceOp | None = None  # parsed from ``op`` by prepare()
        self.signature: Signature  # set by prepare()
        # What the flight recorder (collective.trace) reads while the call is open: the caller's
        # (code, line), its step's number, when it was made and its step started (ns), the
        # schedule a step chosen between nodes ran with.
        self.origin: Any = None
        self.number = self.created = self.started = 0
        self.algorithm: Any = None
        self.strategy: str | None = None  # the strategy it names ("auto", "ring", ...; None: the config's)
        # A persistent call's signature, kept once agreed (collective.persistent): its uses skip prepare.
        self.kept: Signature | None = None
        self.last: Any = None  # its last use's Step, where a use may run again as it (Rendezvous.again)
        # A kept call of the first local peer, fused with the other local peers' kept calls: (their
        # calls, the signature agreed, the movement, every call's out and its flat view where the
        # results go there), which a step of the same calls fuses again.
        self.fused_with: tuple[tuple[Call, ...], Signature, Movement, Outs | None] | None = None

    # -- before the rendezvous: this peer's own checks ------------------------------------------

    def prepare(self, device: Device, members: tuple[int, ...], rank: int) -> Signature:
        """Check this peer's arguments; its signature carries the problem if there is one.

        ``members`` are the group's peer ids in rank order and this peer is ``rank``. A root is
        given as a peer id; from here on ``root`` is its rank in the group.
        """
        if self.kept is not None:  # a persistent call's use: checked when it was made
            if self.packed:  # (its input packed again: a use reads x's contents now)
                x = self.x
                array_module(x).copyto(self.src.reshape(x.shape), x)  # type: ignore[union-attr]
            return self.kept
        self.device = device
        self.rank = rank
        op: ReduceOp | None = None
        problem: str | None = None
        if self.reduces:
            op_arg = self.op_arg
            op = _SPELLED.get(op_arg) if type(op_arg) is str or type(op_arg) is ReduceOp else None
            if op is None:
                op, problem = parse_op(op_arg)
        self.op = op
        self.root_peer = self.root
        if self.rooted:
            root = integer(self.root)
            valid = root is not None and root in members
            if problem is None and not valid:
                problem = f"root {self.root!r} is not a peer of the group ({describe_peers(list(members))})"
            self.root = members.index(root) if valid else None
        if problem is None:
            problem = self.problem or self.check(device, len(members), rank)
        self.signature = self.describe(op, problem)
        if self.strategy is not None:
            self.signature = self.signature._replace(strategy=self.strategy)
        if problem is None and self.x is not None:
            self.src = flat(self.x)
            self.packed = not self.x.flags.c_contiguous
        return self.signature

    def source(self) -> Array | None:
        """This peer's flat input, as executors read it (a call may build it on demand)."""
        return self.src

    def unpacked(self) -> list[Array] | None:
        """This peer's flat input as numpy arrays (of any shape, read flattened, one after another)
        when it is kept unpacked, so an executor able to read pieces skips the packing copy (None:
        read ``source()``)."""
        return None

    def refuse(self, problem: str) -> None:
        """Fail this call on every peer with ``problem`` (a bad argument found outside the call)."""
        self.problem = problem

    @classmethod
    def refused(cls, problem: str, root: Any = None, op: Any = "sum") -> Call:
        """A call of this kind, without arrays, that fails on every peer with ``problem`` (a root
        that is a peer of the group keeps a rooted call's own root check quiet; an ``op`` that is
        no op is named instead)."""
        call = cls(None, op, root)
        call.refuse(problem)
        return call

    def check(self, device: Device, size: int, rank: int) -> str | None:
        """Why this peer's arrays cannot be used (None if they can)."""
        problem = check_array(self.x, device, self.op)
        if problem is None and self.out is not None:
            source = None if self.out_apart else self.x
            problem = check_out(self.out, device, self.own_shape(size), self.x.dtype, source)
        return problem

    def describe(self, op: ReduceOp | None, problem: str | None) -> Signature:
        if problem is not None:
            return Signature(self.kind, op, self.root, error=problem)
        return Signature(self.kind, op, self.root, tuple(self.x.shape), self.x.dtype)

    def own_shape(self, size: int) -> tuple[int, ...]:
        """The shape of this peer's result, computed from its own input."""
        return tuple(self.x.shape)

    # -- after agreement ------------------------------------------------------------------------

    def result_shape(self, agreed: Signature, size: int, rank: int) -> tuple[int, ...] | None:
        assert agreed.shape is not None
        return agreed.shape

    def new_result(self, device: Device, agreed: Signature, size: int, rank: int) -> Array | None:
        """``out`` when given, else a new array for the result; None when this peer gets none."""
        shape = self.result_shape(agreed, size, rank)
        if shape is None:
            return None
        if self.out is not None:
            return self.out
        return pool.empty(shape, agreed.dtype) if device is CPU else device.empty(shape, agreed.dtype)

    def finish(self, result: Array | None, agreed: Signature, size: int) -> Any:
        """The result as the caller gets it: mean scaled, in ``out`` or as ``x``'s kind."""
        if result is None:
            return None
        if agreed.op is ReduceOp.MEAN:
            scale_for_mean(result, size)
        if self.out is not None:
            return self.out_given
        return result if self.back is identity else self.back(result)

    # -- the work --------------------------------------------------------------------------------

    def movement(self, agreed: Signature, size: int) -> Movement:
        """How the data of ``agreed`` (a group of ``size``) moves: a family of collective.calls.movement,
        made once per distinct call (a group repeats the same few)."""
        key = (agreed, size)
        found = _MOVEMENTS.get(key)
        if found is None:
            if len(_MOVEMENTS) >= 256:
                _MOVEMENTS.clear()
            found = _MOVEMENTS[key] = self.moves(agreed, size)
        return found

    def moves(self, agreed: Signature, size: int) -> Movement:
        """The movement of ``agreed`` (what ``movement`` caches): each call class says its family."""
        raise NotImplementedError


_MOVEMENTS: dict[tuple[Signature, int], Movement] = {}
Outs = tuple[list[Any], list[Any]]  # every local peer's out, and its flat view (Call.fused_with)
