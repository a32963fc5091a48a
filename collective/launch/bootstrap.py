"""``init()``: one peer per process, the way torchrun, Slurm, mpirun and ``collective launch`` start them.

Which process this is comes from the launcher's variables (collective.launch.launchers).

COLLECTIVE_GLOBAL_ADDRESS names an orchestrator to use with any source. Without one, rank 0 hosts
an embedded orchestrator at MASTER_ADDR:MASTER_PORT and the others connect there (as torch's
TCPStore does). Under torchrun's elastic agent, which already serves a store on MASTER_PORT
(TORCHELASTIC_USE_AGENT_STORE=True), rank 0 listens on a free port instead and publishes it in
that store. Every process is one node of one peer; processes that share a host find each other
by the host identity exchanged at registration.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Protocol

from collective.config import CollectiveConfig, address_problem
from collective.errors import ConfigError, RegistrationError
from collective.launch.launchers import Launched, launched_from, reaching, resolve
from collective.runtime import Runtime
from collective.transport.orchestrator import Orchestrator

__all__ = [
    "Store",
    "config_from",
    "init",
    "init_with_store",
    "initialised",
    "meet_through_store",
    "orchestrator_threads",
]

log = logging.getLogger(__name__)


class _Embedded:
    """Rank 0's orchestrator, served from a daemon thread until its job is over or ``stop``. When
    rank 0's process ends first, it serves the ranks still running for up to ``linger`` seconds
    (they lost it at once, and said so, in runs that ended well)."""

    def __init__(self, host: str, port: int, token: str | None, linger: float) -> None:
        self.orchestrator = Orchestrator(host, port, token=token, until_done=True)  # ends with its job
        self.thread = threading.Thread(target=self._serve, name="collective-orchestrator", daemon=True)
        self.linger = linger
        atexit.register(self._at_exit)
        with _lock:
            _embedded.append(self)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.orchestrator.serve()
        finally:  # over: nothing of it stays (init/destroy cycles of torch's would pile them up)
            atexit.unregister(self._at_exit)
            with _lock:
                if self in _embedded:
                    _embedded.remove(self)

    def stop(self) -> None:
        self.orchestrator.stop()
        self.thread.join(2)

    def _at_exit(self) -> None:
        """Serve the other ranks until each left or was lost, once rank 0 finished (a rank 0 that
        did not, a crash or Ctrl-C, stops at once: the others are told it is gone)."""
        if any(runtime.has_job() for runtime in list(_joined)):
            self.stop()
            return
        started, said = time.monotonic(), False  # (said only when the others take more than a moment)
        while self.thread.is_alive() and self.orchestrator.running_besides(0):
            waited = time.monotonic() - started
            if waited >= self.linger:
                break
            if waited >= 1.0 and not said:
                log.warning(
                    "rank 0 serves the job's orchestrator to the ranks still running, %gs at most",
                    self.linger,
                )
                said = True
            self.thread.join(0.1)
        self.stop()


_lock = threading.Lock()
_initialised: weakref.WeakKeyDictionary[Runtime, int] = weakref.WeakKeyDictionary()  # runtime -> its peer
_embedded: list[_Embedded] = []
_joined: weakref.WeakSet[Runtime] = weakref.WeakSet()  # runtimes whose peer joined through init()
_PENDING = "127.0.0.1:1"  # stands for an orchestrator address not known yet while the settings are checked


def init(runtime: Runtime, device: str = "cpu", environ: Mapping[str, str] | None = None) -> int:
    """Register this process's one peer from the launcher's environment; returns its peer id (rank).

    ``device`` is the peer's device ("cpu", or "cuda:N" for CuPy arrays on GPU N, e.g. LOCAL_RANK).

    Rank 0 hosts the orchestrator unless COLLECTIVE_GLOBAL_ADDRESS names one. Other settings come
    from ``COLLECTIVE_*`` variables as in ``CollectiveConfig.from_env`` (timeout, strategies, token).
    Raises RegistrationError (``init()`` called twice, or in a process that registered thread
    peers), ConfigError (missing or contradictory variables, naming them) and what ``register``
    raises. Every setting is checked before rank 0 starts its orchestrator, and a failed ``init()``
    stops the orchestrator it started: it may be called again once the cause is fixed.
    """
    env = os.environ if environ is None else environ
    with _lock:
        if runtime in _initialised:
            finished = "" if runtime.has_job() else ", which has finished"
            raise RegistrationError(
                f"init() was already called in this process (peer {_initialised[runtime]}{finished}): a "
                f"process joins one job through init(); a new job is a new process"
            )
        if runtime.has_job():
            raise RegistrationError(
                "init() in a process whose peers were registered with register(): a process either "
                "registers its thread peers itself or calls init() once for its one peer"
            )
        _initialised[runtime] = -1  # taken: a second init() meanwhile is refused
    try:
        with _stopped_on_failure():
            launched = launched_from(env)
            _initialised[runtime] = launched.rank
            log.debug(
                "init(): rank %d of %d from %s's variables, job %r, orchestrator %s",
                launched.rank,
                launched.world,
                launched.source,
                launched.job,
                launched.orchestrator or f"hosted by rank 0 at {':'.join(map(str, launched.master or ()))}",
            )
            runtime.register(launched.rank, device, config_from(launched, env))
            _joined.add(runtime)
    except BaseException:
        with _lock:
            _initialised.pop(runtime, None)
        raise
    return launched.rank


def initialised() -> list[Runtime]:
    """The runtimes ``init()`` was called with that are still alive (one is forgotten once collected)."""
    with _lock:
        return list(_initialised)


def orchestrator_threads() -> list[threading.Thread]:
    """The threads serving the orchestrators rank 0's ``init()`` started in this process, oldest
    first; each ends (and leaves this list) once its job is over."""
    with _lock:
        return [embedded.thread for embedded in _embedded]


@contextlib.contextmanager
def _stopped_on_failure() -> Iterator[None]:
    """Stop the orchestrators started in the block if it fails: their port is free for a new try."""
    with _lock:
        before = set(_embedded)
    try:
        yield
    except BaseException:
        with _lock:
            mine = [embedded for embedded in _embedded if embedded not in before]
        for embedded in mine:
            embedded.stop()  # (it leaves the list as its thread ends)
        raise


def config_from(launched: Launched, env: Mapping[str, str]) -> CollectiveConfig:
    """The job's settings, every one checked before rank 0 starts an orchestrator (what ``init()``
    registers with; raises ConfigError naming the variables that are missing or contradict)."""
    if env.get("COLLECTIVE_NODE_ADDRESS", "").strip():  # (a machine of several networks: the one to use)
        given = env["COLLECTIVE_NODE_ADDRESS"].strip()
        host = given.rpartition(":")[0] if ":" in given else given  # (its port: 0 or the service's)
    elif launched.master is not None:
        host = reaching(launched.master[0], launched.master_from)
    else:  # the address of this machine that the named orchestrator's host reaches
        assert launched.orchestrator is not None
        host = reaching(launched.orchestrator.rpartition(":")[0], "COLLECTIVE_GLOBAL_ADDRESS")
    master = launched.master
    if launched.orchestrator is not None:
        address = launched.orchestrator
    elif master is not None and not launched.agent_store:
        address = f"{resolve(master[0], launched.master_from)}:{master[1]}"
    else:
        address = _PENDING  # published by rank 0 in the agent's store
    blank_port = not env.get("COLLECTIVE_DATA_SERVICE_PORT", "").strip()
    config = CollectiveConfig.from_env(
        env,
        num_devices=1,
        num_nodes=launched.world,
        global_address=address,
        node_address=f"{host}:0",
        job=launched.job,
        **({"data_service_port": 0} if blank_port else {}),
    )
    if launched.orchestrator is None:
        assert master is not None
        if launched.agent_store:
            return dataclasses.replace(config, global_address=_through_agent_store(launched, host, config))
        if launched.rank == 0:
            try:
                _Embedded(address.rpartition(":")[0], master[1], config.token, config.timeout)
            except RegistrationError as exc:
                cause = getattr(exc.__cause__, "errno", None)
                advice = (
                    "MASTER_ADDR is not an address of this machine: run rank 0 on MASTER_ADDR's host"
                    if cause == errno.EADDRNOTAVAIL
                    else "something listens there already (another job, or another process given RANK=0?): "
                    "pick a free MASTER_PORT, and give each process its own rank"
                )
                raise ConfigError(
                    f"rank 0 cannot host the orchestrator at MASTER_ADDR:MASTER_PORT="
                    f"{master[0]}:{master[1]}: {exc}; {advice}"
                ) from None
    return config


def _through_agent_store(launched: Launched, host: str, config: CollectiveConfig) -> str:
    """Under torchrun's agent store: rank 0 listens on a free port and publishes it in the store."""
    import importlib
    from datetime import timedelta

    store_class = importlib.import_module("torch.distributed").TCPStore  # torch is only needed here
    master_host, master_port = launched.master  # type: ignore[misc]
    store = store_class(master_host, master_port, is_master=False, timeout=timedelta(seconds=config.timeout))
    return meet_through_store(store, launched.rank, launched.job, host, config.token, config.timeout)


class Store(Protocol):
    """A key-value store every process of a job reaches (torch.distributed's stores are ones)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...  # waits until the key is set (the store's own timeout)


def meet_through_store(
    store: Store, rank: int, job: str, host: str, token: str | None, linger: float = 60.0
) -> str:
    """The orchestrator's address: rank 0 starts one on a free port of ``host`` and publishes it."""
    key = f"collective/{job}/orchestrator"
    if rank == 0:
        embedded = _Embedded(host, 0, token, linger)
        store.set(key, embedded.orchestrator.address)
    return bytes(store.get(key)).decode()


def init_with_store(
    runtime: Runtime,
    store: Store,
    rank: int,
    world: int,
    device: str = "cpu",
    timeout: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Join as peer ``rank`` of ``world``, one peer per process, meeting through ``store``.

    What ``init_process_group("collective")`` does with the store torch hands its backend. The job
    name is COLLECTIVE_JOB, else rank 0's, published in the store; the orchestrator is the
    one COLLECTIVE_GLOBAL_ADDRESS names, else rank 0 starts one and publishes its address. This
    host's address is the one that reaches the orchestrator's host, else MASTER_ADDR (127.0.0.1
    when neither is set). Raises as ``init`` does.
    """
    env = os.environ if environ is None else environ
    if runtime.has_job():
        raise RegistrationError(
            "this process already joined a job (init() or register()); join once per process"
        )
    given = env.get("COLLECTIVE_GLOBAL_ADDRESS", "").strip()
    if given and (problem := address_problem(given, lowest_port=1)) is not None:
        raise ConfigError(f"COLLECTIVE_GLOBAL_ADDRESS {problem}: name the orchestrator's host and port")
    master = env.get("MASTER_ADDR", "").strip()
    if given:
        host = reaching(given.rpartition(":")[0], "COLLECTIVE_GLOBAL_ADDRESS")
    else:
        host = reaching(master) if master else "127.0.0.1"
    named = env.get("COLLECTIVE_JOB", "").strip()
    settings = CollectiveConfig.from_env(  # every setting checked before rank 0 starts an orchestrator
        env,
        num_devices=1,
        num_nodes=world,
        global_address=_PENDING,
        node_address=f"{host}:0",
        data_service_port=0,
        job=named or "pending",
        **({"timeout": timeout} if timeout is not None else {}),
    )
    if not named and rank == 0:
        store.set("collective/job", f"store-{os.getpid()}-{time.time_ns()}")
    job = named or bytes(store.get("collective/job")).decode()
    with _stopped_on_failure():
        address = given or meet_through_store(store, rank, job, host, settings.token, settings.timeout)
        runtime.register(rank, device, dataclasses.replace(settings, global_address=address, job=job))
        _joined.add(runtime)
    return rank
