"""CollectiveConfig: what a job looks like and which algorithm each collective uses.

Frozen and validated on construction: an invalid value raises ConfigError naming the field and
what is allowed. Strategies are given as values (``Tree(3)``) or strings (``"tree:3"``) and are
stored as values.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from collective.algorithms.strategies import Auto, Strategy, parse_strategy
from collective.arrays import real
from collective.errors import ConfigError

__all__ = ["DEFAULT_TIMEOUT", "CollectiveConfig"]

DEFAULT_TIMEOUT = 300.0

_GLOBAL_FIELDS = ("num_nodes", "global_address", "node_address", "data_service_port")
KINDS = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
)
STRATEGY_FIELDS = tuple(f"{scope}_{kind}_strategy" for scope in ("local", "global") for kind in KINDS)


@dataclass(frozen=True)
class CollectiveConfig:
    """The configuration every peer of a job registers with (all peers of a process pass equal ones).

    num_devices: local peers (threads) in this process, >= 1.
    local_<kind>_strategy: algorithm among the local peers, per collective kind (default
        Auto(): the one with the least predicted time, collective.tuning). A barrier follows
        all_reduce's. COLLECTIVE_ALGO, read at registration, pins them per kind.
    num_nodes, global_address, node_address, data_service_port: multi-node fields, all set or
        all unset. global_address is the orchestrator's "host:port". The data service listens on
        node_address's host at data_service_port (0: a free port) and other nodes are told that
        host and the port it got; node_address's port must be 0 or equal data_service_port.
    global_<kind>_strategy: algorithm among node leaders (default Auto()).
    timeout: seconds one collective (and registration) may take before CollectiveTimeout.
    job: the job's name: an orchestrator serves many jobs, told apart by name.
    token: a shared secret; when set, the orchestrator and every data service refuse
        connections that cannot prove they hold it (the token itself never crosses the wire).
    """

    num_devices: int = 1
    # Given as a value or a string; always a value (Auto(), Centralized(), ...) once constructed.
    local_all_reduce_strategy: Strategy | str = field(default_factory=Auto)
    local_reduce_strategy: Strategy | str = field(default_factory=Auto)
    local_broadcast_strategy: Strategy | str = field(default_factory=Auto)
    num_nodes: int | None = None
    global_address: str | None = None
    node_address: str | None = None
    data_service_port: int | None = None
    global_all_reduce_strategy: Strategy | str = field(default_factory=Auto)
    global_reduce_strategy: Strategy | str = field(default_factory=Auto)
    global_broadcast_strategy: Strategy | str = field(default_factory=Auto)
    local_all_gather_strategy: Strategy | str = field(default_factory=Auto)
    local_reduce_scatter_strategy: Strategy | str = field(default_factory=Auto)
    local_all_to_all_strategy: Strategy | str = field(default_factory=Auto)
    local_gather_strategy: Strategy | str = field(default_factory=Auto)
    local_scatter_strategy: Strategy | str = field(default_factory=Auto)
    global_all_gather_strategy: Strategy | str = field(default_factory=Auto)
    global_reduce_scatter_strategy: Strategy | str = field(default_factory=Auto)
    global_all_to_all_strategy: Strategy | str = field(default_factory=Auto)
    global_gather_strategy: Strategy | str = field(default_factory=Auto)
    global_scatter_strategy: Strategy | str = field(default_factory=Auto)
    timeout: float = DEFAULT_TIMEOUT
    job: str = "default"
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _require_int("num_devices", self.num_devices, minimum=1)
        for name in STRATEGY_FIELDS:
            object.__setattr__(self, name, _strategy(name, getattr(self, name)))
        given = [name for name in _GLOBAL_FIELDS if getattr(self, name) is not None]
        if given and len(given) != len(_GLOBAL_FIELDS):
            missing = [name for name in _GLOBAL_FIELDS if name not in given]
            raise ConfigError(
                f"multi-node fields must be all set or all unset: {', '.join(given)} set but "
                f"{', '.join(missing)} not"
            )
        if given:
            _require_int("num_nodes", self.num_nodes, minimum=1)
            _require_int("data_service_port", self.data_service_port, minimum=0, maximum=65535)
            _require_address("global_address", self.global_address, lowest_port=1)
            _require_address("node_address", self.node_address, lowest_port=0)
            node_port = int(str(self.node_address).rpartition(":")[2])
            if node_port not in (0, self.data_service_port):
                raise ConfigError(
                    f"node_address {self.node_address!r} names port {node_port} but data_service_port is "
                    f"{self.data_service_port}: the data service binds data_service_port (0: a free one) and "
                    f"the other nodes are told the port it got, so node_address's port must be 0 or the same"
                )
        seconds = real(self.timeout)
        if seconds is None:
            raise ConfigError(f"timeout must be a number of seconds, got {self.timeout!r}")
        if type(self.timeout) is not float and type(self.timeout) is not int:  # (numpy's: as Python's)
            object.__setattr__(self, "timeout", seconds)
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ConfigError(f"timeout must be a finite number of seconds > 0, got {self.timeout!r}")
        if (problem := job_problem(self.job)) is not None:
            raise ConfigError(problem)
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise ConfigError("token must be a non-empty string (or None for no token)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> CollectiveConfig:
        """A config from ``COLLECTIVE_<FIELD>`` variables (e.g. COLLECTIVE_NUM_NODES=2); ``overrides`` win.

        Raises ConfigError naming the variable whose value is invalid.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = f"COLLECTIVE_{f.name.upper()}"
            if name not in environ:
                continue
            text = environ[name].strip()
            try:
                if f.name in ("num_devices", "num_nodes", "data_service_port"):
                    values[f.name] = int(text)
                elif f.name == "timeout":
                    values[f.name] = float(text)
                else:
                    values[f.name] = text
            except ValueError:
                raise ConfigError(f"{name}={text!r} is not a number") from None
        from_environment = [name for name in values if name not in overrides]
        values.update(overrides)
        try:
            return cls(**values)
        except ConfigError as exc:  # name the variables whose fields the message is about
            named = [
                f"COLLECTIVE_{name.upper()}="
                + ("***" if name == "token" else repr(environ[f"COLLECTIVE_{name.upper()}"].strip()))
                for name in from_environment
                if re.search(rf"\b{name}\b", str(exc))
            ]
            raise ConfigError(f"{', '.join(named) or 'from the environment'}: {exc}") from None

    def local_strategy(self, kind: str) -> Strategy:
        """The strategy among a process's peers for ``kind`` (a barrier follows all_reduce's)."""
        return getattr(self, f"local_{kind if kind in KINDS else 'all_reduce'}_strategy")  # type: ignore[no-any-return]

    def global_strategy(self, kind: str) -> Strategy:
        """The strategy among node leaders for ``kind`` (a barrier follows all_reduce's)."""
        return getattr(self, f"global_{kind if kind in KINDS else 'all_reduce'}_strategy")  # type: ignore[no-any-return]

    @property
    def node_host(self) -> str:
        """The host part of ``node_address`` (multi-node only)."""
        return (self.node_address or "").rpartition(":")[0]

    @property
    def is_multi_node(self) -> bool:
        """True when the multi-node fields are set."""
        return self.num_nodes is not None

    def differences(self, other: CollectiveConfig) -> list[str]:
        """'field: mine vs other' for every field that differs (for registration errors)."""
        return [
            f"{f.name}={'***' if f.name == 'token' else getattr(self, f.name)} vs "
            f"{'***' if f.name == 'token' else getattr(other, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def _strategy(name: str, value: Any) -> Strategy:
    try:
        return parse_strategy(value)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _require_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ConfigError(f"{name} must be {allowed}, got {value}")


_ADDRESS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*:[0-9]{1,5}")  # a host name or IPv4 address


def address_problem(value: Any, lowest_port: int) -> str | None:
    """Why ``value`` is not 'host:port' with a port from ``lowest_port`` (None if it is)."""
    port = int(value.rpartition(":")[2]) if isinstance(value, str) and _ADDRESS.fullmatch(value) else -1
    if lowest_port <= port <= 65535:
        return None
    return f"must be 'host:port' (a host name or IPv4 address), a port in {lowest_port}..65535; got {value!r}"


def _require_address(name: str, value: Any, lowest_port: int) -> None:
    problem = address_problem(value, lowest_port)
    if problem is not None:
        raise ConfigError(f"{name} {problem}")


def job_problem(value: Any) -> str | None:
    """Why ``value`` cannot name a job (None if it can)."""
    if not isinstance(value, str) or not 0 < len(value) <= 200 or value != value.strip():
        return f"job must be a name of 1 to 200 characters without surrounding spaces, got {value!r}"
    return None
