"""``init()``: one peer per process, the way torchrun, Slurm, mpirun and ``collective launch`` start them.

The launcher's variables say which process this is (``Launched``), read from the first source
present, in this order:

====================  ===========================================  ====================================
source                rank / size (local rank)                      where the processes meet
====================  ===========================================  ====================================
collective launch     COLLECTIVE_PEER_IDS / COLLECTIVE_NUM_NODES    COLLECTIVE_GLOBAL_ADDRESS
torchrun              RANK / WORLD_SIZE (LOCAL_RANK)                MASTER_ADDR:MASTER_PORT
Open MPI (mpirun)     OMPI_COMM_WORLD_RANK / _SIZE (_LOCAL_RANK)    MASTER_ADDR:MASTER_PORT
Slurm (srun)          SLURM_PROCID / SLURM_NTASKS (SLURM_LOCALID)   MASTER_ADDR:MASTER_PORT, or the first
                                                                    host of SLURM_JOB_NODELIST
====================  ===========================================  ====================================

Slurm comes last: a launcher started inside a Slurm job (torchrun, mpirun in an sbatch script)
hands its processes Slurm's variables too, and its own are the ones that count.

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
import logging
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from collective.config import CollectiveConfig
from collective.errors import ConfigError, RegistrationError
from collective.runtime import Runtime
from collective.transport.orchestrator import Orchestrator

__all__ = ["Launched", "Store", "init", "init_with_store", "launched_from", "meet_through_store"]

log = logging.getLogger(__name__)

DEFAULT_SLURM_PORT = 29500


@dataclass(frozen=True)
class Launched:
    """What the launcher told this process."""

    source: str  # "collective launch", "torchrun", "Slurm", "Open MPI"
    rank: int
    world: int
    local_rank: int | None
    orchestrator: str | None  # an orchestrator to use ("host:port"), or None: rank 0 hosts one
    master: tuple[str, int] | None  # where rank 0 hosts it
    job: str
    agent_store: bool = False  # torchrun's agent serves a store on the master port


def _int(environ: Mapping[str, str], name: str, what: str, minimum: int = 0) -> int:
    text = environ.get(name, "").strip()
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not {what}: set it to an integer >= {minimum}") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} is not {what}: it must be >= {minimum}")
    return value


def _rank_and_world(environ: Mapping[str, str], rank_name: str, world_name: str) -> tuple[int, int]:
    missing = [name for name in (rank_name, world_name) if not environ.get(name, "").strip()]
    if missing:
        raise ConfigError(
            f"{' and '.join(missing)} not set: the launcher sets both {rank_name} and {world_name}"
        )
    rank = _int(environ, rank_name, "a rank")
    world = _int(environ, world_name, "a process count", minimum=1)
    if rank >= world:
        raise ConfigError(f"{rank_name}={rank} contradicts {world_name}={world}: ranks are 0..{world - 1}")
    return rank, world


def _master(environ: Mapping[str, str], fallback_host: str | None = None) -> tuple[str, int] | None:
    host = environ.get("MASTER_ADDR", "").strip() or fallback_host
    port_text = environ.get("MASTER_PORT", "").strip()
    if host is None:
        return None
    if not port_text:
        if fallback_host is not None and not environ.get("MASTER_ADDR", "").strip():
            return host, DEFAULT_SLURM_PORT
        raise ConfigError(
            f"MASTER_ADDR={host!r} is set but MASTER_PORT is not: set MASTER_PORT to a free port"
        )
    port = _int(environ, "MASTER_PORT", "a port", minimum=1)
    if port > 65535:
        raise ConfigError(f"MASTER_PORT={port} is not a port (1..65535)")
    return host, port


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[03-05,07]-ib,cpu1" -> "gpu03-ib"."""
    # the first item: up to a comma outside brackets ("a[1,3]-ib,b" -> "a[1,3]-ib")
    match = re.match(r"\s*((?:[^,\[\]\s]|\[[^\]]*\])+)", nodelist)
    if match is None:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} names no host: set MASTER_ADDR")
    # every bracket of the item contributes its first value: "rack[1-2]-node[3,5]" -> "rack1-node3"
    return re.sub(r"\[([^\]]*)\]", lambda ranges: ranges[1].split(",")[0].split("-")[0].strip(), match[1])


def launched_from(environ: Mapping[str, str] | None = None) -> Launched:
    """This process's rank, world and meeting point, from the first launcher whose variables are set.

    Raises ConfigError naming the variable that is missing or contradicts another, and what to set.
    """
    env = os.environ if environ is None else environ
    orchestrator = env.get("COLLECTIVE_GLOBAL_ADDRESS", "").strip() or None
    job = env.get("COLLECTIVE_JOB", "").strip()
    if env.get("COLLECTIVE_PEER_IDS", "").strip():
        return _from_collective_launch(env, orchestrator, job)
    if env.get("RANK", "").strip() or env.get("WORLD_SIZE", "").strip():
        rank, world = _rank_and_world(env, "RANK", "WORLD_SIZE")
        master = _master(env)
        run = env.get("TORCHELASTIC_RUN_ID", "").strip()
        job = job or (run if run and run != "none" else "")
        source = "torchrun"
        local = env.get("LOCAL_RANK")
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true"
    elif env.get("OMPI_COMM_WORLD_RANK", "").strip():  # before Slurm: mpirun inside an sbatch job
        rank, world = _rank_and_world(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
        master = _master(env)
        source, local, agent = "Open MPI", env.get("OMPI_COMM_WORLD_LOCAL_RANK"), False
    elif env.get("SLURM_PROCID", "").strip():
        rank, world = _rank_and_world(env, "SLURM_PROCID", "SLURM_NTASKS")
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        master = _master(env, first_host(nodes) if nodes else None)
        slurm_job = env.get("SLURM_JOB_ID", "").strip()
        job = job or (f"slurm-{slurm_job}.{env.get('SLURM_STEP_ID', '0')}" if slurm_job else "")
        source, local, agent = "Slurm", env.get("SLURM_LOCALID"), False
    else:
        raise ConfigError(
            "init() found no launcher variables: start the processes with collective launch, torchrun, "
            "srun or mpirun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    if orchestrator is None and master is None:
        raise ConfigError(
            f"{source} gave rank {rank} of {world} but no meeting point: set MASTER_ADDR and MASTER_PORT "
            f"(rank 0 hosts the orchestrator there), or COLLECTIVE_GLOBAL_ADDRESS"
        )
    if not job:
        where = orchestrator or f"{master[0]}:{master[1]}"  # type: ignore[index]
        job = f"init-{where}"
    local_rank = int(local) if local is not None and local.strip().isdecimal() else None
    return Launched(source, rank, world, local_rank, orchestrator, master, job, agent)


def _from_collective_launch(env: Mapping[str, str], orchestrator: str | None, job: str) -> Launched:
    ids = env["COLLECTIVE_PEER_IDS"].split(",")
    devices = env.get("COLLECTIVE_NUM_DEVICES", "1").strip() or "1"
    if len(ids) != 1 or devices != "1":
        raise ConfigError(
            f"init() runs one peer per process, but this process was given COLLECTIVE_PEER_IDS="
            f"{env['COLLECTIVE_PEER_IDS']!r} (COLLECTIVE_NUM_DEVICES={devices}): launch with --devices 1, or "
            f"register() each thread peer yourself"
        )
    rank = _int(env, "COLLECTIVE_PEER_IDS", "a peer id")
    world = _int(env, "COLLECTIVE_NUM_NODES", "a process count", minimum=1)
    if rank >= world:
        raise ConfigError(f"COLLECTIVE_PEER_IDS={rank} contradicts COLLECTIVE_NUM_NODES={world}")
    if orchestrator is None:
        raise ConfigError(
            "COLLECTIVE_PEER_IDS is set but COLLECTIVE_GLOBAL_ADDRESS is not: name the orchestrator"
        )
    return Launched("collective launch", rank, world, None, orchestrator, None, job or "default")


def _resolve(host: str, variable: str = "MASTER_ADDR") -> str:
    """``host`` as an IPv4 address (127.0.0.1 for any loopback name)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET)
    except OSError as exc:
        raise ConfigError(f"{variable}={host!r} does not resolve to an IPv4 address: {exc}") from None
    address = str(infos[0][4][0])
    return "127.0.0.1" if address.startswith("127.") else address


def _reaching(host: str, variable: str = "MASTER_ADDR") -> str:
    """The address of this machine that ``host`` can reach (127.0.0.1 for a loopback one)."""
    address = _resolve(host, variable)
    if address == "127.0.0.1":
        return address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))  # no packet is sent: this only picks the outgoing interface
        except OSError as exc:
            raise ConfigError(f"{variable}={host!r} cannot be reached from this machine: {exc}") from None
        return str(probe.getsockname()[0])


class _Embedded:
    """Rank 0's orchestrator, served from a daemon thread until its job is over, the process exits
    or ``stop``."""

    def __init__(self, host: str, port: int, token: str | None) -> None:
        self.orchestrator = Orchestrator(host, port, token=token, until_done=True)  # ends with its job
        self.thread = threading.Thread(target=self._serve, name="collective-orchestrator", daemon=True)
        atexit.register(self.stop)
        with _lock:
            _embedded.append(self)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.orchestrator.serve()
        finally:  # over: nothing of it stays (init/destroy cycles of torch's would pile them up)
            atexit.unregister(self.stop)
            with _lock:
                if self in _embedded:
                    _embedded.remove(self)

    def stop(self) -> None:
        self.orchestrator.stop()
        self.thread.join(2)


_lock = threading.Lock()
_initialised: weakref.WeakKeyDictionary[Runtime, int] = weakref.WeakKeyDictionary()  # runtime -> its peer
_embedded: list[_Embedded] = []
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
                launched.rank, launched.world, launched.source, launched.job,
                launched.orchestrator or f"hosted by rank 0 at {':'.join(map(str, launched.master or ()))}",
            )  # fmt: skip
            runtime.register(launched.rank, device, _config(launched, env))
    except BaseException:
        with _lock:
            _initialised.pop(runtime, None)
        raise
    return launched.rank


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


def _config(launched: Launched, env: Mapping[str, str]) -> CollectiveConfig:
    """The job's settings, every one checked before rank 0 starts an orchestrator."""
    if launched.master is not None:
        host = _reaching(launched.master[0])
    elif env.get("COLLECTIVE_NODE_ADDRESS", "").strip():
        host = env["COLLECTIVE_NODE_ADDRESS"].strip().rpartition(":")[0] or "127.0.0.1"
    else:  # the address of this machine that the named orchestrator's host reaches
        assert launched.orchestrator is not None
        host = _reaching(launched.orchestrator.rpartition(":")[0], "COLLECTIVE_GLOBAL_ADDRESS")
    master = launched.master
    if launched.orchestrator is not None:
        address = launched.orchestrator
    elif master is not None and not launched.agent_store:
        address = f"{_resolve(master[0])}:{master[1]}"
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
                _Embedded(address.rpartition(":")[0], master[1], config.token)
            except RegistrationError as exc:
                raise ConfigError(
                    f"rank 0 cannot host the orchestrator at MASTER_ADDR:MASTER_PORT="
                    f"{master[0]}:{master[1]}: {exc}; pick a free MASTER_PORT"
                ) from None
    return config


def _through_agent_store(launched: Launched, host: str, config: CollectiveConfig) -> str:
    """Under torchrun's agent store: rank 0 listens on a free port and publishes it in the store."""
    import importlib
    from datetime import timedelta

    store_class = importlib.import_module("torch.distributed").TCPStore  # torch is only needed here
    master_host, master_port = launched.master  # type: ignore[misc]
    store = store_class(master_host, master_port, is_master=False, timeout=timedelta(seconds=config.timeout))
    return meet_through_store(store, launched.rank, launched.job, host, config.token)


class Store(Protocol):
    """A key-value store every process of a job reaches (torch.distributed's stores are ones)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...  # waits until the key is set (the store's own timeout)


def meet_through_store(store: Store, rank: int, job: str, host: str, token: str | None) -> str:
    """The orchestrator's address: rank 0 starts one on a free port of ``host`` and publishes it."""
    key = f"collective/{job}/orchestrator"
    if rank == 0:
        embedded = _Embedded(host, 0, token)
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
    name is rank 0's, published in the store; this host's address is the one that reaches
    MASTER_ADDR (127.0.0.1 when it is unset). Raises as ``init`` does.
    """
    env = os.environ if environ is None else environ
    if runtime.has_job():
        raise RegistrationError(
            "this process already joined a job (init() or register()); join once per process"
        )
    master = env.get("MASTER_ADDR", "").strip()
    host = _reaching(master) if master else "127.0.0.1"
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
    if rank == 0:
        store.set("collective/job", named or f"store-{os.getpid()}-{time.time_ns()}")
    job = bytes(store.get("collective/job")).decode()
    with _stopped_on_failure():
        address = meet_through_store(store, rank, job, host, settings.token)
        runtime.register(rank, device, dataclasses.replace(settings, global_address=address, job=job))
    return rank
