"""The torch side of the "collective" backend: its Work handles, errors and tensor staging.

``collective.torch`` turns each torch.distributed call into calls of our API; what it hands back
to torch lives here:

* ``TorchWork``, a ``torch.distributed.Work`` whose ``wait()`` raises the collective's error and
  whose ``get_future()`` is a ``torch.futures.Future`` completed with the list of output tensors
  (what DDP's reducer and comm hooks read). A blocking call returns one already completed.
* ``backend_error``: our errors as ``torch.distributed.DistBackendError`` (a RuntimeError), with
  our message (prefixed with the error's class) and our error as ``__cause__``.
* ``host`` / ``store_back``: the contiguous CPU tensor a collective reads and writes, and the copy
  back into the caller's tensor where that is another one (a CUDA or non-contiguous tensor). bool
  tensors travel as uint8.

torch is optional: it is imported through importlib, so type checkers see the same (Any) types
whether or not it is installed.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from collective.errors import CollectiveError

torch: Any = importlib.import_module("torch")
dist: Any = importlib.import_module("torch.distributed")

__all__ = ["TorchWork", "backend_error", "host", "seconds", "store_back"]


def backend_error(exc: BaseException) -> BaseException:
    """``exc`` as torch users expect it: a DistBackendError with our message, caused by ``exc``.

    Anything that is not one of our errors (a bug, KeyboardInterrupt) is returned as it is.
    """
    if not isinstance(exc, CollectiveError):
        return exc
    error: BaseException = dist.DistBackendError(f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def seconds(timeout: Any) -> float | None:
    """A torch timeout (timedelta; zero or negative means unset) in seconds, or None."""
    if isinstance(timeout, timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        return None
    return value if value > 0 else None


class TorchWork(dist.Work):  # type: ignore[misc]
    """One call of the backend: ``wait()``, ``get_future()``, ``is_completed()``, ``result()``."""

    def __init__(self, outputs: Sequence[Any], label: str) -> None:
        super().__init__()
        self._outputs = list(outputs)
        self._label = label
        self._future = torch.futures.Future()
        self._done = threading.Event()
        self._error: BaseException | None = None

    @classmethod
    def completed(cls, outputs: Sequence[Any], label: str) -> TorchWork:
        work = cls(outputs, label)
        work._future.set_result(work._outputs)
        work._done.set()
        return work

    def run(self, body: Callable[[], None]) -> None:
        """Run the collective (on the group's worker thread) and complete the future either way."""
        try:
            body()
        except BaseException as exc:
            self._error = backend_error(exc)
            self._done.set()
            self._future.set_exception(self._error)
            return
        self._done.set()
        self._future.set_result(self._outputs)

    def wait(self, timeout: Any = None) -> bool:
        """True once the collective completed; its error (DistBackendError) if it failed."""
        limit = seconds(timeout)
        if limit is not None and not self._done.wait(limit):
            raise dist.DistBackendError(
                f"CollectiveTimeout: {self._label} did not complete within {limit:g}s of wait(); "
                f"it is still running (the collective's own timeout still applies)"
            )
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> Any:
        """A torch.futures.Future completed with the output tensors (or set to the error)."""
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[Any]:
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("failed" if self._error else "done")
        return f"<TorchWork {self._label} {state}>"


def host(tensor: Any) -> Any:
    """The contiguous CPU tensor a collective works on: ``tensor`` itself where it is one.

    CUDA tensors are staged through host memory; bool tensors are viewed as uint8.
    """
    buffer = tensor.detach()
    if buffer.device.type != "cpu":
        buffer = buffer.cpu()
    buffer = buffer.contiguous()
    return buffer.view(torch.uint8) if buffer.dtype == torch.bool else buffer


def store_back(buffer: Any, tensor: Any) -> None:
    """Copy ``buffer`` (from ``host(tensor)``) into ``tensor`` unless it is ``tensor``'s own memory."""
    target = tensor.detach()
    if buffer.data_ptr() == target.data_ptr() and target.device.type == "cpu" and target.is_contiguous():
        return
    target.copy_(buffer.view(torch.bool) if target.dtype == torch.bool else buffer)
