"""The torch side of the "collective" backend: its Work handles, errors and tensor staging.

``collective.torch`` turns each torch.distributed call into calls of our API; what it hands back
to torch lives here:

* ``TorchWork``, a ``torch.distributed.Work`` whose ``wait()`` raises the collective's error and
  whose ``get_future()`` is a ``torch.futures.Future`` completed with the list of output tensors
  (what DDP's reducer and comm hooks read). A blocking call returns one already completed.
  (A group's calls keep their order through a collective.work.Sequencer; receives through
  ``Receives``, a queue per source and tag, each run by the thread that waits on it.)
* ``backend_error``: our errors as ``torch.distributed.DistBackendError`` (a RuntimeError), with
  our message (prefixed with the error's class) and our error as ``__cause__``.
* ``host`` / ``array`` / ``fill``: the contiguous CPU tensor a collective reads and writes (a copy
  of a CUDA or non-contiguous tensor, copied back with ``store_back``), the numpy view of it the
  runtime works on (bool as uint8), and writing a numpy result into a tensor.

torch is optional: it is imported through importlib, so type checkers see the same (Any) types
whether or not it is installed.
"""

from __future__ import annotations

import importlib
import threading
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import numpy as np

from collective.errors import CollectiveError, CollectiveTimeout

torch: Any = importlib.import_module("torch")
dist: Any = importlib.import_module("torch.distributed")

__all__ = [
    "DTYPES",
    "Receives",
    "TorchWork",
    "array",
    "backend_error",
    "fill",
    "host",
    "seconds",
    "store_back",
    "tensor_of",
    "viewable",
]


def backend_error(exc: BaseException) -> BaseException:
    """``exc`` as torch users expect it: a DistBackendError with our message, caused by ``exc``.

    Anything that is not one of our errors (a bug, KeyboardInterrupt) is returned as it is.
    """
    if not isinstance(exc, CollectiveError):
        return exc
    public = next(kind for kind in type(exc).__mro__ if kind.__module__ == CollectiveError.__module__)
    said = "Timed out - " if isinstance(exc, CollectiveTimeout) else ""  # (the words torch's own tests match)
    error: BaseException = dist.DistBackendError(f"{public.__name__}: {said}{exc}")  # (the class users catch)
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


_PENDING = object()


class _Failed:
    """What the source future of a failed work carries (see TorchWork)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _unwrap(source: Any) -> Any:
    value = source.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class TorchWork(dist.Work):  # type: ignore[misc]
    """One call of the backend: ``wait()``, ``get_future()``, ``is_completed()``, ``result()``.

    Its future is made when first asked for (see ``get_future``): a blocking call's never is,
    and making it costs more than the rest of the work.
    """

    def __init__(self, outputs: Sequence[Any], label: str) -> None:
        super().__init__()
        self._outputs = list(outputs)
        self._label = label
        self._source: Any = None
        self._future: Any = None  # made when first asked for (most calls never are: a blocking one)
        self._value: Any = _PENDING  # what completed it: the outputs, or _Failed
        self._lock = threading.RLock()  # (between completing and making the future)
        self._done = threading.Event()  # set once the future, if made, is complete too
        self._error: BaseException | None = None
        self._completer: int | None = None  # the thread completing the future (running its callbacks)
        self.sender: Callable[[], int] | None = None  # a receive's: the sending rank, once it completed
        self.drive: Callable[[bool], None] | None = None  # a queued receive's: run it (here: True)

    @classmethod
    def completed(cls, outputs: Sequence[Any], label: str) -> TorchWork:
        work = cls(outputs, label)
        work._complete(work._outputs)
        return work

    def run(self, body: Callable[[], None]) -> None:
        """Run the collective (on the group's worker thread) and complete the future either way."""
        try:
            body()
        except BaseException as exc:
            self._error = backend_error(exc)
            self._complete(_Failed(self._error))
            return
        self._complete(self._outputs)

    def _complete(self, value: Any) -> None:
        """Complete the future if it was made (its ``then`` callbacks run here), then wake
        ``wait()``: a waiter must find the future done, as with gloo (its value() raised an
        internal assert otherwise)."""
        self._completer = threading.get_ident()
        with self._lock:
            self._value, source = value, self._source
        try:
            if source is not None:
                source.set_result(value)
        finally:
            self._done.set()

    def _settled(self, limit: float | None) -> bool:
        if self._completer == threading.get_ident():  # a callback of this work's future waits on it:
            return True  # its result is set (the callbacks run as the future completes)
        return self._done.wait(limit)

    def _wanted(self, here: bool = False) -> None:
        """Something asks after a queued receive: it runs now (``here``, a waiter) or on its thread."""
        if self.drive is not None and not self._done.is_set():
            self.drive(here)

    def wait(self, timeout: Any = None) -> bool:
        """True once the collective completed; its error (DistBackendError) if it failed."""
        limit = seconds(timeout)
        self._wanted(here=limit is None)  # (a bounded wait leaves a receive to its thread)
        if limit is not None and not self._settled(limit):
            raise dist.DistBackendError(
                f"CollectiveTimeout: {self._label} did not complete within {limit:g}s of wait(); "
                f"it is still running (the collective's own timeout still applies)"
            )
        self._settled(None)
        if self._error is not None:
            raise self._error
        return True

    def _source_rank(self) -> int:
        """The group rank a completed receive came from (torch's dist.recv(src=None) asks for it)."""
        if self.sender is None or not self.is_success():
            raise RuntimeError(f"{self._label}: the source rank is known once a receive has completed")
        return self.sender()

    def get_future(self) -> Any:
        """A torch.futures.Future completed with the output tensors (or failed with the error).

        Made on the first call: ``source.then(_unwrap)``, where a failure raised in that callback
        marks the future failed in torch's C++ (what DDP's reducer checks); ``Future.set_exception``
        would only store the error as a value, which the reducer would read as its result."""
        self._wanted()
        with self._lock:  # (held while completing it: no other caller gets it before it is complete)
            if self._future is None:
                source = torch.futures.Future()
                self._future = source.then(_unwrap)
                self._source = source
                if self._value is not _PENDING:  # it completed before anyone asked
                    source.set_result(self._value)
            return self._future

    def is_completed(self) -> bool:
        self._wanted()
        return self._done.is_set()

    def is_success(self) -> bool:
        self._wanted()
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        self._wanted()
        return self._error

    def result(self) -> list[Any]:
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("failed" if self._error else "done")
        return f"<TorchWork {self._label} {state}>"


class _Receive:
    """One queued receive: its job, and whether anything asked after its work (run it soon)."""

    __slots__ = ("job", "wanted")

    def __init__(self, job: Callable[[], None]) -> None:
        self.job = job
        self.wanted = False


class Receives:
    """Queued receives by (source, tag), each pair's in the order issued, different pairs apart.

    A receive runs when its work is first waited on, on the waiting thread, after the pair's
    earlier receives (a blocking ``dist.recv`` so costs no thread: gloo's latency). Once anything
    else asks after a work (its future, ``is_completed``), a thread of the pair's runs the pair's
    queue, ending with its last receive; so a pending ``irecv`` holds up nothing else, and a pair
    is run by one thread at a time, its receives in order (a receive leaves the queue as it starts:
    a callback of its future, run by the same thread, may wait on the pair's next ones). Until then
    a message waits in the mailbox, as it would for a receive not yet issued.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, int], deque[_Receive]] = {}
        self._runners: dict[
            tuple[int, int], int | None
        ] = {}  # pair -> the thread running it (None: starting)

    def submit(self, key: tuple[int, int], job: Callable[[], None]) -> Callable[[bool], None]:
        """Queue ``job`` (which handles its own errors) behind the pair's earlier receives; returns
        what runs it: ``drive(True)`` here and now (unless another thread runs the pair: then it
        will), ``drive(False)`` on the pair's thread."""
        receive = _Receive(job)
        with self._lock:
            self._queues.setdefault(key, deque()).append(receive)
        return partial(self._drive, key, receive)

    def _drive(self, key: tuple[int, int], receive: _Receive, here: bool) -> None:
        me = threading.get_ident()
        with self._lock:
            queue = self._queues.get(key)
            if queue is None or receive not in queue:
                return  # it runs or ran
            receive.wanted = True
            if key in self._runners:
                if self._runners[key] != me:
                    return  # the thread that runs the pair runs it
                here = nested = True  # (this thread runs the pair: a callback waits on a later receive)
            else:
                nested = False
                self._runners[key] = me if here else None
        if here:
            self._run(key, until=receive, nested=nested)
        else:
            self._thread(key)

    def _thread(self, key: tuple[int, int]) -> None:
        """Start the pair's thread (the pair is marked as run by it)."""
        name = f"{self._name}-{key[0]}-{key[1]}"
        threading.Thread(target=self._run, args=(key,), name=name, daemon=True).start()

    def _run(self, key: tuple[int, int], until: _Receive | None = None, nested: bool = False) -> None:
        """Run the pair's receives in order: up to ``until`` (on a waiting thread) or all of them
        (on the pair's thread). A waiter leaves the rest to a thread if one of them is wanted."""
        if until is None:
            with self._lock:
                self._runners[key] = threading.get_ident()
        try:
            while True:
                with self._lock:
                    queue = self._queues.get(key)
                    if not queue:
                        break
                    head = queue.popleft()
                head.job()
                if head is until:
                    break
        finally:
            if not nested:
                self._release(key)

    def _release(self, key: tuple[int, int]) -> None:
        with self._lock:
            queue = self._queues.get(key)
            if queue and any(receive.wanted for receive in queue):
                self._runners[key] = None
                self._thread(key)  # (the pair stays run: by the thread)
                return
            if not queue:
                self._queues.pop(key, None)
            self._runners.pop(key, None)


def host(tensor: Any) -> Any:
    """The contiguous CPU tensor a collective works on: ``tensor`` itself where it is one.

    CUDA tensors are staged through host memory, non-contiguous ones copied.
    """
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor
    return tensor.detach().cpu().contiguous()


class _Holder:
    """Keeps a tensor alive under the numpy array that views its memory."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, tensor: Any, interface: dict[str, Any]) -> None:
        self.tensor = tensor
        self.__array_interface__ = interface


def array(tensor: Any, hold: bool = True) -> Any:
    """A numpy view of a contiguous CPU tensor (bool as uint8, bfloat16 as ml_dtypes' bfloat16).

    Built from the tensor's pointer, shape and strides, with no call that releases the GIL
    (``Tensor.numpy()`` and ``detach()`` do, and each release costs tens of microseconds when
    other threads want the GIL); writing the view writes the tensor, whether or not it requires
    grad. The view keeps the tensor alive unless ``hold`` is False (a kept call's view, used only
    while a tensor of the same address and layout is the call's own).
    """
    if not viewable(tensor):
        return _slow_array(tensor)
    typestr = _TYPESTR[tensor.dtype]
    size = int(typestr[2:])
    interface = {
        "data": (tensor.data_ptr(), False),
        "shape": tuple(tensor.shape),
        "strides": tuple(step * size for step in tensor.stride()),
        "typestr": typestr,
        "version": 3,
    }
    view = np.asarray(_Holder(tensor if hold else None, interface))
    return view.view(_bfloat16()) if tensor.dtype == torch.bfloat16 else view


def viewable(tensor: Any) -> bool:
    """Whether ``array`` views the tensor's own memory (else it copies: a dtype numpy has no view
    of, a negative or conjugate view whose memory means other values)."""
    return tensor.dtype in _TYPESTR and not tensor.is_neg() and not tensor.is_conj()


def _slow_array(tensor: Any) -> Any:
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8).numpy()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_bfloat16())
    return tensor.numpy()


def _bfloat16() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16


def tensor_of(values: Any) -> Any:
    """A CPU tensor viewing the numpy array ``values`` (bfloat16 too)."""
    values = np.ascontiguousarray(values)
    if values.dtype.name == "bfloat16":
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def fill(tensor: Any, values: Any) -> None:
    """Write the numpy array ``values`` (the tensor's element count) into ``tensor``."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        target = array(tensor)
        if target.size and target.__array_interface__["data"][0] == values.__array_interface__["data"][0]:
            return  # the result is already there (in place)
        np.copyto(target, values.reshape(target.shape), casting="no")
        return
    source = tensor_of(values).reshape(tensor.shape)
    tensor.detach().copy_(source.view(torch.bool) if tensor.dtype == torch.bool else source)


def store_back(buffer: Any, tensor: Any) -> None:
    """Copy ``buffer`` (from ``host(tensor)``) into ``tensor`` unless it is ``tensor`` itself."""
    if buffer is not tensor:
        tensor.detach().copy_(buffer)


_TYPESTR: dict[Any, str] = {
    getattr(torch, name): code
    for name, code in (
        ("float32", "<f4"),
        ("float64", "<f8"),
        ("float16", "<f2"),
        ("bfloat16", "<i2"),
        ("int8", "|i1"),
        ("int16", "<i2"),
        ("int32", "<i4"),
        ("int64", "<i8"),
        ("uint8", "|u1"),
        ("uint16", "<u2"),
        ("uint32", "<u4"),
        ("uint64", "<u8"),
        ("bool", "|u1"),
        ("complex64", "<c8"),
        ("complex128", "<c16"),
    )
    if hasattr(torch, name)
}
DTYPES = frozenset(_TYPESTR)  # the dtypes the backend moves
