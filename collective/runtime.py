"""Runtime: one process's side of the collective API, over the in-process server.

A Runtime owns at most one job at a time (the peers of this process) and everything that job
started; ``reset()``/``close()`` fail every waiting peer and drop it. The module-level
functions of ``collective`` use one default Runtime; tests and embedders may create their own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from collective.algorithms import strategies
from collective.algorithms.ops import Array, ReduceOp
from collective.arrays import Device, as_array, check_array, check_out, flat, new_result, scale_for_mean
from collective.calls import CallSpec
from collective.config import CollectiveConfig
from collective.errors import (
    CollectiveError,
    CollectiveTimeout,
    ConfigError,
    InvalidArgumentError,
    PeerLostError,
    RegistrationError,
)
from collective.fastpath import DEFAULT_FUSE_BELOW, DEFAULT_SHARE_BELOW
from collective.node import NodeJob, PeerCall, run_three_phases
from collective.server import LocalJob, Plan
from collective.transport.inproc import InProcessLink

__all__ = ["Runtime"]


def _parse_op(op: Any) -> tuple[ReduceOp | None, str | None]:
    try:
        return ReduceOp.parse(op), None
    except InvalidArgumentError as exc:
        return None, str(exc)


def _shape_dtype(array: Any, problem: str | None) -> tuple[tuple[int, ...] | None, Any]:
    if problem is not None or array is None:
        return None, None
    return tuple(array.shape), array.dtype


class Runtime:
    """The collective API for the peers (threads) of this process. Usable as a context manager."""

    def __init__(self, fuse_below: int = DEFAULT_FUSE_BELOW, share_below: int = DEFAULT_SHARE_BELOW) -> None:
        """The in-process fast paths (collective.fastpath) for numpy arrays, 0 to turn one off.

        ``fuse_below``: arrays of at most this many bytes complete at the rendezvous;
        ``share_below``: arrays of at most this many bytes are combined slice by slice by all peers.
        ``Runtime(0, 0)`` runs the configured strategy for every size.
        """
        self._fuse_below = fuse_below
        self._share_below = share_below
        self._lock = threading.Lock()
        self._job: LocalJob | None = None
        self._devices: dict[int, Device] = {}
        self._finished: set[int] = set()

    # -- life cycle ---------------------------------------------------------------------------

    def register(self, peer_id: int, device: Device | str | int, config: CollectiveConfig) -> None:
        """Join ``peer_id`` to the job described by ``config``; blocks until every peer has joined.

        Raises ConfigError (not a CollectiveConfig), RegistrationError (peer outside the job,
        registered twice, a config that differs from the running job's) and CollectiveTimeout
        (some peers did not register within ``config.timeout``; names them).
        """
        if not isinstance(config, CollectiveConfig):
            raise ConfigError(f"config must be a CollectiveConfig, got {type(config).__name__}")
        parsed = Device.parse(device)
        valid_id = isinstance(peer_id, int) and not isinstance(peer_id, bool) and peer_id >= 0
        if config.is_multi_node and not valid_id:
            raise RegistrationError(
                f"peer id {peer_id!r} must be an integer >= 0 (the job's peers are 0..world-1)"
            )
        if not config.is_multi_node and (not valid_id or peer_id >= config.num_devices):
            raise RegistrationError(
                f"peer id {peer_id!r} is outside the job: with num_devices={config.num_devices} "
                f"the peers are 0..{config.num_devices - 1}"
            )
        deadline = time.monotonic() + config.timeout
        with self._lock:
            job = self._job
            if job is None:
                job = self._job = self._new_job(config)
            elif job.config != config:
                raise RegistrationError(
                    f"peer {peer_id} passed a config that differs from the running job's "
                    f"({'; '.join(config.differences(job.config))}): every peer of a job passes an equal "
                    f"CollectiveConfig, and a new job starts only after every peer of the old one finished"
                )
            self._devices[peer_id] = parsed
            self._finished.discard(peer_id)
        try:
            job.join(peer_id, deadline)
            if job.node is not None:
                job.node.join(job.peer_ids, deadline)
        except CollectiveTimeout:
            self._drop(job)  # registration failed for every waiting peer: the job is dead
            raise
        except CollectiveError:
            if job.active:  # the local peers joined but the node could not join the global job
                self._drop(job)
            raise

    def _drop(self, job: LocalJob) -> None:
        """Forget a job whose registration failed (its waiting peers raise that failure themselves)."""
        with self._lock:
            if self._job is job:
                self._job = None
        if job.node is not None:
            job.node.close()

    def _new_job(self, config: CollectiveConfig) -> LocalJob:
        if not config.is_multi_node:
            return LocalJob(
                config,
                config.num_devices,
                self._fuse_below,
                expected=tuple(range(config.num_devices)),
                share_below=self._share_below,
            )
        job = LocalJob(config, config.num_devices, fuse_below=0, report_errors=True)
        job.node = NodeJob(config)
        return job

    def finish(self, peer_id: int) -> None:
        """Leave the job; the last peer to leave ends it. Raises RegistrationError if not registered."""
        job = self._member(peer_id)
        empty = job.leave(peer_id)  # checks membership under the job's lock
        with self._lock:
            self._finished.add(peer_id)
            if empty and self._job is job:
                self._job = None
        if empty and job.node is not None:
            job.node.close()  # the last local peer leaves: so does this node

    def reset(self) -> None:
        """Drop the job: every peer blocked in it wakes with JobClosedError (for tests)."""
        with self._lock:
            job, self._job = self._job, None
            self._devices.clear()
            self._finished.clear()
        if job is not None:
            job.close("the job was reset")

    close = reset

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.reset()

    # -- collectives --------------------------------------------------------------------------

    def all_reduce(
        self, peer_id: int, x: Array, op: ReduceOp | str = "sum", *, out: Array | None = None
    ) -> Array:
        """Combine ``x`` of every peer with ``op``; every peer gets the same bits.

        Returns a new array of ``x``'s shape and dtype, or ``out`` (which may be ``x``) filled.
        Raises RegistrationError, InvalidArgumentError, MismatchError, CollectiveTimeout,
        PeerLostError, JobClosedError (see docs/api.md).
        """
        job, device = self._member_device(peer_id)
        x = as_array(x)
        reduce_op, problem = _parse_op(op)
        problem = problem or check_array(x, device, reduce_op)
        if problem is None and out is not None:
            problem = check_out(out, device, tuple(x.shape), x.dtype, x)
        spec = CallSpec("all_reduce", reduce_op, None, *_shape_dtype(x, problem), error=problem)
        plan, src, deadline = self._meet(job, peer_id, spec, None if problem else x)
        if job.node is not None:
            mine = PeerCall(peer_id, plan, src, device, x.shape, x.dtype, out, deadline)
            result = self._three_phases(job, mine)
        elif plan.result is not None:
            result = self._copy_fused(job, peer_id, plan.result, device, x.shape, x.dtype, out)
        elif plan.shared is not None:
            result = new_result(device, x.shape, x.dtype, out)
            self._run_shared(job, peer_id, plan, result, deadline)
        else:
            with self._running(job, peer_id, plan, deadline) as link:
                result = new_result(device, x.shape, x.dtype, out)
                strategy = job.config.local_all_reduce_strategy
                strategies.all_reduce(strategy, link, src, flat(result), plan.call.op)  # type: ignore[arg-type]
                link.flush()
        if plan.call.op is ReduceOp.MEAN:
            scale_for_mean(result, job.world)
        return result

    def reduce(
        self, peer_id: int, x: Array, op: ReduceOp | str = "sum", root: int = 0, *, out: Array | None = None
    ) -> Array | None:
        """Combine ``x`` of every peer with ``op`` onto ``root``: the result there, None elsewhere.

        ``out`` (used on the root only) receives the result instead of a new array.
        Raises as all_reduce does.
        """
        job, device = self._member_device(peer_id)
        x = as_array(x)
        reduce_op, problem = _parse_op(op)
        problem = problem or check_array(x, device, reduce_op)
        if problem is None and not job.is_peer(root):
            problem = f"root {root!r} is not a peer of this job (peers 0..{job.world - 1})"
        if problem is None and out is not None and peer_id == root:
            problem = check_out(out, device, tuple(x.shape), x.dtype, x)
        spec = CallSpec("reduce", reduce_op, root, *_shape_dtype(x, problem), error=problem)
        plan, src, deadline = self._meet(job, peer_id, spec, None if problem else x)
        on_root = peer_id == root
        if job.node is not None:
            mine = PeerCall(peer_id, plan, src, device, x.shape, x.dtype, out if on_root else None, deadline)
            result = self._three_phases(job, mine)
        elif plan.result is not None:
            result = self._copy_fused(job, peer_id, plan.result, device, x.shape, x.dtype, out, on_root)
        elif plan.shared is not None:
            result = new_result(device, x.shape, x.dtype, out) if on_root else None
            self._run_shared(job, peer_id, plan, result, deadline)
        else:
            with self._running(job, peer_id, plan, deadline) as link:
                result = new_result(device, x.shape, x.dtype, out) if on_root else None
                target = None if result is None else flat(result)
                strategy = job.config.local_reduce_strategy
                strategies.reduce(strategy, link, job.index[root], src, target, plan.call.op)  # type: ignore[arg-type]
                link.flush()
        if result is not None and plan.call.op is ReduceOp.MEAN:
            scale_for_mean(result, job.world)
        return result

    def broadcast(self, peer_id: int, x: Array | None, *, out: Array | None = None) -> Array:
        """Copy the array of the one peer that passes one (the root) to every peer.

        Other peers pass None (and optionally ``out`` to receive into). Every peer, the root
        included, gets a new array (or ``out``). No array or several -> MismatchError everywhere.
        Raises as all_reduce does.
        """
        job, device = self._member_device(peer_id)
        x = as_array(x)
        problem = None if x is None else check_array(x, device, None)
        described = x
        if problem is None and out is not None:
            if x is not None:
                problem = check_out(out, device, tuple(x.shape), x.dtype, x)
            else:
                problem = check_out(out, device, tuple(out.shape), out.dtype, None)
                described = out
        spec = CallSpec("broadcast", None, None, *_shape_dtype(described, problem), x is not None, problem)
        plan, src, deadline = self._meet(job, peer_id, spec, None if problem else x)
        if job.node is not None:
            multi = self._three_phases(job, PeerCall(peer_id, plan, src, device, None, None, out, deadline))
            assert multi is not None
            return multi
        call = plan.call
        assert call.root is not None and call.shape is not None
        if plan.result is not None:
            if out is not None and out is x:  # an in-place root already holds the data
                job.done(peer_id)
                return out
            fused = self._copy_fused(job, peer_id, plan.result, device, call.shape, call.dtype, out)
            assert fused is not None
            return fused
        if plan.shared is not None:
            shared_result = new_result(device, call.shape, call.dtype, out)
            self._run_shared(job, peer_id, plan, None if shared_result is x else shared_result, deadline)
            return shared_result
        with self._running(job, peer_id, plan, deadline) as link:
            result = new_result(device, call.shape, call.dtype, out)
            source = src if src is not None else flat(result)
            strategies.broadcast(job.config.local_broadcast_strategy, link, job.index[call.root], source)
            if src is not None and result is not x:
                flat(result)[...] = src
            link.flush()
        return result

    # -- helpers ------------------------------------------------------------------------------

    def _member(self, peer_id: int) -> LocalJob:
        job = self._job  # read without the lock: the job's own checks are authoritative
        if job is None:
            with self._lock:
                finished = peer_id in self._finished
            if finished:
                raise RegistrationError(f"peer {peer_id!r} has finished: call register() to start a new job")
            raise RegistrationError(f"peer {peer_id!r} is not registered: call register() first")
        return job

    def _member_device(self, peer_id: int) -> tuple[LocalJob, Device]:
        job = self._member(peer_id)
        device = self._devices.get(peer_id)
        if device is None:
            job.check_member(peer_id)  # raises the precise RegistrationError
            raise RegistrationError(f"peer {peer_id!r} is not registered: call register() first")
        return job, device

    def _meet(
        self, job: LocalJob, peer_id: int, spec: CallSpec, data: Array | None
    ) -> tuple[Plan, Array, float]:
        """Start the deadline and meet the other peers: (the plan, this peer's flat input, the deadline)."""
        deadline = time.monotonic() + job.config.timeout
        src = None if data is None else flat(data)
        return job.rendezvous(peer_id, spec, src, deadline), src, deadline

    def _three_phases(self, job: LocalJob, mine: PeerCall) -> Array | None:
        """A multi-node collective on this peer (collective.node); failures reach every local peer."""
        assert job.node is not None
        with self._running(job, mine.peer, mine.plan, mine.deadline):
            return run_three_phases(job.node, job, mine)

    def _run_shared(
        self, job: LocalJob, peer_id: int, plan: Plan, result: Array | None, deadline: float
    ) -> None:
        """This peer's part of a shared-path collective; ``result`` (if any) receives the outcome."""
        work, exchange = plan.shared, plan.exchange
        assert work is not None and exchange is not None
        index = job.index[peer_id]
        with self._running(job, peer_id, plan, deadline):
            if work.call.kind == "broadcast":  # copy the root's array, then let the root go
                if result is not None:
                    flat(result)[...] = work.inputs[job.index[work.call.root]]  # type: ignore[index]
                exchange.barrier(index, deadline)
                return
            work.combine_slice(index)
            exchange.barrier(index, deadline)
            if result is not None:
                flat(result)[...] = work.result

    def _copy_fused(
        self,
        job: LocalJob,
        peer_id: int,
        fused: Array,
        device: Device,
        shape: tuple[int, ...],
        dtype: Any,
        out: Array | None,
        wanted: bool = True,
    ) -> Array | None:
        """This peer's copy of a result the rendezvous computed (no other peer waits on it)."""
        try:
            if not wanted:
                return None
            result = new_result(device, tuple(shape), dtype, out)
            result.reshape(-1)[...] = fused
            return result
        finally:
            job.done(peer_id)

    @contextmanager
    def _running(self, job: LocalJob, peer_id: int, plan: Plan, deadline: float) -> Iterator[InProcessLink]:
        """A link for this peer's part of ``plan``; a failure here fails the collective for all peers.

        A plan the rendezvous already computed (``plan.result``) has no exchange: its link is unusable.
        """
        exchange = plan.exchange
        try:
            yield InProcessLink(exchange, job.index[peer_id], deadline)  # type: ignore[arg-type]
        except CollectiveError:
            raise
        except BaseException as exc:
            if exchange is not None:
                exchange.abort(PeerLostError(f"{plan.label}: peer {peer_id} failed: {exc!r}", [peer_id]))
            raise
        finally:
            job.done(peer_id)
