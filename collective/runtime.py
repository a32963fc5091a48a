"""Runtime: one process's side of the collective API.

A Runtime owns at most one job at a time (the peers of this process) and everything that job
started; ``reset()``/``close()`` fail every waiting peer and drop it. The module-level functions of
``collective`` use one default Runtime; tests and embedders may create their own.

Every collective takes the same road: the API method builds a call object (collective.calls), the
peer's sequencer for the group keeps its calls in order (collective.work), the group's rendezvous
agrees on the call and hands out a Step (collective.executors.rendezvous), whose executor runs it
(collective.executors). A call that comes again on the same numpy arrays runs kept, as a use of
a persistent call (collective.persistent.kept).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np

from collective import p2p
from collective.algorithms.ops import Array, ReduceOp
from collective.algorithms.strategies import Auto, Strategy, parse_strategy
from collective.arrays import Device, integer, timeout_seconds
from collective.calls import (
    CALLS,
    AllGather,
    AllGatherV,
    AllReduce,
    AllToAll,
    AllToAllV,
    Barrier,
    Broadcast,
    Gather,
    Reduce,
    ReduceScatter,
    ReduceScatterV,
    Scatter,
)
from collective.calls.base import Call
from collective.calls.coalesced import coalesced_all_reduce
from collective.config import KINDS, STRATEGY_FIELDS, CollectiveConfig
from collective.errors import (
    CollectiveError,
    ConfigError,
    InvalidArgumentError,
    JobClosedError,
    RegistrationError,
)
from collective.executors import DEFAULT_FUSE_BELOW, DEFAULT_SHARE_BELOW, explain
from collective.executors.rendezvous import Rendezvous
from collective.groups import Group, as_group
from collective.job import LocalJob, ProbeCalls
from collective.node.mailbox import Mailbox
from collective.persistent import KeptCalls, Persistents
from collective.trace import RECORDER, caller, install_signal
from collective.trace.metrics import serve_from_env as serve_metrics
from collective.tuning import Explanation
from collective.tuning.overrides import pinned
from collective.tuning.probe import intent
from collective.work import Sequencer

__all__ = ["Runtime", "default"]

Op = ReduceOp | str


class _Peer:
    """This process's record of one registered peer: its device and its road to each group."""

    def __init__(self, peer: int, device: Device, job: LocalJob) -> None:
        self.peer = peer
        self.device = device
        self.job = job  # the job this registration joined: its routes lead into it only
        self.sequencers: dict[tuple[int, ...], Sequencer] = {}
        self.routes: dict[tuple[int, ...] | None, tuple[Rendezvous, Sequencer]] = {}  # None: the whole job
        self.lock = threading.Lock()

    def route(self, members: tuple[int, ...], key: tuple[int, ...] | None) -> tuple[Rendezvous, Sequencer]:
        """The group's rendezvous and this peer's sequencer for it (found once, then kept under ``key``)."""
        found = self.routes.get(key)
        if found is None:
            with self.lock:
                sequencer = self.sequencers.setdefault(members, Sequencer(f"peer{self.peer}"))
                found = self.routes.setdefault(key, (self.job.rendezvous(members), sequencer))
        return found


class Runtime(Persistents, KeptCalls, p2p.PersistentPoints):
    """The collective API for the peers (threads) of this process. Usable as a context manager."""

    def __init__(self, fuse_below: int = DEFAULT_FUSE_BELOW, share_below: int = DEFAULT_SHARE_BELOW) -> None:
        """The in-process fast paths (collective.executors) for numpy arrays, 0 to turn one off.

        ``fuse_below``: arrays of at most this many bytes complete at the rendezvous;
        ``share_below``: arrays of at most this many bytes are combined slice by slice by all peers.
        ``Runtime(0, 0)`` runs the configured strategy for every size.
        """
        self._fuse_below = fuse_below
        self._share_below = share_below
        install_signal()  # SIGUSR1 dumps the flight recorder (where made in the main thread)
        self._lock = threading.Lock()
        self._job: LocalJob | None = None
        self._peers: dict[int, _Peer] = {}
        self._finished: set[int] = set()
        self._mailbox = Mailbox()

    # -- life cycle ---------------------------------------------------------------------------

    def register(self, peer_id: int, device: Device | str | int, config: CollectiveConfig) -> None:
        """Join ``peer_id`` to the job described by ``config``; blocks until every peer has joined.

        Raises ConfigError (not a CollectiveConfig), RegistrationError (peer outside the job,
        registered twice, a config that differs from the running job's, an unusable device) and
        CollectiveTimeout (some peers did not register within ``config.timeout``; names them).
        A refused registration changes nothing for the peers already in the job.
        """
        if not isinstance(config, CollectiveConfig):
            raise ConfigError(f"config must be a CollectiveConfig, got {type(config).__name__}")
        config = pinned(config)  # COLLECTIVE_ALGO's strategies (a bad value: ConfigError)
        serve_metrics()  # COLLECTIVE_METRICS_PORT's (a bad value: ConfigError, before joining)
        parsed = Device.parse(device)
        number = integer(peer_id)  # (a numpy integer is an id too)
        if config.is_multi_node and (number is None or number < 0):
            raise RegistrationError(
                f"peer id {peer_id!r} must be an integer >= 0 (the job's peers are 0..world-1)"
            )
        if not config.is_multi_node and (number is None or not 0 <= number < config.num_devices):
            raise RegistrationError(
                f"peer id {peer_id!r} is outside the job: with num_devices={config.num_devices} "
                f"the peers are 0..{config.num_devices - 1}"
            )
        assert number is not None
        peer_id = number
        deadline = time.monotonic() + config.timeout
        with self._lock:
            job = self._job
            created = job is None
            if job is None:
                job = self._new_job(config)
            elif job.config != config:
                raise RegistrationError(
                    f"peer {peer_id} passed a config that differs from the running job's "
                    f"({'; '.join(config.differences(job.config))}): every peer of a job passes an equal "
                    f"CollectiveConfig, and a new job starts only after every peer of the old one finished"
                )
            job.reserve(peer_id)  # raises, changing nothing, for a peer that cannot join
            if created:
                self._job = job
                self._mailbox = Mailbox()
            self._peers[peer_id] = _Peer(peer_id, parsed, job)
            self._finished.discard(peer_id)
        try:
            job.wait_joined(peer_id, deadline)
            if job.node is not None:
                job.node.join(job.peer_ids, deadline)
            job.adopt_figures(ProbeCalls(self, peer_id, job.world))
            RECORDER.joined(job.config.job, job.members, job.peer_ids, job.serial)
            install_signal()
        except CollectiveError:
            self._drop(job)  # registration failed for every waiting peer: the job is dead
            raise

    def _drop(self, job: LocalJob) -> None:
        """Forget a job whose registration failed (its waiting peers raise that failure themselves)."""
        with self._lock:
            if self._job is job:
                self._job = None
        if job.node is not None:
            job.node.close()

    def _new_job(self, config: CollectiveConfig) -> LocalJob:
        uses_auto = any(isinstance(getattr(config, name), Auto) for name in STRATEGY_FIELDS)
        wanted = intent(uses_auto)  # COLLECTIVE_PROFILE and COLLECTIVE_PROBE (tuning.probe)
        if not config.is_multi_node:
            job = LocalJob(
                config,
                config.num_devices,
                self._fuse_below,
                self._share_below,
                expected=tuple(range(config.num_devices)),
            )
        else:
            from collective.node import NodeJob

            job = LocalJob(config, config.num_devices, node=NodeJob(config, self._mailbox_of, wanted.info()))
        job.intent = wanted
        return job

    def _mailbox_of(self) -> Mailbox:
        return self._mailbox

    def finish(self, peer_id: int) -> None:
        """Leave the job once this peer's asynchronous calls have ended; the last peer to leave ends
        it. Raises RegistrationError if not registered."""
        job = self._member(peer_id)
        member = self._peers.get(peer_id)
        for _, sequencer in list(member.routes.values()) if member is not None else ():
            sequencer.wait_idle()  # (each ends by its own timeout at the latest)
        empty = job.leave(peer_id)  # checks membership under the job's lock
        with self._lock:
            self._finished.add(peer_id)
            self._peers.pop(peer_id, None)
            self._let_go(peer_id)  # (its kept calls, and the arrays and job they hold)
            if empty and self._job is job:
                self._job = None
        self._mailbox.wake()
        if job.node is not None and empty:
            job.node.close()  # the last local peer leaves: so does this node
        elif job.node is not None:
            job.node.finished(peer_id)

    def reset(self) -> None:
        """Drop the job: every peer blocked in it wakes with JobClosedError (for tests)."""
        with self._lock:
            job, self._job = self._job, None
            self._peers.clear()
            self._let_go(None)
            self._finished.clear()
        if job is not None:
            self._mailbox.close(JobClosedError("the job was reset"))
            job.close("the job was reset")

    close = reset

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.reset()

    def has_job(self) -> bool:
        """Whether peers of this process are registered in a job (or joining one)."""
        return self._job is not None

    @property
    def job(self) -> LocalJob | None:
        """The job this process's peers are registered in (or joining), None without one. For tests
        and diagnostics: the job's own attributes are not part of the API."""
        return self._job

    def waiting(self, group: Group | Sequence[int] | None = None) -> tuple[int, ...]:
        """The peers of this process whose call on ``group`` (default: the whole job) has reached the
        group's rendezvous and waits there for the other peers' calls, sorted; () without a job.

        For tests and diagnostics (which peer is the one everybody waits for). A call queued behind
        an earlier call of its peer (see ``pending``) has not reached the rendezvous yet. Raises
        InvalidArgumentError for a ``group`` that is no group.
        """
        job = self._job
        found = as_group(group)
        if job is None:
            return ()
        return job.waiting(job.members if found is None else found.members)

    def pending(self, peer_id: int, group: Group | Sequence[int] | None = None) -> int:
        """How many calls ``peer_id`` issued on ``group`` (default: the whole job) that have not
        ended: the one running, waiting for the others or not, and those queued behind it
        (asynchronous calls, and blocking calls from other threads); 0 for a peer not registered.

        For tests and diagnostics (see ``Sequencer.pending``: 0 is exact, a count taken while one of
        the calls is known to run is too). Raises InvalidArgumentError for a ``group`` that is no
        group.
        """
        found = as_group(group)
        member = self._peers.get(peer_id)
        if member is None:
            return 0
        sequencer = member.sequencers.get(member.job.members if found is None else found.members)
        return 0 if sequencer is None else sequencer.pending

    def world_size(self, group: Group | None = None) -> int:
        """The number of peers in the job (or in ``group``)."""
        group = as_group(group)
        if group is not None:
            return group.size
        job = self._job
        if job is None:
            raise RegistrationError("world_size(): no job: register a peer (or call init()) first")
        if not job.world:
            raise RegistrationError("world_size(): the job is forming: its size is known once its nodes join")
        return job.world

    def explain(
        self, kind: str, nbytes: int, group: Group | None = None, *, dtype: Any = "float32"
    ) -> Explanation:
        """What a call of ``kind`` with ``nbytes`` per peer (of ``dtype``) by ``group`` (default:
        the whole job) would run: the path, the schedule, its predicted time and every
        alternative's, and where the figures came from (collective.tuning.Explanation)."""
        job = self._job
        if job is None:
            raise RegistrationError("explain(): no job: register a peer (or call init()) first")
        if kind not in KINDS and kind != "barrier":
            raise InvalidArgumentError(
                f"explain(): unknown collective {kind!r}; use one of {', '.join(KINDS)}"
            )
        count = integer(nbytes)
        if count is None or count < 0:
            raise InvalidArgumentError(f"explain(): nbytes must be an integer >= 0, got {nbytes!r}")
        try:
            itemsize = np.dtype(dtype).itemsize
        except TypeError:
            raise InvalidArgumentError(f"explain(): {dtype!r} is not a dtype") from None
        chosen = as_group(group)
        members = job.members if chosen is None else chosen.members
        if chosen is not None:
            chosen.check_within(job.world)
        found = explain(job.site, members, CALLS[kind].strategy_kind, count, count // max(itemsize, 1))
        return replace(found, kind=kind)

    # -- collectives --------------------------------------------------------------------------

    def all_reduce(
        self,
        peer_id: int,
        x: Array,
        op: Op = "sum",
        *,
        group: Group | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        strategy: Strategy | str | None = None,
        out: Array | None = None,
    ) -> Any:
        """Combine ``x`` of every peer with ``op``; every peer gets the same bits.

        Returns a new array of ``x``'s shape and dtype, or ``out`` (which may be ``x``) filled.
        Raises RegistrationError, InvalidArgumentError, MismatchError, CollectiveTimeout,
        PeerLostError, JobClosedError (see docs/api.md).
        """
        return self._again_or_start(peer_id, AllReduce, (x, op), out, group, timeout, async_op, strategy)

    def reduce(
        self,
        peer_id: int,
        x: Array,
        op: Op = "sum",
        root: int = 0,
        *,
        group: Group | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        strategy: Strategy | str | None = None,
        out: Array | None = None,
    ) -> Any:
        """Combine ``x`` of every peer with ``op`` onto ``root``: the result there, None elsewhere."""
        return self._start(peer_id, Reduce(x, op, root, out), group, timeout, async_op, strategy)

    def broadcast(
        self,
        peer_id: int,
        x: Array | None,
        *,
        group: Group | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        strategy: Strategy | str | None = None,
        out: Array | None = None,
    ) -> Any:
        """Copy the array of the one peer that passes one (the root) to every peer.

        Other peers pass None (and optionally ``out`` to receive into). No array or several is a
        MismatchError on every peer.
        """
        return self._again_or_start(peer_id, Broadcast, (x,), out, group, timeout, async_op, strategy)

    def all_gather(
        self,
        peer_id: int,
        x: Array,
        *,
        group: Group | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        strategy: Strategy | str | None = None,
        out: Array | None = None,
    ) -> Any:
        """Every peer's ``x`` on every peer: shape (group size, *x.shape), in group-rank order."""
        return self._again_or_start(peer_id, AllGather, (x,), out, group, timeout, async_op, strategy)

    def reduce_scatter(
        self,
        peer_id: int,
        x: Array,
        op: Op = "sum",
        *,
        group: Group | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        strategy: Strategy | str | None = None,
        out: Array | None = None,
    ) -> Any:
        """``op`` over every peer's ``x`` (x.shape[0] = size*k); rank i gets rows i*k..(i+1)*k-1."""
        return self._again_or_start(peer_id, ReduceScatter, (x, op), out, group, timeout, async_op, strategy)

    def all_to_all(
        self,
        peer_id: int,
        x: Array,
        *,
        group: Group | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        strategy: Strategy | str | None = None,
        out: Array | None = None,
    ) -> Any:
        """x.shape[0] = size*k: block i of x goes to rank i; block j of the result came from rank j."""
        return self._start(peer_id, AllToAll(x, out=out), group, timeout, async_op, strategy)

    def gather(
        self,
        peer_id: int,
        x: Array,
        root: int = 0,
        *,
        group: Group | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        strategy: Strategy | str | None = None,
        out: Array | None = None,
    ) -> Any:
        """Every peer's ``x`` stacked (group size, *x.shape) on ``root``; None elsewhere."""
        return self._start(peer_id, Gather(x, root=root, out=out), group, timeout, async_op, strategy)

    def scatter(
        self,
        peer_id: int,
        x: Array | None,
        root: int = 0,
        *,
        group: Group | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        strategy: Strategy | str | None = None,
        out: Array | None = None,
    ) -> Any:
        """The root passes (group size, ...); rank i gets row i. The other peers pass None."""
        return self._start(peer_id, Scatter(x, root=root, out=out), group, timeout, async_op, strategy)

    def all_gather_v(
        self,
        peer_id: int,
        x: Array,
        *,
        recv_sizes: Sequence[int] | None = None,
        group: Group | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        strategy: Strategy | str | None = None,
        out: Array | None = None,
    ) -> Any:
        """Every peer's ``x`` on every peer, a list in group-rank order; x.shape[0] may differ between
        peers (the rest of the shape and the dtype agree). ``out``: one array of every peer's rows.
        ``recv_sizes``: the rows expected from each rank, checked (on every peer) before data moves."""
        return self._start(
            peer_id, AllGatherV(x, out=out, recv_sizes=recv_sizes), group, timeout, async_op, strategy
        )

    def reduce_scatter_v(
        self,
        peer_id: int,
        x: Array,
        sizes: Sequence[int],
        op: Op = "sum",
        *,
        group: Group | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        strategy: Strategy | str | None = None,
        out: Array | None = None,
    ) -> Any:
        """``op`` over every peer's ``x``; rank i gets block i, its ``sizes[i]`` rows (every peer passes
        the same ``sizes``, summing to x.shape[0])."""
        return self._start(peer_id, ReduceScatterV(x, sizes, op, out=out), group, timeout, async_op, strategy)

    def all_to_all_v(
        self,
        peer_id: int,
        x: Array,
        send_sizes: Sequence[int],
        *,
        recv_sizes: Sequence[int] | None = None,
        group: Group | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        strategy: Strategy | str | None = None,
        out: Array | None = None,
    ) -> Any:
        """Rows of ``x``, ``send_sizes[j]`` of them for rank j in rank order, go to rank j; a list back,
        in source rank order, of the rows each peer sent this one. ``out``: one array of them all.
        ``recv_sizes``: the rows expected from each rank, checked (on every peer) before data moves."""
        call = AllToAllV(x, send_sizes, out=out, recv_sizes=recv_sizes)
        return self._start(peer_id, call, group, timeout, async_op, strategy)

    def barrier(
        self,
        peer_id: int,
        *,
        group: Group | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        strategy: Strategy | str | None = None,
    ) -> Any:
        """Return once every peer of the group has entered the barrier."""
        return self._again_or_start(peer_id, Barrier, (), None, group, timeout, async_op, strategy)

    def all_reduce_coalesced(
        self,
        peer_id: int,
        xs: Sequence[Array],
        op: Op = "sum",
        *,
        group: Group | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        strategy: Strategy | str | None = None,
        out: Sequence[Array] | None = None,
    ) -> Any:
        """One all_reduce over many arrays (one agreement, one schedule per dtype): a list back."""
        member, (rendezvous, sequencer), seconds, problem = self._road(peer_id, group, timeout)

        origin = caller(2) if RECORDER.enabled else None

        def execute(call: Call) -> Any:
            call.origin = origin
            named = _name_strategy(call, strategy) if strategy is not None else None
            if (named or problem) is not None:
                call.refuse(named or problem)  # type: ignore[arg-type]
            return rendezvous.run(member.peer, member.device, seconds, call)

        label = "all_reduce_coalesced"
        if async_op:
            return sequencer.submit(partial(coalesced_all_reduce, xs, op, out, execute), label)
        return sequencer.call(coalesced_all_reduce, label, xs, op, out, execute)

    # -- point to point -------------------------------------------------------------------------

    def send(self, peer_id: int, x: Array, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Hand ``x`` (copied) to peer ``dst``; returns at once, whether or not ``dst`` is receiving.
        ``timeout`` is checked like every call's (a send never waits, so it bounds nothing)."""
        job, member = self._member(peer_id), self._peer(peer_id)
        if timeout is not None:
            timeout_seconds(timeout)
        frame = caller(2) if RECORDER.enabled else None
        sent = partial(p2p.send, job, self._mailbox, peer_id, member.device, x, dst, tag)
        p2p.traced("send", peer_id, peer_id, integer(dst) or 0, integer(tag) or 0, frame, sent, lambda _: x)

    def recv(
        self, peer_id: int, src: int, tag: int = 0, *, timeout: float | None = None, out: Array | None = None
    ) -> Array:
        """The next array ``src`` sent to this peer with ``tag`` (its shape and dtype, or into ``out``)."""
        return self._receive(peer_id, src, tag, timeout, out)[1]

    def recv_any(
        self, peer_id: int, tag: int = 0, *, timeout: float | None = None, out: Array | None = None
    ) -> tuple[int, Array]:
        """(the sender, the array) of the next message to this peer with ``tag`` from any peer: the
        earliest to arrive."""
        return self._receive(peer_id, None, tag, timeout, out)

    def _receive(
        self, peer_id: int, src: int | None, tag: int, timeout: float | None, out: Array | None
    ) -> tuple[int, Array]:
        job, member = self._member(peer_id), self._peer(peer_id)
        seconds = job.config.timeout if timeout is None else timeout_seconds(timeout)
        frame = caller(3) if RECORDER.enabled else None
        source = -1 if src is None else integer(src) or 0
        taken = partial(p2p.recv, job, self._mailbox, peer_id, member.device, src, tag, seconds, out)
        return p2p.traced(
            "recv", peer_id, source, peer_id, integer(tag) or 0, frame, taken, lambda got: got[1]
        )

    # -- the one road ---------------------------------------------------------------------------

    def start(
        self,
        peer_id: int,
        call: Call,
        group: Group | None,
        timeout: float | None,
        async_op: bool,
        strategy: Strategy | str | None = None,
    ) -> Any:
        """Run any call object (the road of every collective; a refused call fails on every peer).

        ``strategy``: the schedule this call runs with ("auto", "ring", Tree(4), ...), over the
        config's and COLLECTIVE_ALGO's; every peer of the group must name the same."""
        return self._start(peer_id, call, group, timeout, async_op, strategy)

    def _start(
        self,
        peer_id: int,
        call: Call,
        group: Group | None,
        timeout: float | None,
        async_op: bool,
        strategy: Strategy | str | None,
    ) -> Any:
        """``start``, called from one of this class's methods, or by ``start`` for its caller: the
        caller's frame is 2 up from here, in both (a direct ``sys._getframe`` makes no frame object
        of the frames between, which costs a call of the recorder's time less)."""
        member, (rendezvous, sequencer), seconds, problem = self._road(peer_id, group, timeout)
        if RECORDER.enabled:
            call.origin = caller(3)
        if strategy is not None:
            problem = _name_strategy(call, strategy) or problem
        if problem is not None:
            call.refuse(problem)
        if async_op:
            return sequencer.submit(
                partial(rendezvous.run, member.peer, member.device, seconds, call), call.kind
            )
        return sequencer.call(rendezvous.run, call.kind, member.peer, member.device, seconds, call)

    def _road(
        self, peer_id: int, group: Any, timeout: float | None
    ) -> tuple[_Peer, tuple[Rendezvous, Sequencer], float, str | None]:
        """This peer, its road to the group (rendezvous, sequencer), the call's timeout, and a problem
        with it: a bad ``timeout`` fails the call on every peer (the config's bounds that step).
        ``group`` is a Group or a list of peer ids (as ``new_group`` takes); a bad one, or a group
        without this peer, is an InvalidArgumentError here (it names no group to fail a step of)."""
        job = self._job
        member = self._peers.get(peer_id)
        if job is None or member is None:
            job = self._member(peer_id)  # raise the precise RegistrationError
            member = self._peer(peer_id)
        job = member.job  # (the job this peer's registration joined, whatever another thread did since)
        group = as_group(group)
        if group is None:
            route = member.routes.get(None) or member.route(job.members, None)
        else:
            group.check_within(job.world)
            group.rank(peer_id)  # raises for a peer outside the group
            route = member.routes.get(group.members) or member.route(group.members, group.members)
        if timeout is None:
            return member, route, job.config.timeout, None
        try:
            return member, route, timeout_seconds(timeout), None
        except InvalidArgumentError as exc:
            return member, route, job.config.timeout, str(exc)

    def _member(self, peer_id: int) -> LocalJob:
        job = self._job  # read without the lock: the job's own checks are authoritative
        if job is None:
            with self._lock:
                finished = peer_id in self._finished
            if finished:
                raise RegistrationError(f"peer {peer_id!r} has finished: call register() to start a new job")
            raise RegistrationError(f"peer {peer_id!r} is not registered: call register() first")
        return job

    def __reduce__(self) -> tuple[Any, ...]:
        """The default runtime pickles as the default runtime of the process that loads it (the
        module's functions are its bound methods: they travel as Ray sends a task's); no other."""
        if _DEFAULT and self is _DEFAULT[0]:
            return (default, ())
        raise TypeError("a Runtime holds its job's threads and sockets: only default_runtime() pickles")

    def _peer(self, peer_id: int) -> _Peer:
        member = self._peers.get(peer_id)
        if member is None:
            job = self._member(peer_id)
            with job.guard:
                job.check_member(peer_id)  # raises the precise RegistrationError
            raise RegistrationError(f"peer {peer_id!r} is not registered: call register() first")
        return member


_DEFAULT: list[Runtime] = []  # this process's default runtime, once made (``default``)


def default() -> Runtime:
    """This process's default Runtime: the module-level API's (made on first use)."""
    if not _DEFAULT:
        _DEFAULT.append(Runtime())
    return _DEFAULT[0]


def _name_strategy(call: Call, strategy: Any) -> str | None:
    """Set the strategy ``call`` names; why it names none (a bad strategy fails it on every peer)."""
    try:
        call.strategy = str(parse_strategy(strategy))
    except ConfigError as exc:
        return f"strategy: {exc}"
    return None
