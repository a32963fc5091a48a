"""The torch.distributed backend "collective": ``import collective.torch`` registers it.

```python
import torch.distributed as dist
import collective.torch  # noqa: F401  registers the backend

dist.init_process_group("collective")  # env:// (torchrun) or init_method="tcp://...", rank, world_size
dist.all_reduce(tensor)                # ... every dist.* collective, DDP, async work
dist.destroy_process_group()
```

The default group joins this process's one peer (peer id = torch's rank) through the store torch
hands its backends (``collective.launch.bootstrap.init_with_store``: rank 0 hosts an embedded orchestrator and
publishes it there), unless the default runtime already has this process's peer (``col.init()``
was called first): then the backend uses it. ``dist.new_group(ranks)`` is ``col.new_group`` of the
same global ranks. Every torch op maps onto our collectives (see docs/frameworks.md); results are
written into torch's tensors in place. CPU tensors are used as they are; CUDA tensors are staged
through host memory.

A group's calls run in the order they were issued through its ``collective.work.Sequencer``: a
blocking call in the caller's thread (after the queued ones), ``async_op=True`` (and DDP's
reducer) queued for the sequencer's worker thread, returning a ``TorchWork`` at once. Torch groups
of the same ranks share that sequencer: they are one group of ours, whose calls must come in the
order issued. Point-to-point receives queue per (source, tag) and run on the thread that waits
on them (a pair's thread once their work is asked after otherwise), so a pending ``irecv`` never
holds up a collective or a receive from elsewhere.
An all_reduce repeated on the same tensor (the same memory, shape, dtype, op and timeout: DDP's
buckets, a model's layers step after step) runs its first call kept (``Runtime.repeat``, the lean
path of persistent collectives): without its checks, view and agreement made again.
COLLECTIVE_TORCH_REPEAT=0 (or COLLECTIVE_REPEAT=0, which turns off the numpy API's kept calls too)
turns this off for the groups made after it is set.
Errors are ``torch.distributed.DistBackendError`` with our message, caused by our error; a lost
peer is one within seconds on every other rank (heartbeats), whatever torch's timeout.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from datetime import timedelta
from types import FrameType
from typing import Any

from collective.api import default_runtime
from collective.errors import CollectiveError, RegistrationError
from collective.groups import Group, new_group
from collective.launch.bootstrap import init_with_store
from collective.persistent.kept import REPEAT_VARIABLE as ALL_REPEAT
from collective.runtime import Runtime
from collective.torch.ops import Ops
from collective.torch.p2p import PointToPoint, group_key
from collective.torch.work import Receives, TorchWork, backend_error, seconds
from collective.work import Sequencer

torch: Any = importlib.import_module("torch")
dist: Any = importlib.import_module("torch.distributed")

__all__ = ["BACKEND", "REPEAT_VARIABLE", "CollectiveProcessGroup"]

BACKEND = "collective"
REPEAT_VARIABLE = "COLLECTIVE_TORCH_REPEAT"  # 0: every all_reduce is checked, viewed and agreed anew
DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default for non-NCCL groups


class CollectiveProcessGroup(Ops, PointToPoint, dist.ProcessGroup):  # type: ignore[misc]
    """A torch ProcessGroup whose collectives run on ``runtime`` as peer ``peer`` in ``group``.

    ``members`` are the global ranks (our peer ids) of the group, in group-rank order; ``owns``
    says whether this group registered the peer (and finishes it on shutdown); send and recv
    wait at most ``timeout`` seconds (torch's timeout of the group).
    """

    def __init__(
        self,
        runtime: Runtime,
        peer: int,
        members: Sequence[int],
        group: Group | None,
        owns: bool,
        timeout: float,
        call_timeout: float | None = None,
    ) -> None:
        super().__init__(list(members).index(peer), len(members))
        self.runtime = runtime
        self.peer = peer
        self.members = tuple(members)
        self.group = group
        self.timeout = timeout
        self.call_timeout = call_timeout  # a subgroup's own timeout for its collectives (None: the job's)
        self._owns = owns
        self._done = TorchWork.completed([], "blocking call")
        self.repeats = all(os.environ.get(name, "1").strip() != "0" for name in (REPEAT_VARIABLE, ALL_REPEAT))
        self._kept = {}
        self._collectives = _shared_sequencer(runtime, self.members, peer)
        self._receives = Receives(f"collective-torch-{peer}-recv")
        self._closed = False
        self._name = ""
        self.p2p_key = group_key(repr(self.members))  # until torch names the group (the same on every rank)

    def getBackendName(self) -> str:
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        """torch names every group; kept here (torch's own store of it lives in backends, which this
        group, a ProcessGroup itself, has none of: destroy_process_group(subgroup) needs it back)."""
        self._name = name
        self.p2p_key = group_key(name)

    @property
    def group_name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"<CollectiveProcessGroup peer {self.peer} of {list(self.members)}>"

    # -- life cycle ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """destroy_process_group(): the group that registered the peer finishes it. (The workers end
        by themselves once their calls have run.)"""
        with _SHARED_LOCK:
            closing, self._closed = not self._closed, True
        if closing:
            _release_sequencer(self.runtime, self.members)
        if self._owns:
            self._owns = False
            with contextlib.suppress(RegistrationError):  # already finished, or the job is gone
                self.runtime.finish(self.peer)

    def abort(self) -> None:
        self.shutdown()


_SHARED: weakref.WeakKeyDictionary[Runtime, dict[tuple[int, ...], tuple[Sequencer, int]]] = (
    weakref.WeakKeyDictionary()
)
_SHARED_LOCK = threading.Lock()


def _shared_sequencer(runtime: Runtime, members: tuple[int, ...], peer: int) -> Sequencer:
    """The sequencer of every torch group of ``members`` in this process. Torch groups of the same
    ranks are one group of ours (one order of calls), so their calls must enter it in the order
    they were issued: one sequencer, and a blocking call waits for the queued ones."""
    with _SHARED_LOCK:
        table = _SHARED.setdefault(runtime, {})
        sequencer, users = table.get(members) or (Sequencer(f"torch-{peer}"), 0)
        table[members] = (sequencer, users + 1)
        return sequencer


def _release_sequencer(runtime: Runtime, members: tuple[int, ...]) -> None:
    """One torch group of ``members`` shut down: the last one forgets the sequencer (its worker
    ends LINGER seconds after its last call)."""
    with _SHARED_LOCK:
        table = _SHARED.get(runtime, {})
        entry = table.get(members)
        if entry is not None and entry[1] > 1:
            table[members] = (entry[0], entry[1] - 1)
        elif entry is not None:
            del table[members]


def _backend_string() -> Any:
    """The BackendConfig torch creates this group for ("cpu:collective,cuda:nccl" has two backends),
    found in torch's creating frame: its creator API passes no backend string. None if not found."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(6):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return None
        config = frame.f_locals.get("backend_config")
        if config is not None and hasattr(config, "get_device_backend_map"):
            return config
    return None


def _alone_in(config: Any) -> None:
    """Refuse a group whose backend string names another backend beside ours: torch takes a Python
    ProcessGroup as the whole group, so the other would be dropped silently (CUDA tensors would
    cross host memory where NCCL was asked for)."""
    if config is None:
        return
    backends = {str(device): str(name) for device, name in config.get_device_backend_map().items()}
    others = {device: name for device, name in backends.items() if name != BACKEND}
    if others:
        named = ",".join(f"{device}:{name}" for device, name in backends.items())
        raise dist.DistBackendError(
            f"InvalidArgumentError: the backend string {named!r} pairs 'collective' with "
            f"{', '.join(sorted(set(others.values())))}: a 'collective' group serves every device "
            f"itself (CUDA tensors through host memory), so it cannot share a group with another "
            f"backend; use 'collective' alone, or another group for the other backend "
            f"(dist.new_group(backend='nccl'))"
        )


def _store_host(store: Any) -> str | None:
    """The host of the TCPStore under torch's PrefixStores, if any (where rank 0 listens)."""
    for _ in range(16):
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None


def _registered(runtime: Runtime) -> tuple[int, ...]:
    """The peers of this process registered in ``runtime`` (empty without a job)."""
    return tuple(getattr(runtime, "_peers", {})) if runtime.has_job() else ()


def _join(runtime: Runtime, store: Any, rank: int, world: int, timeout: Any) -> bool:
    """Make ``rank`` this process's peer in ``runtime``; True if it was registered here."""
    local = _registered(runtime)
    if local:
        if local != (rank,) or runtime.world_size() != world:
            raise dist.DistBackendError(
                f"RegistrationError: this process already runs peers {list(local)} of a job of "
                f"{runtime.world_size()}; init_process_group('collective') gave rank {rank} of {world}: "
                f"use one peer per process whose id is torch's rank (col.init()), or neither"
            )
        return False
    environ = dict(os.environ)
    host = _store_host(store)
    if host and not environ.get("MASTER_ADDR"):
        environ["MASTER_ADDR"] = host
    wait = seconds(timeout)
    if "COLLECTIVE_TIMEOUT" in environ and timeout == DEFAULT_TIMEOUT:
        wait = None  # torch's default timeout, and the user set ours: theirs wins
    try:
        init_with_store(runtime, store, rank, world, timeout=wait, environ=environ)
    except CollectiveError as exc:
        raise backend_error(exc) from exc
    return True


def create(options: Any, backend_options: Any = None) -> CollectiveProcessGroup:
    """torch's creator (extended API): the default group joins the job, subgroups name its peers."""
    _alone_in(_backend_string())
    runtime = default_runtime()
    rank, size = int(options.group_rank), int(options.group_size)
    global_ranks = [int(r) for r in options.global_ranks_in_group]
    wait = seconds(options.timeout) or DEFAULT_TIMEOUT.total_seconds()
    if not global_ranks or (global_ranks == list(range(size)) and not runtime.has_job()):
        owns = _join(runtime, options.store, rank, size, options.timeout)
        return CollectiveProcessGroup(runtime, rank, range(size), None, owns, wait)
    peer = global_ranks[rank]
    if peer not in _registered(runtime):
        raise dist.DistBackendError(
            f"RegistrationError: a 'collective' subgroup of ranks {global_ranks} needs this process's "
            f"peer {peer} registered: create the default group with init_process_group('collective') "
            f"(or call col.init()) first"
        )
    group = new_group(global_ranks, runtime.world_size())
    theirs = "COLLECTIVE_TIMEOUT" in os.environ and options.timeout == DEFAULT_TIMEOUT  # then the job's
    call_timeout = None if theirs else seconds(options.timeout)
    return CollectiveProcessGroup(runtime, peer, group.members, group, False, wait, call_timeout)


dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])
