"""Every torch.distributed op of the "collective" backend, mapped onto our collectives.

The methods carry torch's ProcessGroup names and arguments (``allreduce(tensors, opts)``, ...);
``collective.torch.CollectiveProcessGroup`` mixes them into its ProcessGroup. Each builds a
``body`` that calls the runtime with this process's peer and group on numpy views of torch's
tensors (results land in the output tensors' memory) and hands it to ``launch``: run now for a
blocking call, which returns the group's one completed work (torch only waits on it), or queued
for ``async_op`` (and DDP), which returns a new ``TorchWork``.

=============================  =====================================================
torch                           ours
=============================  =====================================================
allreduce (SUM AVG PRODUCT      all_reduce (sum mean prod min max band bor bxor;
MIN MAX BAND BOR BXOR           PREMUL_SUM: the input times the factor, then sum;
PREMUL_SUM)                     bool: BOR/SUM/MAX as max, BAND/PRODUCT/MIN as min,
                                BXOR as bxor of its bytes)
allreduce_coalesced             all_reduce_coalesced
broadcast, reduce               broadcast (the root passes the tensor), reduce
allgather, all_gather_single    all_gather (stacked, into the outputs); tensors of different
                                sizes: all_gather_v
reduce_scatter(_single)         reduce_scatter; a list of different sizes: reduce_scatter_v
all_to_all_single, alltoall     all_to_all; uneven splits: all_to_all_v
gather, scatter, barrier        gather, scatter, barrier
send, recv                      send (eager), recv (collective.torch.p2p)
=============================  =====================================================
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from collective.calls import (
    AllGather,
    AllGatherV,
    AllReduce,
    AllToAll,
    Barrier,
    Broadcast,
    Coalesced,
    Gather,
    Reduce,
    ReduceScatter,
    Scatter,
)
from collective.errors import CollectiveError, InvalidArgumentError, MismatchError
from collective.groups import Group
from collective.runtime import Runtime
from collective.torch.checks import (
    PREMUL_SUM,
    invalid,
    kind_of,
    on_every_rank,
    op_name,
    reduce_op,
    short_form,
    single,
    writable_tensor,
)
from collective.torch.work import (
    Receives,
    TorchWork,
    array,
    backend_error,
    fill,
    host,
    seconds,
    store_back,
    viewable,
)
from collective.trace import RECORDER, caller, run_for
from collective.work import Sequencer

torch: Any = importlib.import_module("torch")
dist: Any = importlib.import_module("torch.distributed")
c10d: Any = importlib.import_module("torch._C._distributed_c10d")  # (options dist does not export)

__all__ = ["KEPT_CALLS", "Ops"]

KEPT_CALLS = 256  # all_reduces a group keeps to run again (Ops.allreduce): the oldest goes first
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors whose all_reduces may be kept


class Ops:
    """torch's ProcessGroup ops over ``runtime`` as ``peer`` in ``group`` (None: the whole job)."""

    runtime: Runtime
    peer: int
    group: Group | None
    members: tuple[int, ...]
    call_timeout: float | None
    repeats: bool  # whether an all_reduce repeated on the same tensor runs its kept call again
    _kept: dict[tuple[Any, ...], AllReduce]  # those calls, by _kept_key
    _collectives: Sequencer
    _receives: Receives
    _done: TorchWork

    # -- the one road -----------------------------------------------------------------------

    def launch(
        self,
        label: str,
        body: Callable[[], None],
        outputs: Sequence[Any],
        opts: Any,
        receive: tuple[int, int] | None = None,
    ) -> TorchWork:
        """Run ``body`` now (a blocking call) or queued (``opts.asyncOp``); a TorchWork either way.
        A receive (from (source, tag)) is queued with that pair's, any other call on the group's."""
        if RECORDER.enabled and (receive is not None or getattr(opts, "asyncOp", True)):
            body = partial(run_for, caller(2), body)  # (run by a worker: recorded as called from here)
        if receive is not None:
            work = TorchWork(outputs, label)
            work.drive = self._receives.submit(receive, partial(work.run, body))
            return work
        if getattr(opts, "asyncOp", True):
            work = TorchWork(outputs, label)
            self._collectives.enqueue(partial(work.run, body))
            return work
        try:
            self._collectives.call(body, label)
        except CollectiveError as exc:
            raise backend_error(exc) from exc
        return self._done

    def peer_of(self, group_rank: int) -> int:
        """The peer id (global rank) of ``group_rank``."""
        if not 0 <= group_rank < len(self.members):
            raise invalid(f"rank {group_rank} is not a rank of this group (0..{len(self.members) - 1})")
        return self.members[group_rank]

    def _kw(self, opts: Any) -> dict[str, Any]:
        return {"group": self.group, "timeout": seconds(getattr(opts, "timeout", None)) or self.call_timeout}

    def _anew(self, call: Any, kw: dict[str, Any]) -> None:
        """Run ``call`` on views made for this call alone (``start``: never kept by the runtime)."""
        self.runtime.start(self.peer, call, kw["group"], kw["timeout"], False)

    def _reduction(
        self,
        tensor: Any,
        opts: Any,
        what: str,
        run: Callable[[Any, Any, str], None],
        kept: Callable[[Any, str], bool] | None = None,
    ) -> TorchWork:
        """all_reduce / reduce of one tensor: ``run(source, buffer, op)`` writes the result in buffer.
        Where ``kept`` is given and the op has no factor, ``kept(tensor, op)`` runs first, as the
        body does: True when it ran the call itself (kept, on a view of the tensor's memory then)."""
        op, factor = reduce_op(opts.reduceOp, tensor.dtype)
        writable_tensor(tensor, what)

        def body() -> None:
            if kept is not None and factor is None and kept(tensor, op):
                return
            buffer = host(tensor)
            values = array(buffer)
            run(values if factor is None else _scaled(values, factor), values, op)
            store_back(buffer, tensor)

        return self.launch(what, body, [tensor], opts)

    # -- reductions ---------------------------------------------------------------------------

    def allreduce(self, tensors: Sequence[Any], opts: Any = None) -> TorchWork:
        """An all_reduce of a tensor this group all-reduced before, on the same memory with the same
        layout, dtype, op and timeout, runs its kept call again (Runtime.repeat: the checks and
        the agreement are the first call's); anything else is checked and run anew."""
        key = _kept_key(tensors, opts) if self.repeats else None
        call = self._kept.get(key) if key is not None else None
        if key is None or call is None:
            return self._allreduce(tensors, opts, key=key)
        return self.launch("all_reduce", partial(self._again, tensors[0], opts, key, call), tensors, opts)

    def _again(self, tensor: Any, opts: Any, key: tuple[Any, ...], call: AllReduce) -> None:
        """A kept all_reduce's use, as its body runs: kept where the tensor is still on the memory it
        was found by (a queued call's tensor may have moved since: ``set_``, ``.data =``), else
        made anew on its memory now."""
        timeout = seconds(opts.timeout) or self.call_timeout
        if _kept_key([tensor], opts) == key:
            self.runtime.repeat(self.peer, call, self.group, timeout)
            return
        buffer = host(tensor)
        values = array(buffer)
        self.runtime.start(self.peer, AllReduce(values, call.op_arg, out=values), self.group, timeout, False)
        store_back(buffer, tensor)

    @on_every_rank(AllReduce)
    def _allreduce(self, tensors: Sequence[Any], opts: Any, key: tuple[Any, ...] | None) -> TorchWork:
        tensors, opts = short_form(tensors, opts, dist.AllreduceOptions, ("reduceOp", opts))
        if single(tensors, "all_reduce").layout is torch.sparse_coo:
            return self._sparse_allreduce(tensors[0], opts)
        group, timeout = self.group, seconds(opts.timeout) or self.call_timeout

        def run(source: Any, out: Any, op: str) -> None:  # (start: views made anew, never kept)
            self.runtime.start(self.peer, AllReduce(source, op, out=out), group, timeout, False)

        def kept(tensor: Any, op: str) -> bool:
            now = _kept_key([tensor], opts)  # (as the body runs: the memory its view is made of)
            if now is None:
                return False
            view = array(tensor, hold=False)
            call = AllReduce(view, op, out=view)
            self.runtime.repeat(self.peer, call, group, timeout)
            if now not in self._kept and len(self._kept) >= KEPT_CALLS:  # (bodies run one at a time)
                del self._kept[next(iter(self._kept))]  # (the oldest kept)
            self._kept[now] = call
            return True

        keeps = kept if key is not None else None
        return self._reduction(single(tensors, "all_reduce"), opts, "all_reduce", run, keeps)

    def _sparse_allreduce(self, tensor: Any, opts: Any) -> TorchWork:
        """A COO tensor's sum over the ranks, as gloo does it: every rank's indices and values
        gathered (two all_gather_v), then coalesced, the same way on every rank (the same bits);
        the result replaces the tensor's contents."""
        if getattr(opts.reduceOp, "op", opts.reduceOp) != dist.ReduceOp.SUM:
            raise invalid(f"all_reduce of a sparse tensor: only ReduceOp.SUM, got {op_name(opts.reduceOp)}")
        kw = self._kw(opts)

        def body() -> None:
            local = tensor.detach().coalesce()
            indices = local.indices().t().contiguous()  # (nnz, sparse dims)
            values = local.values().contiguous()  # (nnz, *dense dims)
            every_index = self.runtime.all_gather_v(self.peer, array(indices), **kw)
            every_value = self.runtime.all_gather_v(self.peer, array(values), **kw)
            found = torch.from_numpy(np.concatenate(every_index)).t()
            summed = torch.from_numpy(np.concatenate(every_value)).to(values.dtype)
            total = torch.sparse_coo_tensor(found, summed, tensor.shape).coalesce()
            with torch.no_grad():
                tensor.copy_(total)

        return self.launch("all_reduce", body, [tensor], opts)

    @on_every_rank(Reduce)
    def reduce(self, tensors: Sequence[Any], opts: Any = None, op: Any = None) -> TorchWork:
        fields = ("rootRank", opts), ("reduceOp", op)  # (the short form: pg.reduce(t, root, op))
        tensors, opts = short_form(tensors, opts, dist.ReduceOptions, *fields)
        root, kw = self.peer_of(opts.rootRank), self._kw(opts)

        def run(source: Any, out: Any, op: str) -> None:
            self.runtime.reduce(self.peer, source, op, root, out=out, **kw)

        return self._reduction(single(tensors, "reduce"), opts, "reduce", run)

    @on_every_rank(Coalesced)
    def allreduce_coalesced(self, tensors: Sequence[Any], opts: Any = None) -> TorchWork:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        tensors = list(tensors)
        ops = {reduce_op(opts.reduceOp, t.dtype) for t in tensors} or {("sum", None)}
        if len(ops) > 1:  # bool takes SUM as max, PRODUCT as min: one list, one op (gloo: one dtype)
            raise invalid(
                f"all_reduce_coalesced: the list mixes bool tensors with others, which ReduceOp."
                f"{op_name(opts.reduceOp)} reduces differently: pass the bool tensors in a call of their own"
            )
        op, factor = ops.pop()
        kw = self._kw(opts)

        def body() -> None:
            buffers = [host(t) for t in tensors]
            views = [array(b) for b in buffers]
            sources = views if factor is None else [_scaled(v, factor) for v in views]
            self.runtime.all_reduce_coalesced(self.peer, sources, op, out=views, **kw)
            for buffer, tensor in zip(buffers, tensors, strict=True):
                store_back(buffer, tensor)

        return self.launch("all_reduce_coalesced", body, tensors, opts)

    @on_every_rank(ReduceScatter)
    def reduce_scatter(self, outputs: Sequence[Any], inputs: Sequence[Any], opts: Any = None) -> TorchWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        output = single(outputs, "reduce_scatter")
        parts, me = list(single(inputs, "reduce_scatter")), self.members.index(self.peer)
        if len(parts) != len(self.members) or parts[me].shape != output.shape:
            raise invalid(
                f"reduce_scatter takes {len(self.members)} input tensors, this rank's ({me}) of the "
                f"output's shape {tuple(output.shape)}, got {[tuple(p.shape) for p in parts]}"
            )
        op, factor = reduce_op(opts.reduceOp, output.dtype)
        kw = self._kw(opts)
        sizes = [p.numel() for p in parts]

        def body() -> None:
            if all(part.shape == output.shape for part in parts):
                source = np.stack([array(host(p)) for p in parts])
                source = source if factor is None else _scaled(source, factor)
                result = self.runtime.reduce_scatter(self.peer, source, op, **kw)
            else:  # uneven (as gloo takes it): reduce_scatter_v of the flattened parts (the sizes agreed)
                source = np.concatenate([array(host(p)).reshape(-1) for p in parts])
                source = source if factor is None else _scaled(source, factor)
                result = self.runtime.reduce_scatter_v(self.peer, source, sizes, op, **kw)
            fill(output, result.reshape(output.shape))

        return self.launch("reduce_scatter", body, [output], opts)

    @on_every_rank(ReduceScatter)
    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> TorchWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        size = len(self.members)
        if input.numel() != size * output.numel():
            raise invalid(
                f"reduce_scatter_tensor: the input has {input.numel()} elements, the output "
                f"{output.numel()}: the input holds {size} x the output's"
            )
        op, factor = reduce_op(opts.reduceOp, output.dtype)
        kw = self._kw(opts)

        def body() -> None:
            source = array(host(input)).reshape(size, -1)
            source = source if factor is None else _scaled(source, factor)
            buffer = host(output)
            if np.may_share_memory(source, array(buffer)):  # in place: the output is a block of the input
                source = source.copy()
            self._anew(ReduceScatter(source, op, out=array(buffer).reshape(1, -1)), kw)
            store_back(buffer, output)

        return self.launch("reduce_scatter_tensor", body, [output], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(
        self, outputs: Sequence[Any], inputs: Sequence[Any], opts: Any = None
    ) -> TorchWork:
        pairs = zip(outputs, inputs, strict=True)
        works = _each([partial(self.reduce_scatter_single, o, i, opts) for o, i in pairs])
        return self._joined("reduce_scatter_tensor_coalesced", works, outputs, opts)

    # -- copies -------------------------------------------------------------------------------

    @on_every_rank(Broadcast)
    def broadcast(self, tensors: Sequence[Any], opts: Any = None) -> TorchWork:
        tensors, opts = short_form(tensors, opts, dist.BroadcastOptions, ("rootRank", opts))
        tensor = single(tensors, "broadcast")
        writable_tensor(tensor, "broadcast")
        is_root, kw = self.peer_of(opts.rootRank) == self.peer, self._kw(opts)

        def body() -> None:
            buffer = host(tensor)
            values = array(buffer)
            self._anew(Broadcast(values if is_root else None, out=values), kw)
            store_back(buffer, tensor)

        return self.launch("broadcast", body, [tensor], opts)

    @on_every_rank(AllGather)
    def allgather(self, outputs: Sequence[Any], inputs: Sequence[Any], opts: Any = None) -> TorchWork:
        if isinstance(inputs, torch.Tensor):  # (the short form: pg.allgather([out, ...], t))
            outputs, inputs = [outputs], [inputs]
        inputs, opts = short_form(inputs, opts, c10d.AllgatherOptions)
        tensor = single(inputs, "all_gather")
        targets = list(single(outputs, "all_gather"))
        me = self.members.index(self.peer)
        if len(targets) != len(self.members) or targets[me].numel() != tensor.numel():
            raise invalid(
                f"all_gather takes a list of {len(self.members)} output tensors, this rank's ({me}) of the "
                f"input's size {tensor.numel()}, got {[tuple(t.shape) for t in targets]}"
            )
        kw = self._kw(opts)

        def body() -> None:
            if all(t.shape == tensor.shape for t in targets):
                gathered = self.runtime.all_gather(self.peer, array(host(tensor)), **kw)
            else:  # uneven: all_gather_v of the flattened tensors, each rank's size checked everywhere
                flat, sizes = array(host(tensor)).reshape(-1), [t.numel() for t in targets]
                gathered = self.runtime.all_gather_v(self.peer, flat, recv_sizes=sizes, **kw)
            for row, target in zip(gathered, targets, strict=True):
                fill(target, row.reshape(target.shape))

        return self.launch("all_gather", body, targets, opts)

    @on_every_rank(AllGather)
    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> TorchWork:
        opts = opts if opts is not None else dist.AllgatherOptions()
        size = len(self.members)
        if output.numel() != size * input.numel():
            raise invalid(
                f"all_gather_into_tensor: the output has {output.numel()} elements, the input "
                f"{input.numel()}: the output holds {size} x the input's"
            )
        kw = self._kw(opts)

        def body() -> None:
            buffer = host(output)
            out = array(buffer).reshape(size, *input.shape)
            source = array(host(input))
            if np.may_share_memory(source, out):  # in place: the input is this rank's block of the output
                source = source.copy()
            self._anew(AllGather(source, out=out), kw)
            store_back(buffer, output)

        return self.launch("all_gather_into_tensor", body, [output], opts)

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(
        self, outputs: Sequence[Any], inputs: Sequence[Any], opts: Any = None
    ) -> TorchWork:
        pairs = zip(outputs, inputs, strict=True)
        works = _each([partial(self.all_gather_single, o, i, opts) for o, i in pairs])
        return self._joined("allgather_into_tensor_coalesced", works, outputs, opts)

    @on_every_rank(AllGatherV)
    def allgather_coalesced(
        self, outputs: Sequence[Sequence[Any]], inputs: Sequence[Any], opts: Any = None
    ) -> TorchWork:
        """torch's ``outputs[r][j]``: rank r's tensor j. One all_gather_v of every input flattened
        into one array (each rank's size checked on every rank), split into the outputs."""
        opts = opts if opts is not None else dist.AllgatherOptions()
        inputs, lists = list(inputs), [list(o) for o in outputs]
        if not inputs or len(lists) != len(self.members) or any(len(o) != len(inputs) for o in lists):
            raise invalid(
                f"all_gather_coalesced takes {len(self.members)} output lists (one per rank) of "
                f"{len(inputs)} tensors (one per input), got lists of {[len(o) for o in lists]}"
            )
        kw = self._kw(opts)

        def body() -> None:
            flat = np.concatenate([array(host(t)).reshape(-1) for t in inputs])
            sizes = [sum(t.numel() for t in targets) for targets in lists]
            pieces = self.runtime.all_gather_v(self.peer, flat, recv_sizes=sizes, **kw)
            for piece, targets in zip(pieces, lists, strict=True):
                at = 0
                for target in targets:
                    fill(target, piece[at : at + target.numel()].reshape(target.shape))
                    at += target.numel()

        return self.launch("all_gather_coalesced", body, [t for o in lists for t in o], opts)

    def _joined(self, label: str, works: list[TorchWork], outputs: Sequence[Any], opts: Any) -> TorchWork:
        """One work for several queued ones: done after all of them, failed with the first error
        (each is a step of its own: the others still run, so the group stays in step)."""

        def body() -> None:
            for work in works:
                work.wait()

        return self.launch(label, body, outputs, opts) if works else self._done

    # -- exchanges: even splits are one all_to_all; uneven ones one all_to_all_v (what each rank
    # expects checked against what the others send, on every rank, before data moves; no padding)

    @on_every_rank(AllToAll)
    def all_to_all_single(
        self,
        output: Any,
        input: Any,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        opts: Any = None,
    ) -> TorchWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        size, kw = len(self.members), self._kw(opts)
        even = not output_splits and not input_splits
        if even and (input.shape != output.shape or (input.dim() and input.shape[0] % size)):
            raise invalid(
                f"all_to_all_single: input {tuple(input.shape)} and output {tuple(output.shape)} must have "
                f"one shape whose first dimension divides by {size} (or pass split sizes)"
            )
        for name, splits, tensor in (("input", input_splits, input), ("output", output_splits, output)):
            rows = tensor.shape[0] if tensor.dim() else 1
            if splits and (len(splits) != size or any(s < 0 for s in splits) or sum(splits) != rows):
                raise invalid(
                    f"all_to_all_single: {name}_split_sizes {list(splits)} must be {size} sizes >= 0 adding "
                    f"up to the {name}'s first dimension, {rows}"
                )
            if not even and not splits and rows % size:
                raise invalid(
                    f"all_to_all_single: without {name}_split_sizes the {name}'s first dimension ({rows}) "
                    f"must divide by {size}"
                )

        def body() -> None:
            buffer = host(output)
            source, out = array(host(input)), array(buffer)
            if even:
                self.runtime.all_to_all(self.peer, source.reshape(size, -1), out=out.reshape(size, -1), **kw)
            else:
                sent = list(input_splits) or [source.shape[0] // size] * size
                expected = list(output_splits) or [out.shape[0] // size] * size
                rows, into = (
                    (source, out) if source.ndim else (source.reshape(1), out.reshape(1))
                )  # (0-d: a row)
                self.runtime.all_to_all_v(self.peer, rows, sent, recv_sizes=expected, out=into, **kw)
            store_back(buffer, output)

        return self.launch("all_to_all_single", body, [output], opts)

    alltoall_base = all_to_all_single

    @on_every_rank(AllToAll)
    def alltoall(self, outputs: Sequence[Any], inputs: Sequence[Any], opts: Any = None) -> TorchWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        outputs, inputs, kw = list(outputs), list(inputs), self._kw(opts)
        if len(outputs) != len(self.members) or len(inputs) != len(self.members):
            raise invalid(f"all_to_all takes {len(self.members)} input and output tensors each")

        def body() -> None:
            flat = np.concatenate([array(host(t)).reshape(-1) for t in inputs])
            sent, expected = [t.numel() for t in inputs], [t.numel() for t in outputs]
            blocks = self.runtime.all_to_all_v(self.peer, flat, sent, recv_sizes=expected, **kw)
            for block, target in zip(blocks, outputs, strict=True):
                fill(target, block.reshape(target.shape))

        return self.launch("all_to_all", body, outputs, opts)

    @on_every_rank(Gather)
    def gather(self, outputs: Sequence[Any], inputs: Sequence[Any], opts: Any = None) -> TorchWork:
        opts = opts if opts is not None else dist.GatherOptions()
        tensor = single(inputs, "gather")
        root, kw = self.peer_of(opts.rootRank), self._kw(opts)
        targets = list(single(outputs, "gather")) if root == self.peer else []
        if root == self.peer and len(targets) != len(self.members):
            raise invalid(f"gather: the root passes {len(self.members)} output tensors, got {len(targets)}")

        def body() -> None:
            gathered = self.runtime.gather(self.peer, array(host(tensor)), root, **kw)
            for row, target in zip(gathered if gathered is not None else [], targets, strict=False):
                fill(target, row)

        return self.launch("gather", body, targets, opts)

    @on_every_rank(Scatter)
    def scatter(self, outputs: Sequence[Any], inputs: Sequence[Any], opts: Any = None) -> TorchWork:
        opts = opts if opts is not None else dist.ScatterOptions()
        output = single(outputs, "scatter")
        root, kw = self.peer_of(opts.rootRank), self._kw(opts)
        parts = list(single(inputs, "scatter")) if root == self.peer else []
        if root == self.peer and (
            len(parts) != len(self.members) or any(p.shape != output.shape for p in parts)
        ):
            shapes = [tuple(p.shape) for p in parts]
            raise invalid(
                f"scatter: the root passes {len(self.members)} input tensors of the output's shape "
                f"{tuple(output.shape)}, got {shapes}"
            )

        def body() -> None:
            stacked = np.stack([array(host(p)) for p in parts]) if parts else None
            buffer = host(output)
            self.runtime.scatter(self.peer, stacked, root, out=array(buffer), **kw)
            store_back(buffer, output)

        return self.launch("scatter", body, [output], opts)

    @on_every_rank(Barrier)
    def barrier(self, opts: Any = None) -> TorchWork:
        opts = opts if opts is not None else dist.BarrierOptions()
        kw = self._kw(opts)
        return self.launch("barrier", lambda: self.runtime.barrier(self.peer, **kw), [], opts)


def _each(calls: list[Callable[[], TorchWork]]) -> list[TorchWork]:
    """The works of every call, each a step of the group, issued even after one failed on every
    rank for its arguments (a refused or mismatched step: the others' next steps must meet this
    rank's); then the first error is raised. A timeout or a lost peer is raised at once."""
    works, first = [], None
    for call in calls:
        try:
            works.append(call())
        except dist.DistBackendError as exc:
            if not isinstance(exc.__cause__, InvalidArgumentError | MismatchError):
                raise
            first = first or exc
    if first is not None:
        raise first
    return works


def _kept_key(tensors: Any, opts: Any) -> tuple[Any, ...] | None:
    """What the kept call of an all_reduce is found by: its tensor's address, shape and dtype, its
    op and timeout. None for a call never kept: a short form or a list of several, a tensor that
    is not a plain (or Parameter) contiguous dense CPU one numpy views as it is (the call runs on
    a copy; a subclass's memory may be elsewhere), PREMUL_SUM (its factor is read each call)."""
    if type(tensors) is not list or len(tensors) != 1 or opts is None or not hasattr(opts, "timeout"):
        return None
    tensor = tensors[0]
    if type(tensor) not in _PLAIN or tensor.layout is not torch.strided:
        return None
    if not tensor.is_cpu or not tensor.is_contiguous() or not viewable(tensor):
        return None
    kind = kind_of(opts.reduceOp)
    if kind == PREMUL_SUM:
        return None
    return (tensor.data_ptr(), tensor.shape, tensor.dtype, kind, opts.timeout)


def _scaled(values: Any, factor: Any) -> Any:
    """PREMUL_SUM's input: ``values`` times the factor (a number or a one-element tensor), same dtype."""
    return (values * (factor.item() if hasattr(factor, "item") else factor)).astype(values.dtype, copy=False)
