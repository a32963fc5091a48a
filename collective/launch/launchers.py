"""Which process this is, from the variables of the launcher that started it (for ``init()``).

The launcher's variables say which process this is (``Launched``), read from the first source
present, in this order:

====================  ===========================================  ====================================
source                rank / size (local rank)                      where the processes meet
====================  ===========================================  ====================================
collective launch     COLLECTIVE_PEER_IDS / COLLECTIVE_NUM_NODES    COLLECTIVE_GLOBAL_ADDRESS
torchrun              RANK / WORLD_SIZE (LOCAL_RANK)                MASTER_ADDR:MASTER_PORT
Open MPI (mpirun)     OMPI_COMM_WORLD_RANK / _SIZE (_LOCAL_RANK)    MASTER_ADDR:MASTER_PORT
Slurm (srun)          SLURM_PROCID / SLURM_NTASKS (SLURM_LOCALID)   MASTER_ADDR:MASTER_PORT, or the first
                                                                    host of the step (SLURM_STEP_NODELIST,
                                                                    else SLURM_JOB_NODELIST)
====================  ===========================================  ====================================

Slurm comes last: a launcher started inside a Slurm job (torchrun, mpirun in an sbatch script)
hands its processes Slurm's variables too, and its own are the ones that count.

The job's name is COLLECTIVE_JOB, else the launcher's name for this run (torchrun's run id and
restart count, Open MPI's PMIx namespace, Slurm's job and step ids), else, when rank 0 hosts the
orchestrator (which then serves this job alone), ``init-`` and its address. An orchestrator named
by COLLECTIVE_GLOBAL_ADDRESS may serve other jobs: there a job without a name is refused.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from collective.config import address_problem
from collective.errors import ConfigError

__all__ = ["Launched", "first_host", "launched_from", "reaching", "resolve"]

DEFAULT_SLURM_PORT = 29500
# where Slurm lists the hosts: the step's (srun's, where task 0 runs first), then the allocation's
_NODE_LISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


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
    master_from: str = "MASTER_ADDR"  # the variable that named the master's host (for errors)


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


def first_host(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> str:
    """The first host of a Slurm node list: "gpu[03-05,07]-ib,cpu1" -> "gpu03-ib"."""
    # the first item: up to a comma outside brackets ("a[1,3]-ib,b" -> "a[1,3]-ib")
    match = re.match(r"\s*((?:[^,\[\]\s]|\[[^\]]*\])+)", nodelist)
    if match is None:
        raise ConfigError(f"{variable}={nodelist!r} names no host: set MASTER_ADDR")
    # every bracket of the item contributes its first value: "rack[1-2]-node[3,5]" -> "rack1-node3"
    return re.sub(r"\[([^\]]*)\]", lambda ranges: ranges[1].split(",")[0].split("-")[0].strip(), match[1])


def launched_from(environ: Mapping[str, str] | None = None) -> Launched:
    """This process's rank, world and meeting point, from the first launcher whose variables are set.

    Raises ConfigError naming the variable that is missing or contradicts another, and what to set.
    """
    env = os.environ if environ is None else environ
    orchestrator = env.get("COLLECTIVE_GLOBAL_ADDRESS", "").strip() or None
    if orchestrator is not None and (problem := address_problem(orchestrator, lowest_port=1)) is not None:
        raise ConfigError(f"COLLECTIVE_GLOBAL_ADDRESS {problem}: name the orchestrator's host and port")
    job = env.get("COLLECTIVE_JOB", "").strip()
    attempt = ""  # torchrun's restart: a new job
    if env.get("COLLECTIVE_PEER_IDS", "").strip():
        return _from_collective_launch(env, orchestrator, job)
    named = "MASTER_ADDR"
    if env.get("RANK", "").strip() or env.get("WORLD_SIZE", "").strip():
        rank, world = _rank_and_world(env, "RANK", "WORLD_SIZE")
        master = _master(env)
        run = env.get("TORCHELASTIC_RUN_ID", "").strip()
        attempt = "." + (env.get("TORCHELASTIC_RESTART_COUNT", "").strip() or "0") if run else ""
        job = job or (f"{run}{attempt}" if run and run != "none" else "")
        source = "torchrun"
        local = env.get("LOCAL_RANK")
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true"
    elif env.get("OMPI_COMM_WORLD_RANK", "").strip():  # before Slurm: mpirun inside an sbatch job
        rank, world = _rank_and_world(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
        master = _master(env)
        namespace = env.get("PMIX_NAMESPACE", "").strip() or env.get("OMPI_MCA_orte_ess_jobid", "").strip()
        job = job or (f"ompi-{namespace}" if namespace else "")  # (one per mpirun)
        source, local, agent = "Open MPI", env.get("OMPI_COMM_WORLD_LOCAL_RANK"), False
    elif env.get("SLURM_PROCID", "").strip():
        rank, world = _rank_and_world(env, "SLURM_PROCID", "SLURM_NTASKS")
        listed = [name for name in _NODE_LISTS if env.get(name, "").strip()]  # the step's hosts first
        master = _master(env, first_host(env[listed[0]], listed[0]) if listed else None)
        named = (
            "MASTER_ADDR"
            if env.get("MASTER_ADDR", "").strip() or not listed
            else f"the first host of {listed[0]}"
        )
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
    if not job and orchestrator is not None:
        raise ConfigError(
            f"{source} gave rank {rank} of {world} and COLLECTIVE_GLOBAL_ADDRESS names an orchestrator, "
            f"which may serve other jobs, told apart by name, but nothing names this job: set "
            f"COLLECTIVE_JOB to a name unique to it (the same in each of its processes)"
        )
    if not job:  # rank 0's own orchestrator serves this job alone
        assert master is not None
        job = f"init-{resolve(master[0], named)}:{master[1]}{attempt}"  # (localhost and 127.0.0.1: one job)
    local_rank = int(local) if local is not None and local.strip().isdecimal() else None
    return Launched(source, rank, world, local_rank, orchestrator, master, job, agent, named)


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


def resolve(host: str, variable: str = "MASTER_ADDR") -> str:
    """``host`` as an IPv4 address (127.0.0.1 for any loopback name)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET)
    except OSError as exc:
        raise ConfigError(f"{variable}={host!r} does not resolve to an IPv4 address: {exc}") from None
    address = str(infos[0][4][0])
    return "127.0.0.1" if address.startswith("127.") else address


def reaching(host: str, variable: str = "MASTER_ADDR") -> str:
    """The address of this machine that ``host`` can reach (127.0.0.1 for a loopback one)."""
    address = resolve(host, variable)
    if address == "127.0.0.1":
        return address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))  # no packet is sent: this only picks the outgoing interface
        except OSError as exc:
            raise ConfigError(f"{variable}={host!r} cannot be reached from this machine: {exc}") from None
        return str(probe.getsockname()[0])
