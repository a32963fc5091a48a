"""Data-parallel training helpers: a gradient synchroniser with buckets and overlap, parameter broadcast.

``GradientSync`` averages gradients across peers the way torch's DDP reducer does, for any
framework's arrays (numpy, CuPy, torch, JAX through numpy):

* gradients are packed into buckets of about ``bucket_bytes`` (25 MiB), in reverse order of the
  parameters (backward produces the last layers' gradients first);
* ``ready(name, grad)`` copies one gradient into its bucket's flat buffer (one per dtype,
  allocated once, as torch's reducer keeps them); when every gradient of a bucket is ready, one
  asynchronous ``all_reduce`` per buffer starts, so communication overlaps the rest of backward.
  Buckets start in bucket order on every peer (a bucket that fills early waits for the ones
  before it), so every peer issues the same calls in the same order;
* ``wait()`` before the optimizer step runs the last bucket (full only when backward is over) in
  the caller's thread, waits for the others, writes every result into the gradients handed to
  ``ready`` (in place) and returns them by name;
* ``with sync.no_sync():`` accumulates gradients locally over micro-batches (``ready`` adds them
  up, nothing is sent); the first ``ready`` after it adds the accumulated sum and syncs once;
* ``stale=True`` double-buffers (burn's GradsSyncer): ``wait()`` returns the previous step's
  averaged gradients without waiting for this step's, so step k's sync overlaps step k+1's compute.
  The optimizer then applies gradients one step old (staleness 1): cheaper steps, slightly different
  training dynamics; the first ``wait()`` returns None.

``broadcast_parameters`` makes every peer start from the root's weights. ``attach_torch`` hooks a
torch module's parameters so backward calls ``ready`` by itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from collective.algorithms.ops import array_module
from collective.api import default_runtime
from collective.calls import AllReduce, Broadcast
from collective.ddp.checks import agree_on_settings, settings_problem, writable_params
from collective.errors import CollectiveError, CollectiveTimeout, InvalidArgumentError
from collective.groups import Group, as_group
from collective.runtime import Runtime
from collective.tensors import native
from collective.work import Work

__all__ = ["DEFAULT_BUCKET_BYTES", "GradientSync", "attach_torch", "broadcast_parameters", "torch_no_sync"]

DEFAULT_BUCKET_BYTES = 25 << 20


@dataclass
class _Bucket:
    """Some parameters' gradients, synced as one flat buffer per dtype (usually one)."""

    names: list[str]
    sends: list[Any]  # ready() copies each gradient in here ...
    recvs: list[Any]  # ... and the synced ones come back here (persistent: no allocation per step)
    views: dict[str, tuple[Any, Any]]  # name -> its views of sends and recvs, in the parameter's shape
    grads: dict[str, tuple[Any, Any, Any]] = field(default_factory=dict)  # ready() this step: (grad, its
    # view, how a result goes back to the grad's kind)
    works: list[Work] = field(default_factory=list)


def _bucket_of(names: list[str], params: Mapping[str, Any]) -> _Bucket:
    """The bucket of ``names``: one flat buffer per dtype, and each gradient's place in it."""
    places: dict[str, tuple[str, int, int, tuple[int, ...]]] = {}
    parts: dict[str, list[Any]] = {}  # dtype -> [array module, dtype, elements]
    for name in names:
        array, _ = native(params[name])
        part = parts.setdefault(str(array.dtype), [array_module(array), array.dtype, 0])
        places[name] = (str(array.dtype), part[2], part[2] + int(array.size), tuple(array.shape))
        part[2] += int(array.size)
    sends = {key: xp.empty(size, dtype) for key, (xp, dtype, size) in parts.items()}
    recvs = {key: xp.empty(size, dtype) for key, (xp, dtype, size) in parts.items()}
    views = {
        name: (sends[key][start:stop].reshape(shape), recvs[key][start:stop].reshape(shape))
        for name, (key, start, stop, shape) in places.items()
    }
    return _Bucket(names, list(sends.values()), list(recvs.values()), views)


def _nbytes(value: Any) -> int:
    array, _ = native(value)
    return int(array.nbytes)


class GradientSync:
    """Averages (by default) named gradients across the peers of ``group``, bucket by bucket.

    ``params`` maps names to arrays shaped like the gradients (the parameters themselves will do),
    in the order the model defines them. Each bucket keeps one flat buffer per dtype for the
    gradients going out and one for those coming back (twice with ``stale=True``), allocated here.
    """

    def __init__(
        self,
        peer: int,
        params: Mapping[str, Any],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        op: str = "mean",
        group: Group | None = None,
        stale: bool = False,
        runtime: Runtime | None = None,
    ) -> None:
        self.peer = peer
        self.op = op
        self.group = as_group(group)  # (a list of peer ids too)
        self.stale = stale
        self._runtime = runtime or default_runtime()
        problem = settings_problem(params, bucket_bytes, op)
        groups: list[list[str]] = []
        size = 0
        for name in reversed(list(params) if problem is None else []):  # backward: last layers first
            if not groups or size >= bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += _nbytes(params[name])
        self._buckets = [_bucket_of(names, params) for names in groups]
        self._bucket_of = {name: i for i, names in enumerate(groups) for name in names}
        self._next = 0  # the next bucket to start, in bucket order
        self._accumulating = False
        self._accumulated: dict[str, Any] = {}
        # stale=True: the step whose sync is in flight, and the buffers the next step fills meanwhile
        self._previous: list[_Bucket] | None = None
        self._spare = [_bucket_of(names, params) for names in groups] if stale else None
        self.paused = False  # attach_torch's hooks do nothing while set (torch_no_sync)
        self._inflight: list[Work] = []  # the all_reduces of a step whose wait() timed out
        agree_on_settings(self._runtime, peer, self.group, params, (bucket_bytes, op, stale), problem)

    @property
    def buckets(self) -> list[list[str]]:
        """The parameter names of each bucket, in the order buckets are started."""
        return [list(bucket.names) for bucket in self._buckets]

    def ready(self, name: str, grad: Any) -> None:
        """``grad`` (this micro-batch's gradient of ``name``) is final: sync it with its bucket.

        It is copied into the bucket's buffer at once. Raises InvalidArgumentError for a name that
        is not a parameter, a gradient whose shape or dtype is not its parameter's, or a second
        ``ready`` of one name before ``wait()``.
        """
        index = self._bucket_of.get(name)
        if index is None:
            raise InvalidArgumentError(f"ready({name!r}): not a parameter of this GradientSync")
        bucket = self._buckets[index]
        send, _ = bucket.views[name]
        self._settle()
        array, back = native(grad)
        if array.shape != send.shape or array.dtype != send.dtype:
            raise InvalidArgumentError(
                f"ready({name!r}): a gradient of shape {tuple(array.shape)} and dtype {array.dtype}, "
                f"but the parameter has shape {tuple(send.shape)} and dtype {send.dtype}"
            )
        if self._accumulating:
            self._accumulate(name, array)
            return
        if name in bucket.grads:
            raise InvalidArgumentError(f"ready({name!r}) called twice in one step: call wait() first")
        send[...] = array
        held = self._accumulated.pop(name, None)
        if held is not None:
            send += held
        bucket.grads[name] = (grad, array, back)
        self._start_ready_buckets()

    def _accumulate(self, name: str, array: Any) -> None:
        held = self._accumulated.get(name)
        if held is None:
            self._accumulated[name] = array.copy()
        else:
            held += array

    def _start_ready_buckets(self) -> None:
        # Without stale, the last bucket is left to wait(): once it is full, backward is over and
        # nothing is left to overlap it with, and the caller's thread runs it without a hand-off.
        end = len(self._buckets) - (0 if self.stale else 1)
        while self._next < end:
            bucket = self._buckets[self._next]
            if len(bucket.grads) < len(bucket.names):
                return
            bucket.works = self._reduce(bucket, async_op=True)
            self._next += 1

    def _reduce(self, bucket: _Bucket, async_op: bool, problem: str | None = None) -> list[Work]:
        """One all_reduce per buffer of ``bucket``: their Works, or [] once done (blocking). With a
        ``problem``, each fails on every peer with it (an InvalidArgumentError)."""
        works = []
        for send, recv in zip(bucket.sends, bucket.recvs, strict=True):
            call = AllReduce(send, self.op, out=recv)
            if problem is not None:
                call.refuse(problem)
            works.append(self._runtime.start(self.peer, call, self.group, None, async_op))
        return works if async_op else []

    def wait(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Every gradient of this step averaged, written into the arrays given to ``ready``, by name.

        The last bucket's all_reduce runs here, in the caller's thread (asynchronously, like the
        others, when ``timeout`` bounds the wait). With ``stale=True``: the previous step's
        averages (None at the first step), as new arrays, without waiting for this step's.
        Raises the collective's error (PeerLostError when a peer died mid-step, ...).
        """
        missing = [name for bucket in self._buckets for name in bucket.names if name not in bucket.grads]
        if missing:  # (say backward raised): the step is dropped, the next one starts clean
            self._settle()
            self._accumulated = {}  # (no_sync's micro-batches of the dropped step go with it)
            problem = (
                f"peer {self.peer} made no gradient ready for {missing[:5]}: this step is dropped (the "
                f"next one starts clean); every peer must make every gradient ready each step"
            )
            for bucket in self._buckets[self._next :]:  # the others expect these: they fail with it
                bucket.works = self._reduce(bucket, async_op=True, problem=problem)
            if self.stale:  # in step with the others: this step's error comes with the next wait()
                return self._rotate(timeout)
            for bucket in self._buckets:
                for work in bucket.works:
                    with suppress(CollectiveError):
                        work.wait()
                bucket.grads, bucket.works = {}, []
            self._next = 0
            raise InvalidArgumentError(f"wait(): {problem}")
        if self.stale:
            return self._rotate(timeout)
        current = self._buckets
        self._next = 0
        last: _Bucket | None = current[-1]
        if timeout is not None:  # a bounded wait needs Works to bound
            current[-1].works, last = self._reduce(current[-1], async_op=True), None
        return self._collect(current, timeout, in_place=True, run=last)

    def _rotate(self, timeout: float | None) -> dict[str, Any] | None:
        """stale=True: this step's all_reduces go on; the previous step's averages come back."""
        self._next = 0
        finished, self._previous = self._previous, self._buckets
        if finished is None:  # the first step: the next one fills the spare buffers
            assert self._spare is not None
            self._buckets, self._spare = self._spare, None
            return None
        self._buckets = finished
        return self._collect(finished, timeout, in_place=False)

    def _collect(
        self, buckets: list[_Bucket], timeout: float | None, in_place: bool, run: _Bucket | None = None
    ) -> dict[str, Any]:
        """Wait for each bucket (``run``: reduce it here first) and hand out its results."""
        steps = [(bucket, bucket.grads, bucket.works) for bucket in buckets]
        for bucket in buckets:  # free for the next step, whatever happens below
            bucket.grads, bucket.works = {}, []
        synced: dict[str, Any] = {}
        failed: CollectiveError | None = None
        for index, (bucket, grads, works) in enumerate(steps):
            try:
                if bucket is run:
                    self._reduce(bucket, async_op=False)
                for work in works:
                    work.wait(timeout)
            except CollectiveTimeout:  # they still own their buffers: the next step waits for them
                self._inflight = [work for _, _, later in steps[index:] for work in later]
                raise
            except CollectiveError as exc:  # the step's later calls are still made: peers stay in step
                failed = failed or exc
                self._inflight.extend(works)
            if failed is not None:
                continue
            for name, (grad, array, back) in grads.items():
                _, result = bucket.views[name]
                if in_place and array.flags.writeable:
                    array[...] = result
                    synced[name] = grad
                else:  # (stale, or a JAX gradient: immutable) a new array of the gradient's kind
                    synced[name] = back(result.copy())
        if failed is not None:
            raise failed
        return synced

    def _settle(self) -> None:
        """Wait for the all_reduces of a step whose wait() timed out (bounded by their timeout)."""
        inflight, self._inflight = self._inflight, []
        for work in inflight:
            with suppress(CollectiveError):  # (that step's error was raised to its wait())
                work.wait()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate the gradients handed to ``ready`` inside the block; sync them with the next step."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False


def broadcast_parameters(
    peer: int,
    params: Iterable[Any],
    root: int = 0,
    *,
    group: Group | None = None,
    runtime: Runtime | None = None,
) -> None:
    """Overwrite every array of ``params`` (in place) with the root's: one broadcast per dtype."""
    runtime = runtime or default_runtime()
    arrays, problem = writable_params(params)
    if problem is not None:  # refused on every peer, before any broadcast
        runtime.start(peer, Broadcast.refused(f"broadcast_parameters: {problem}"), group, None, False)
    by_dtype: dict[str, list[Any]] = {}
    for array in arrays:
        by_dtype.setdefault(str(array.dtype), []).append(array)
    for members in by_dtype.values():
        xp = array_module(members[0])
        flat = xp.concatenate([a.reshape(-1) for a in members]) if peer == root else None
        buffer = xp.empty(sum(a.size for a in members), members[0].dtype) if peer != root else None
        result = runtime.start(peer, Broadcast(flat, out=buffer), group, None, False)  # (never kept)
        offset = 0
        for array in members:
            array[...] = result[offset : offset + array.size].reshape(array.shape)
            offset += array.size


def attach_torch(module: Any, sync: GradientSync) -> list[Any]:
    """Call ``sync.ready`` from each parameter's post-accumulate-grad hook; returns the hook handles.

    The hook hands ``param.grad`` as torch left it, and nothing of ours holds a gradient between
    steps, so ``zero_grad(set_to_none=True)`` is safe. For gradient accumulation run the backward
    passes of all micro-batches but the last inside ``torch_no_sync(sync)``: torch sums
    ``param.grad`` by itself and the last backward syncs the sum.
    """
    names = {id(p): name for name, p in module.named_parameters() if p.requires_grad}
    handles = []
    for param in module.parameters():
        if id(param) in names:
            hook = partial(_hook, sync, names[id(param)])
            handles.append(param.register_post_accumulate_grad_hook(hook))
    return handles


def _hook(sync: GradientSync, name: str, param: Any) -> None:
    if not sync.paused:
        sync.ready(name, param.grad)


@contextmanager
def torch_no_sync(sync: GradientSync) -> Iterator[None]:
    """For ``attach_torch``: backward passes inside the block only accumulate (torch sums param.grad)."""
    sync.paused = True
    try:
        yield
    finally:
        sync.paused = False
