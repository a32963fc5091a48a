"""The backend's own checks of torch's arguments, and how a failed one fails every rank.

torch hands the backend lists, options and tensors; what the runtime cannot see (a list of the
wrong length, a sparse or expanded tensor, an op a dtype cannot take) is checked here, before the
call. ``on_every_rank`` makes such a problem the collective's step on every rank: the runtime gets
a refused call of the collective's kind, so every rank gets the same InvalidArgumentError at once
and the group stays in step (instead of this rank raising alone while the others wait in the
collective and fall out of step with it).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from collective.arrays import overlaps_itself
from collective.calls.base import Call
from collective.errors import CollectiveError, InvalidArgumentError
from collective.torch.work import DTYPES, backend_error

torch: Any = importlib.import_module("torch")
dist: Any = importlib.import_module("torch.distributed")

__all__ = [
    "PREMUL_SUM",
    "LocalProblem",
    "dense",
    "dense_all",
    "invalid",
    "kind_of",
    "on_every_rank",
    "op_name",
    "reduce_op",
    "single",
    "writable_tensor",
]

Method = TypeVar("Method", bound=Callable[..., Any])

_KINDS = dist.ReduceOp.RedOpType
# by each kind's value (an int: torch's kind objects are made anew each time and compare slowly)
_OPS = {
    _KINDS.SUM.value: "sum",
    _KINDS.AVG.value: "mean",
    _KINDS.PRODUCT.value: "prod",
    _KINDS.MIN.value: "min",
    _KINDS.MAX.value: "max",
    _KINDS.BAND.value: "band",
    _KINDS.BOR.value: "bor",
    _KINDS.BXOR.value: "bxor",
}
_BOOL_OPS = {
    _KINDS.SUM.value: "max",
    _KINDS.MAX.value: "max",
    _KINDS.BOR.value: "max",
    _KINDS.PRODUCT.value: "min",
    _KINDS.MIN.value: "min",
    _KINDS.BAND.value: "min",
    _KINDS.BXOR.value: "bxor",
}
PREMUL_SUM = _KINDS.PREMUL_SUM.value


class LocalProblem(InvalidArgumentError):
    """A problem with this rank's arguments, found before its call reached the runtime."""


def invalid(message: str) -> BaseException:
    """A DistBackendError caused by our InvalidArgumentError (as every error of the backend is)."""
    return backend_error(LocalProblem(message))


def reduce_op(op: Any, dtype: Any) -> tuple[str, Any]:
    """Our op for torch's ``op`` on ``dtype`` tensors, and PREMUL_SUM's factor (else None)."""
    kind = kind_of(op)
    if kind == PREMUL_SUM and dtype != torch.bool:
        return "sum", op.factor
    found = (_BOOL_OPS if dtype == torch.bool else _OPS).get(kind)
    if found is None:
        raise invalid(f"ReduceOp.{op_name(op)} on {dtype} is not supported by the collective backend")
    return found, None


def kind_of(op: Any) -> int | None:
    """The value of torch's ``op``, a ReduceOp or its RedOpType (None: neither)."""
    value = getattr(getattr(op, "op", op), "value", None)  # (a ReduceOp carries its RedOpType in .op)
    return value if type(value) is int else None


def op_name(op: Any) -> str:
    """'SUM' for ReduceOp.SUM (a ReduceOp object or its RedOpType)."""
    kind = getattr(op, "op", op)
    return str(getattr(kind, "name", kind)).rpartition(".")[2]


def dense(tensor: Any, what: str) -> None:
    """A tensor the backend can read: dense (or a COO tensor to all_reduce), of a dtype it moves."""
    if tensor.layout is not torch.strided and not (
        tensor.layout is torch.sparse_coo and what == "all_reduce"
    ):
        raise invalid(
            f"{what}: a {tensor.layout} tensor: the collective backend takes dense tensors; pass "
            f"tensor.to_dense()"
        )
    if tensor.dtype not in DTYPES:
        raise invalid(
            f"{what}: {tensor.dtype} tensors are not supported by the collective backend; convert "
            f"them first (e.g. tensor.to(torch.float16)) or use torch's own backend for them"
        )


def writable_tensor(tensor: Any, what: str) -> None:
    """A tensor written in place must be dense, without elements that share memory (expanded)."""
    dense(tensor, what)
    if not tensor.is_contiguous() and overlaps_itself(tensor.shape, tensor.stride(), 1):
        raise invalid(
            f"{what}: the tensor {tuple(tensor.shape)} has elements that share memory (expand()): the "
            f"result cannot be written into it; pass a tensor of its own (.clone())"
        )


def dense_all(values: Any, what: str) -> None:
    """``dense`` for every tensor among a call's arguments (lists of them, lists of lists)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            dense(value, what)
        elif isinstance(value, list | tuple):
            dense_all(value, what)


def short_form(
    tensors: Any, opts: Any, make: Callable[[], Any], *fields: tuple[str, Any]
) -> tuple[list[Any], Any]:
    """(the tensor list, the options) of a call, from torch's forms of it: a list and an options
    object (what torch.distributed passes), or the short forms of ProcessGroup's own methods that
    some libraries call on the group object: one tensor for the list, and ``fields`` (name, value)
    given in place of the options (``pg.allreduce(t, ReduceOp.MAX)``, ``pg.broadcast(t, 1)``).
    None is the options' defaults."""
    listed = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    if opts is not None and hasattr(opts, "timeout"):
        return listed, opts
    options = make()
    for name, value in fields:
        if value is not None:
            setattr(options, name, value)
    return listed, options


def single(tensors: Sequence[Any], what: str) -> Any:
    """The one tensor of a call that takes one (torch passes lists)."""
    if len(tensors) != 1:
        raise invalid(f"{what} takes one tensor per call, got {len(tensors)}")
    return tensors[0]


def on_every_rank(kind: type[Call]) -> Callable[[Method], Method]:
    """Decorate a collective of the process group: a LocalProblem it raises becomes a refused
    ``kind`` call of the group's next step, which raises the InvalidArgumentError on every rank."""

    def wrap(method: Method) -> Method:
        @functools.wraps(method)
        def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                dense_all(args, kind.kind)
                return method(self, *args, **kwargs)
            except dist.DistBackendError as exc:
                if not isinstance(exc.__cause__, LocalProblem):
                    raise
                refused = kind.refused(str(exc.__cause__), self.members[0])
                try:  # (after this rank's queued calls on the group, as the call itself would be)
                    args = (self.peer, refused, self.group, self.call_timeout, False)
                    self._collectives.call(self.runtime.start, kind.kind, *args)
                except CollectiveError as error:
                    raise backend_error(error) from error
                raise AssertionError("unreachable: a refused call raises") from exc

        return checked  # type: ignore[return-value]

    return wrap
