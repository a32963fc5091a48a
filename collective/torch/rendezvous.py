"""torchrun's agents meet through a running ``collective orchestrator``: ``--rdzv-backend collective``.

```bash
COLLECTIVE_TOKEN=... collective orchestrator --host 0.0.0.0 --port 29400 &      # once, anywhere
COLLECTIVE_TOKEN=... torchrun --nnodes 1:4 --nproc-per-node 2 --max-restarts 3 \\
    --rdzv-backend collective --rdzv-endpoint HOST:29400 --rdzv-id JOB train.py   # on each node
```

torchrun finds this handler by its entry point (group ``torchrun.handlers``, installed with the
package). It is torch's own dynamic rendezvous, the one behind ``--rdzv-backend c10d``, with its
state kept in a key-value store on the orchestrator (transport.kv.store) instead of a TCPStore one
agent hosts: elastic ``min:max`` nodes, late joiners, restarts and lost agents work as they do
there, but the meeting point is a service of its own, not a host of the job that dies with it,
and it admits only holders of ``COLLECTIVE_TOKEN`` (the agents' environment). ``--rdzv-conf``
takes c10d's keys (``join_timeout``, ``last_call_timeout``, ``close_timeout``,
``heartbeat_timeout``, ``keep_alive_interval``, ``keep_alive_max_attempt``) and ``read_timeout``
(seconds a store request may take, default 60).

Each round of the rendezvous, the agents tell their workers (through the environment the workers
inherit) where the orchestrator is (``COLLECTIVE_GLOBAL_ADDRESS``, unless set already) and the
name of their job there (``COLLECTIVE_JOB``: the one given, or ``torchrun-RUN_ID``, then the
round's number), so ``col.init()`` and ``init_process_group("collective")`` in the workers meet
through it too, a restart being a new job; nothing else serves as a meeting point.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from collective.transport.kv.client import StoreClient, StoreError

dist: Any = importlib.import_module("torch.distributed")
_api: Any = importlib.import_module("torch.distributed.elastic.rendezvous.api")
_dynamic: Any = importlib.import_module("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
_c10d: Any = importlib.import_module("torch.distributed.elastic.rendezvous.c10d_rendezvous_backend")
_utils: Any = importlib.import_module("torch.distributed.elastic.rendezvous.utils")

__all__ = ["BACKEND", "DEFAULT_PORT", "OrchestratorStore", "RendezvousHandler", "create_handler", "handlers"]

BACKEND = "collective"
DEFAULT_PORT = 29400  # torchrun's default rendezvous port
READ_TIMEOUT = 60  # seconds a store request may take (rdzv-conf read_timeout)
ROUNDS_KEY = "collective/rounds"  # (in the run's store) how many rounds named a job
JOB_KEY = "collective/job"  # (in a round's store) the job name rank 0 picked for the round


class OrchestratorStore(dist.Store):  # type: ignore[misc]
    """A torch.distributed store kept by an orchestrator: ``name`` on the one at ``address``.

    Failures are ``torch.distributed.DistStoreError`` naming the orchestrator and the cause (not
    running, wrong token, a timeout naming the keys never set)."""

    def __init__(self, address: str, name: str, token: str | None, timeout: timedelta) -> None:
        super().__init__()
        self.set_timeout(timeout)
        self._client = StoreClient(address, name, token)

    def _request(self, op: str, wait: timedelta | None = None, **fields: Any) -> dict[str, Any]:
        seconds = self.timeout.total_seconds()
        try:
            return self._client.request(
                op, seconds, wait=None if wait is None else wait.total_seconds(), **fields
            )
        except StoreError as exc:
            raise dist.DistStoreError(str(exc)) from exc

    def set(self, key: str, value: bytes | str) -> None:
        self._request("set", keys=[key], values=[_as_bytes(value)])

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self._request("set", keys=list(keys), values=[_as_bytes(value) for value in values])

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values: list[bytes] = self._request("get", self.timeout, keys=list(keys))["values"]
        return values

    def add(self, key: str, amount: int) -> int:
        value: int = self._request("add", keys=[key], amount=int(amount))["value"]
        return value

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        value: bytes = self._request(
            "compare_set", keys=[key], expected=_as_bytes(expected), desired=_as_bytes(desired)
        )["value"]
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._request("wait", timeout if timeout is not None else self.timeout, keys=list(keys))

    def check(self, keys: list[str]) -> bool:
        value: bool = self._request("check", keys=list(keys))["value"]
        return value

    def delete_key(self, key: str) -> bool:
        value: bool = self._request("delete", keys=[key])["value"]
        return value

    def num_keys(self) -> int:
        value: int = self._request("count")["value"]
        return value

    def close(self) -> None:
        self._client.close()


class _Backend(_c10d.C10dRendezvousBackend):  # type: ignore[misc]
    """c10d's rendezvous state on a store, under this backend's name."""

    @property
    def name(self) -> str:
        return BACKEND


class RendezvousHandler(_api.RendezvousHandler):  # type: ignore[misc]
    """torch's dynamic rendezvous over an ``OrchestratorStore``; each round names the workers' job."""

    def __init__(self, inner: Any, store: OrchestratorStore, address: str, job: str) -> None:
        self._inner, self._store, self._address, self._job = inner, store, address, job

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return bool(self._inner.use_agent_store)

    def next_rendezvous(self) -> Any:
        info = self._inner.next_rendezvous()
        if info.rank == 0:
            shared = info.bootstrap_store_info
            if shared is not None:  # (torch's handler says where its store is in its first round
                # only: a node that joins a later round with the same rank 0 would wait for it forever)
                info.store.multi_set(
                    [_api.RendezvousStoreInfo.MASTER_ADDR_KEY, _api.RendezvousStoreInfo.MASTER_PORT_KEY],
                    [shared.master_addr, str(shared.master_port)],
                )
            # the workers' job: a number no earlier round of this run had
            info.store.set(JOB_KEY, f"{self._job}.{self._store.add(ROUNDS_KEY, 1) - 1}")
        os.environ["COLLECTIVE_JOB"] = info.store.get(JOB_KEY).decode()
        os.environ.setdefault("COLLECTIVE_GLOBAL_ADDRESS", self._address)
        return info

    def is_closed(self) -> bool:
        return bool(self._inner.is_closed())

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return int(self._inner.num_nodes_waiting())

    def get_run_id(self) -> str:
        return str(self._inner.get_run_id())

    def shutdown(self) -> bool:
        try:
            return bool(self._inner.shutdown())
        finally:
            self._store.close()


def create_handler(params: Any) -> RendezvousHandler:
    """The handler for torchrun's ``RendezvousParameters`` (``--rdzv-endpoint`` names the orchestrator)."""
    host, port = _utils.parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    address = f"{host}:{port}"
    token = os.environ.get("COLLECTIVE_TOKEN", "").strip() or None
    timeout = timedelta(seconds=params.get_as_int("read_timeout", READ_TIMEOUT))
    store = OrchestratorStore(address, f"torchrun/{params.run_id}", token, timeout)
    try:
        inner = _dynamic.create_handler(store, _Backend(store, params.run_id), params)
    except BaseException:
        store.close()
        raise
    job = os.environ.get("COLLECTIVE_JOB", "").strip() or f"torchrun-{params.run_id}"
    return RendezvousHandler(inner, store, address, job)


def handlers() -> Callable[[Any], RendezvousHandler]:
    """What the ``torchrun.handlers`` entry point names: torchrun calls it for the handler's creator."""
    return create_handler


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
