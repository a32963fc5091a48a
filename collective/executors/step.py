"""A Step: one peer's ticket for one agreed collective.

The rendezvous hands every peer a Step once all local peers of the group agreed. It carries what
the executor needs (the agreed signature, every local peer's call, the deadline). An exception
other than a CollectiveError while it runs (say MemoryError) fails the collective for the other
local peers at once (PeerLostError naming this peer) instead of leaving them to time out.
(A peer's calls on a group run one at a time: its Sequencer, collective.work, sees to that.)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from collective.algorithms.ops import Array
from collective.algorithms.strategies import Strategy
from collective.calls.signature import Signature
from collective.config import CollectiveConfig
from collective.errors import CollectiveError, PeerLostError
from collective.transport.inproc import Exchange
from collective.tuning import Chooser

if TYPE_CHECKING:
    from collective.calls.base import Call
    from collective.node import NodeJob

__all__ = ["Executor", "Lane", "Plan", "Site", "Step"]

T = TypeVar("T")

Lane = Callable[[int], Array | None]  # an executor's run of a persistent use, by its step number


class Executor(Protocol):
    """One way of running an agreed step (collective.executors, collective.executors.three_phase)."""

    @property
    def path(self) -> str:
        """Its name, as choose() logs it at DEBUG level ("fused", "shm", "host tier", ...)."""
        ...

    @property
    def strategy(self) -> Strategy | None:
        """The schedule it runs, where chosen when the step is (the flight recorder's algorithm)."""
        ...

    @property
    def runs_again(self) -> bool:
        """Whether a step it ran can run again as a persistent use (``Rendezvous.again``): its work
        is all done in ``run``, none when it was chosen, and it holds no state of one step."""
        ...

    def run(self, step: Step) -> Array | None:
        """This peer's part of the step: its result (None where it gets none)."""
        ...

    def lane(self, step: Step) -> Lane | None:
        """``run`` of a persistent use of ``step`` (``Rendezvous.lane``): a function of the use's
        step number (its plan renumbered, its deadline set), with what each use reads bound once;
        None where it has none (or none yet). A lane runs the common case of a use and ``run`` for
        anything else, so its outcome is ``run``'s."""
        ...

    def abort(self, error: CollectiveError) -> None:
        """Fail the step for every peer still inside it."""
        ...


@dataclass(frozen=True)
class Site:
    """Where a job's peers of this process run their steps: what choosing an executor needs."""

    config: CollectiveConfig
    fuse_below: int = 0  # numpy arrays up to this many bytes: Fused
    share_below: int = 0  # numpy arrays up to this many bytes: Shared
    node: NodeJob | None = None  # multi-node: this process's membership of the global job
    exchanges: weakref.WeakSet[Exchange] = field(default_factory=weakref.WeakSet)  # aborted on close
    chooser: Chooser = field(default_factory=Chooser)  # what "auto" runs (collective.tuning)
    _kept: dict[Any, Any] = field(default_factory=dict)  # what executors keep per group (``once``)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def once(self, key: Any, make: Callable[..., T], *args: Any) -> T:
        """``make(*args)`` the first time ``key`` is asked for (once, whoever asks), then the same."""
        found = self._kept.get(key)
        if found is None:
            with self._lock:
                found = self._kept.get(key)
                if found is None:
                    found = self._kept[key] = make(*args)
        return found


class Plan:
    """What the rendezvous decided for one step, shared by the local peers of the group."""

    __slots__ = ("agreed", "calls", "error", "executor", "members", "number", "size")

    def __init__(
        self,
        number: int,
        agreed: Signature,
        calls: list[Call],  # every local peer's call, by local index
        members: tuple[int, ...],  # the group's peer ids, by rank
        executor: Executor,
        error: CollectiveError | None = None,  # multi-node: a local failure told to the other nodes
    ) -> None:
        self.number = number
        self.agreed = agreed
        self.calls = calls
        self.members = members
        self.executor = executor
        self.error = error
        self.size = len(members)

    @property
    def label(self) -> str:
        """The step for messages: "all_reduce #12" (made when read: a persistent use renumbers the
        plan of its last use, and reads it only to say what failed)."""
        return f"{self.agreed.kind} #{self.number}"


class Step:
    """Peer ``peer``'s part of ``plan``."""

    __slots__ = ("agreed", "call", "deadline", "index", "peer", "plan", "rank", "task", "timeout")

    def __init__(
        self, plan: Plan, peer: int, index: int, rank: int, call: Call, deadline: float, timeout: float
    ) -> None:
        self.plan = plan
        self.peer = peer
        self.index = index  # among this process's peers of the group
        self.rank = rank  # in the group
        self.call = call
        self.deadline = deadline
        self.timeout = timeout
        self.agreed = plan.agreed  # the call as agreed; an executor that agrees beyond this process sets it
        self.task: Any = None  # what an executor keeps of a persistent call's step for its next use

    def run(self) -> Any:
        """This peer's result (its executor's work, then the call's last touch)."""
        plan = self.plan
        try:
            result = plan.executor.run(self)
            return self.call.finish(result, self.agreed, plan.size)
        except CollectiveError:
            raise
        except BaseException as error:
            plan.executor.abort(
                PeerLostError(f"{plan.label}: peer {self.peer} failed: {error!r}", [self.peer])
            )
            raise
