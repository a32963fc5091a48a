"""The figures a job runs on, agreed by every peer at its start: a profile, a probe, or the defaults.

Each process brings an ``Intent``: the profile COLLECTIVE_PROFILE names (checked on load: a bad
file is a ProfileWarning and no profile) and its COLLECTIVE_PROBE policy. A multi-node job's
processes hand both to the orchestrator with their registration (the profile as a digest of its
text), so after joining every process sees every other's and ``decide`` makes the same decision
everywhere, without one message more:

* ``profile`` when every process holds the same profile (same digest) and it covers the job's
  layout: each uses its own copy (they are equal);
* else ``probe`` when some process's config leaves a kind to ``auto`` and the policy says so
  (``always`` anywhere; else ``auto``, the default, when the job spans several hosts and no
  process says ``never``): ``measure`` runs the candidates of
  a few kinds at two sizes, within PROBE_SECONDS, and every peer takes the maximum of every
  peer's times (one all_reduce), so all hold the same figures;
* else ``default``: the built-in costs.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from collective.errors import ConfigError
from collective.tuning.model import Curve, Figures, Key, candidates
from collective.tuning.profile import ProfileError, ProfileWarning, parse, read

__all__ = [
    "POLICIES",
    "PROBE_BYTES",
    "PROBE_KINDS",
    "PROBE_SECONDS",
    "Intent",
    "Probing",
    "decide",
    "intent",
    "measure",
]

log = logging.getLogger("collective.tuning")

PROFILE_VARIABLE = "COLLECTIVE_PROFILE"
POLICY_VARIABLE = "COLLECTIVE_PROBE"
POLICIES = ("auto", "always", "never")
PROBE_KINDS = ("all_reduce", "reduce_scatter", "broadcast", "all_gather")  # by need (all_gather moves most)
PROBE_BYTES = (128 << 10, 512 << 10)  # per peer: above what travels with the calls (64 KiB)
PROBE_SECONDS = 0.5  # no kind is begun that would end past this, were it as long as the longest yet
REPEATS = 2  # timed calls at the first size (the least counts; one at the others), after a warm-up


@dataclass(frozen=True)
class Intent:
    """What one process brings to the decision."""

    figures: Figures | None  # its profile's, when it has a usable one
    digest: str | None  # of the profile's text
    policy: str  # COLLECTIVE_PROBE: auto, always or never
    path: str | None = None  # the profile's file
    uses_auto: bool = True  # its config leaves some kind to auto (else nothing needs figures)

    def info(self) -> dict[str, str | None]:
        """What the orchestrator carries to the other processes."""
        return {"profile": self.digest, "probe": self.policy, "auto": "1" if self.uses_auto else "0"}


def intent(uses_auto: bool = True, environ: Mapping[str, str] | None = None) -> Intent:
    """This process's intent, from COLLECTIVE_PROFILE and COLLECTIVE_PROBE; raises ConfigError for
    a policy that is none of POLICIES; warns (ProfileWarning) for a profile that cannot be used.
    ``uses_auto``: the job's config leaves some kind to auto."""
    environ = os.environ if environ is None else environ
    policy = environ.get(POLICY_VARIABLE, "auto").strip().lower() or "auto"
    if policy not in POLICIES:
        raise ConfigError(f"{POLICY_VARIABLE}={policy!r}: must be one of {', '.join(POLICIES)}")
    path = environ.get(PROFILE_VARIABLE, "").strip()
    if not path:
        return Intent(None, None, policy, uses_auto=uses_auto)
    try:
        data = read(path)  # (once: the digest is of the very text the figures came from)
        figures = parse(data, path)
    except ProfileError as exc:
        refuse(f"{PROFILE_VARIABLE}: {exc}; the job measures for itself or uses built-in figures")
        return Intent(None, None, policy, uses_auto=uses_auto)
    return Intent(figures, hashlib.blake2b(data, digest_size=12).hexdigest(), policy, path, uses_auto)


def refuse(message: str) -> None:
    """Say a profile was not used: a warning the caller sees, and the log."""
    log.warning("%s", message)
    warnings.warn(message, ProfileWarning, stacklevel=3)


def decide(infos: Sequence[Mapping[str, Any]], key: Key, mine: Intent) -> str:
    """'profile', 'probe' or 'default' for a job whose processes brought ``infos`` (each an
    ``Intent.info()``), whose whole group's schedule runs at ``key``: the same everywhere."""
    digests = {info.get("profile") for info in infos}
    same = len(digests) == 1 and None not in digests
    if same and mine.figures is not None and mine.figures.covers(key):
        return "profile"
    if mine.figures is not None:
        why = (
            f"it has no figures for {key.describe()}"
            if same
            else "the job's processes do not all hold this same profile"
        )
        refuse(f"{PROFILE_VARIABLE}={mine.path}: not used, {why}")
    policies = {info.get("probe") or "auto" for info in infos}
    needed = any(info.get("auto", "1") == "1" for info in infos)  # (no config leaves a kind to auto)
    if needed and ("always" in policies or ("never" not in policies and key.hosts > 1)):
        return "probe"
    return "default"


class Probing(Protocol):
    """The collectives a probe runs, as one peer of the job's whole group."""

    def run(self, kind: str, nbytes: int, strategy: str) -> None:
        """One call of ``kind`` with ``nbytes`` per peer, run with ``strategy``."""
        ...

    def agree_max(self, values: np.ndarray) -> np.ndarray:
        """The element-wise maximum of ``values`` over every peer (float64)."""
        ...


def measure(
    probing: Probing,
    key_of: Callable[[str], Key],
    budget: float = PROBE_SECONDS,
    kinds: Sequence[str] = PROBE_KINDS,
    sizes: Sequence[int] = PROBE_BYTES,
) -> Figures:
    """Figures measured by every peer alike (see the module's docstring)."""
    started = time.perf_counter()
    plan: list[tuple[Key, str, int]] = []
    times: list[float] = []
    spent = longest = 0.0
    for kind in kinds:
        if spent + longest > budget:  # (agreed: every peer holds the same ``spent``)
            break
        key = key_of(kind)
        for name in candidates(kind, key.participants):
            probing.run(kind, sizes[0], name)  # warm-up: connections, buffers
            for size in sizes:
                best = math.inf
                for _ in range(REPEATS if size == sizes[0] else 1):  # (larger: mostly bandwidth, steadier)
                    began = time.perf_counter()
                    probing.run(kind, size, name)
                    best = min(best, time.perf_counter() - began)
                plan.append((key, name, size))
                times.append(best)
        before, spent = spent, float(probing.agree_max(np.array([time.perf_counter() - started]))[0])
        longest = max(longest, spent - before)
    agreed = probing.agree_max(np.array(times, dtype=np.float64))
    figures = Figures("probe", seconds_spent=spent)
    points: dict[tuple[Key, str], list[tuple[int, float]]] = {}
    for (key, name, size), seconds in zip(plan, agreed.tolist(), strict=True):
        points.setdefault((key, name), []).append((size, max(seconds, 1e-9)))
    figures.curves = {where: Curve(tuple(found)) for where, found in points.items()}
    measured = sorted({key.kind for key, _ in figures.curves})
    log.info("probe: %s measured in %.2f s", ", ".join(measured), spent)
    return figures
