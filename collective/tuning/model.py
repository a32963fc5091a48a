"""The cost model behind strategy "auto": a predicted time for every schedule, and the choice.

A ``Key`` names one place a schedule runs: the transport between its participants (``inproc``:
the threads of one process; ``zmq``: node leaders over the data service), the collective kind,
the participants, the hosts they span and the group's peers each participant speaks for. For a
key and a call's bytes (what each peer passes: ``x.nbytes``; the root's array for broadcast and
scatter) every candidate schedule gets a predicted time, t = alpha + bytes / beta:

* measured (``Figures``: a probe at job start, or a profile written by ``collective tune``): the
  times measured for that schedule at a few sizes, joined by straight lines (each segment its own
  alpha and beta), the first time held below the smallest size; beyond the largest, the line goes
  on at the schedule's built-in slope times how the key's measured slopes compare with their
  built-in ones (``Chooser._scale``), so far past the measured sizes the bytes each schedule moves
  decide, as they do on the wire;
* ``default``: the textbook cost of the schedule, steps x alpha + bytes through the busiest link /
  beta + bytes reduced / gamma, with built-in figures for the transport (``TRANSPORTS``).

Only figures of one source compete: when some candidate of a key was measured, the measured ones
compete and the others are listed, not chosen. Ring and Direct need one element per participant
for all_reduce, reduce and broadcast (below that they would run Tree(2)). Ties go to the earlier
candidate, so every peer holding the same figures makes the same choice for the same agreed call:
that is what keeps the peers of a group in step (collective.tuning.probe agrees the figures).
"""

from __future__ import annotations

import itertools
import math
import statistics
import threading
from dataclasses import dataclass, field

from collective.algorithms.strategies import Auto, Centralized, Ring, Schedule, Tree, parse_strategy

__all__ = [
    "DEFAULT_SOURCE",
    "TRANSPORTS",
    "Chooser",
    "Curve",
    "Estimate",
    "Explanation",
    "Figures",
    "Key",
    "Transport",
    "candidates",
    "contribution_bytes",
    "default_seconds",
]

DEFAULT_SOURCE = "default"
ELEMENTWISE = ("all_reduce", "reduce", "broadcast")
# Direct's rounds send to every peer at once, so each link takes its bytes from n-1 senders
# together: across emulated hosts it moved them 8-10% slower than Ring's one neighbour at a time.
CONTENTION = 1.1  # Ring and Direct need >= 1 element per participant


@dataclass(frozen=True, order=True)
class Key:
    """Where a schedule runs: see the module's docstring."""

    transport: str  # "inproc" or "zmq"
    kind: str  # the strategy kind (collective.config.KINDS; a barrier is all_reduce's)
    participants: int  # who runs the schedule: threads, or node (host) leaders
    hosts: int = 1  # the hosts the participants span
    local: int = 1  # the group's peers one participant speaks for (its node's or host's)

    def describe(self) -> str:
        where = "threads" if self.transport == "inproc" else "nodes"
        text = f"{self.participants} {where}"
        if self.hosts > 1:
            text += f" on {self.hosts} hosts"
        if self.local > 1:
            text += f", {self.local} peers each"
        return text


@dataclass(frozen=True)
class Transport:
    """Built-in figures of a transport: seconds per step, bytes per second through one link, bytes
    per second reduced."""

    alpha: float
    beta: float
    gamma: float


TRANSPORTS = {
    "inproc": Transport(alpha=30e-6, beta=3e9, gamma=2e9),  # threads: a wake-up, a memcpy
    "loopback": Transport(alpha=150e-6, beta=1.5e9, gamma=2e9),  # nodes of one host
    "network": Transport(alpha=300e-6, beta=1.25e8, gamma=2e9),  # nodes of several hosts: 1 Gbit/s
}


def candidates(kind: str, participants: int) -> tuple[str, ...]:
    """The schedules ``auto`` weighs for ``kind`` among ``participants`` (ties go to the first)."""
    names = ["ring", "tree:2", "centralized", "direct"]
    names += [f"tree:{k}" for k in (4, 8) if k < participants - 1]
    return tuple(names)


def _depth(participants: int, arity: int) -> int:
    """Levels below the root of a k-ary heap of ``participants``."""
    if participants <= 1:
        return 0
    if arity == 1:
        return participants - 1
    depth, held, width = 0, 1, 1
    while held < participants:
        width *= arity
        held += width
        depth += 1
    return depth


def _shape(kind: str, strategy: Schedule, n: int) -> tuple[float, float, float]:
    """(steps, bytes through the busiest link, bytes reduced), the last two per byte of the call,
    of ``strategy``'s schedule of ``kind`` among ``n`` participants (collective.algorithms)."""
    if n <= 1:
        return 0.0, 0.0, 0.0
    share = (n - 1) / n
    table: dict[str, tuple[float, float, float]]
    match strategy:
        case Centralized():
            table = {
                "all_reduce": (2, 2 * (n - 1), n - 1),
                "reduce": (1, n - 1, n - 1),
                "broadcast": (1, n - 1, 0),
                "all_gather": (2, (n - 1) + n * (n - 1), 0),
                "reduce_scatter": (2, (n - 1) + share, n - 1),
                "all_to_all": (2, 2 * (n - 1), 0),
            }
            return table.get(kind, (1, n - 1, 0))
        case Tree(arity):
            d, c = _depth(n, arity), min(arity, n - 1)
            table = {
                "all_reduce": (2 * d, 2 * d * c, d * c),
                "reduce": (d, d * c, d * c),
                "broadcast": (d, d * c, 0),
                "all_gather": (2 * d, (n - 1) + d * c * n, 0),
                "reduce_scatter": (2 * d, d * c + share, d * c),
                "all_to_all": (2 * d, 2 * d * c, 0),
            }
            return table.get(kind, (d, n - 1, 0))
        case Ring():
            table = {
                "all_reduce": (2 * (n - 1), 2 * share, share),
                "reduce": (n - 1, 1, 1),  # a pipelined chain
                "broadcast": (n - 1, 1, 0),
                "all_gather": (n - 1, n - 1, 0),
                "reduce_scatter": (n - 1, share, share),
                "all_to_all": (n - 1, share, 0),
            }
            return table.get(kind, (n - 1, n - 1, 0))
        case _:  # Direct: one or two rounds, every pair at once (a step per further message)
            jam = CONTENTION
            table = {
                "all_reduce": (n, 2 * share * jam, share),
                "reduce": (n, 2 * share * jam, share),
                "broadcast": (n, 2 * share * jam, 0),
                "all_gather": (n - 1, (n - 1) * jam, 0),
                "reduce_scatter": (n - 1, share * jam, share),
                "all_to_all": (n - 1, share * jam, 0),
            }
            return table.get(kind, (1, (n - 1) * jam, 0))


def _threads_shape(kind: str, strategy: Schedule, n: int) -> tuple[float, float, float]:
    """``_shape`` for threads of one process: a message is a hand-off, so each receiver copies (or
    reduces) from the sender's memory itself, all receivers at once; "link" is the bytes the
    busiest thread copies, a step is a round of hand-offs (Direct's round to every peer is one)."""
    if n <= 1:
        return 0.0, 0.0, 0.0
    share = (n - 1) / n
    table: dict[str, tuple[float, float, float]]
    match strategy:
        case Centralized():  # the root reduces or gathers every peer's; every peer copies the result
            table = {
                "all_reduce": (2, 1, n - 1),
                "reduce": (1, 0, n - 1),
                "broadcast": (1, 1, 0),
                "all_gather": (2, (n - 1) + n, 0),
                "reduce_scatter": (2, 1 / n, n - 1),
                "all_to_all": (2, 2 * (n - 1), 0),
            }
            return table.get(kind, (1, n - 1, 0))
        case Tree(arity):  # level by level: a parent reduces its children's, children copy the parent's
            d, c = _depth(n, arity), min(arity, n - 1)
            table = {
                "all_reduce": (2 * d, d, d * c),
                "reduce": (d, 0, d * c),
                "broadcast": (d, d, 0),
                "all_gather": (2 * d, (n - 1) + d * n, 0),
                "reduce_scatter": (2 * d, d / n, d * c),
                "all_to_all": (2 * d, 2 * d * c, 0),
            }
            return table.get(kind, (d, n - 1, 0))
        case Ring():
            return _shape(kind, strategy, n)
        case _:  # Direct: one round per phase
            table = {
                "all_reduce": (2, 2 * share, share),
                "reduce": (2, share, share),
                "broadcast": (2, 2 * share, 0),
                "all_gather": (1, n - 1, 0),
                "reduce_scatter": (1, share, share),
                "all_to_all": (1, share, 0),
            }
            return table.get(kind, (1, n - 1, 0))


def contribution_bytes(key: Key, nbytes: int) -> int:
    """What one participant brings to the schedule for a call of ``nbytes`` per peer: its peers'
    blocks where the kind stacks them, else one reduced (or the root's) array."""
    return nbytes * (key.local if key.kind in ("all_gather", "gather", "scatter", "all_to_all") else 1)


def default_seconds(key: Key, strategy: Schedule, nbytes: int) -> float:
    """The built-in prediction for ``strategy`` at ``key`` and ``nbytes`` per peer."""
    transport = TRANSPORTS[
        "inproc" if key.transport == "inproc" else "network" if key.hosts > 1 else "loopback"
    ]
    shape = _threads_shape if key.transport == "inproc" else _shape
    steps, link, reduced = shape(key.kind, strategy, key.participants)
    contribution = contribution_bytes(key, nbytes)
    return steps * transport.alpha + contribution * (link / transport.beta + reduced / transport.gamma)


@dataclass(frozen=True)
class Curve:
    """Measured (bytes, seconds) points of one schedule, sorted by bytes, none twice."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a curve needs at least one point")
        sizes = [size for size, _ in self.points]
        if sizes != sorted(set(sizes)) or any(size < 0 for size in sizes):
            raise ValueError("a curve's sizes must be distinct, >= 0 and ascending")
        if any(not (math.isfinite(t) and t > 0) for _, t in self.points):
            raise ValueError("a curve's times must be finite numbers of seconds > 0")

    def seconds(self, nbytes: int, slope: float | None = None) -> float:
        """The predicted time at ``nbytes``: see the module's docstring. Beyond the largest size
        the line goes on with ``slope`` (seconds per byte) when given, else the last segment's."""
        points = self.points
        if nbytes <= points[0][0]:
            return points[0][1]
        for (b0, t0), (b1, t1) in itertools.pairwise(points):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        last_bytes, last = points[-1]
        if slope is None:
            slope = self.slope()
        return last + slope * (nbytes - last_bytes)

    def slope(self) -> float:
        """Seconds per byte of the last segment (one point, or a falling segment: as if its
        time were all bandwidth)."""
        (b1, t1) = self.points[-1]
        if len(self.points) > 1:
            b0, t0 = self.points[-2]
            if t1 > t0:
                return (t1 - t0) / (b1 - b0)
        return t1 / max(b1, 1)


@dataclass
class Figures:
    """Measured curves, by (key, schedule name), and where they came from ("probe", "profile")."""

    source: str
    curves: dict[tuple[Key, str], Curve] = field(default_factory=dict)
    seconds_spent: float = 0.0  # what measuring them cost (a probe's time; 0 for a profile)

    def covers(self, key: Key) -> bool:
        return any(k == key for k, _ in self.curves)


@dataclass(frozen=True)
class Estimate:
    """One schedule's predicted time for a call, and whether it competed."""

    strategy: str
    seconds: float
    source: str
    competes: bool = True
    note: str = ""


@dataclass(frozen=True)
class Explanation:
    """What ``auto`` chooses for one call, why, and what else was weighed (``col.explain``)."""

    kind: str
    nbytes: int
    path: str  # the executor: "linked", "three phases", "host tier", or one with no schedule to choose
    choice: str  # the schedule that runs ("-" where the path has none)
    seconds: float | None  # its predicted time (None where nothing is predicted)
    source: str  # "probe", "profile", "default", or "pinned" (an explicit strategy or COLLECTIVE_ALGO)
    key: Key | None = None
    alternatives: tuple[Estimate, ...] = ()
    note: str = ""
    spent: float = 0.0  # seconds the figures cost to measure as the job started (a probe's)

    def __str__(self) -> str:
        head = f"{self.kind} of {self.nbytes} bytes per peer"
        if self.key is not None:
            head += f" among {self.key.describe()}"
        lines = [f"{head}: path {self.path}"]
        if self.seconds is not None:
            lines[0] += f", {self.choice} ({self.seconds * 1e6:.1f} us predicted, from {self.source})"
        elif self.choice != "-":
            lines[0] += f", {self.choice} ({self.source})"
        if self.spent:
            lines.append(f"  the probe measured these figures in {self.spent:.2f} s as the job started")
        if self.note:
            lines.append(f"  {self.note}")
        for alt in self.alternatives:
            mark = "*" if alt.strategy == self.choice else " "
            state = "" if alt.competes else f"  (not weighed: {alt.note})"
            lines.append(f" {mark} {alt.strategy:<12} {alt.seconds * 1e6:12.1f} us  {alt.source}{state}")
        return "\n".join(lines)


class Chooser:
    """The choice for every call of a job: its figures (None: defaults only) and a bounded cache."""

    CACHE = 4096

    def __init__(self, figures: Figures | None = None) -> None:
        self.figures = figures
        self._cache: dict[tuple[Key, int, bool], Schedule] = {}
        self._scales: dict[Key, float] = {}
        self._lock = threading.Lock()

    def adopt(self, figures: Figures | None) -> None:
        """Use ``figures`` from now on (every peer adopts the same, agreed, before its first call)."""
        with self._lock:
            self.figures = figures
            self._cache, self._scales = {}, {}

    def estimates(self, key: Key, nbytes: int, few: bool) -> list[Estimate]:
        """Every candidate's estimate; ``few``: fewer elements than participants."""
        figures = self.figures
        measured = figures is not None and figures.covers(key)
        scale = self._scale(key) if measured else 1.0
        found: list[Estimate] = []
        for name in candidates(key.kind, key.participants):
            schedule = _schedule(name)
            curve = figures.curves.get((key, name)) if figures is not None else None
            if curve is not None and figures is not None:
                beyond = scale * _default_slope(key, schedule, curve.points[-1][0])
                estimate = Estimate(name, curve.seconds(nbytes, beyond), figures.source)
            else:
                seconds = default_seconds(key, schedule, nbytes)
                note = "not measured" if measured else ""
                estimate = Estimate(name, seconds, DEFAULT_SOURCE, not measured, note)
            if few and key.kind in ELEMENTWISE and name in ("ring", "direct"):
                estimate = Estimate(
                    name, estimate.seconds, estimate.source, False, "fewer elements than participants"
                )
            found.append(estimate)
        return found

    def _scale(self, key: Key) -> float:
        """How the measured schedules of ``key`` grow with bytes against their built-in costs (the
        median ratio of slopes): beyond the sizes measured, each goes on at its built-in slope
        times this, so the schedules keep the order their bytes give them (a probe's sizes are
        small, and a link's burst allowance can hide bandwidth there)."""
        found = self._scales.get(key)
        if found is None:
            assert self.figures is not None
            ratios = []
            for (where, name), curve in self.figures.curves.items():
                built_in = (
                    _default_slope(where, _schedule(name), curve.points[-1][0]) if where == key else 0.0
                )
                if built_in > 0:
                    ratios.append(curve.slope() / built_in)
            found = self._scales[key] = statistics.median(ratios) if ratios else 1.0
        return found

    def choose(self, key: Key, nbytes: int, few: bool) -> Schedule:
        """The schedule with the least predicted time (the first of equals)."""
        cached = self._cache.get((key, nbytes, few))
        if cached is not None:
            return cached
        chosen = _schedule(_best(self.estimates(key, nbytes, few)).strategy)
        with self._lock:
            if len(self._cache) >= self.CACHE:
                self._cache.clear()
            self._cache[(key, nbytes, few)] = chosen
        return chosen

    def explain(self, path: str, key: Key, nbytes: int, few: bool) -> Explanation:
        estimates = self.estimates(key, nbytes, few)
        best = _best(estimates)
        spent = self.figures.seconds_spent if self.figures is not None else 0.0
        return Explanation(
            key.kind,
            nbytes,
            path,
            best.strategy,
            best.seconds,
            best.source,
            key,
            tuple(estimates),
            spent=spent,
        )


def _schedule(name: str) -> Schedule:
    found = parse_strategy(name)
    assert not isinstance(found, Auto)
    return found


def _default_slope(key: Key, strategy: Schedule, nbytes: int) -> float:
    """Seconds per byte of ``strategy``'s built-in cost at ``key`` beyond ``nbytes``."""
    return (default_seconds(key, strategy, 2 * nbytes + 1) - default_seconds(key, strategy, nbytes)) / (
        nbytes + 1
    )


def _best(estimates: list[Estimate]) -> Estimate:
    weighed = [e for e in estimates if e.competes] or [e for e in estimates if e.strategy == "tree:2"]
    return min(weighed, key=lambda e: e.seconds)  # (min keeps the first of equals)
