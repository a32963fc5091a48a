"""Groups: a value naming a subset of the job's peers.

``new_group([0, 2, 3])`` needs no call on the other peers: a group is its sorted member list, and
peers that name the same members meet in the same rendezvous. Collectives on a group are ranked by
position in that list (peer 2 is rank 1 above), ``mean`` divides by the group's size, and every
group has its own order of calls and its own checks, so calls on different groups run concurrently.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from collective.arrays import integer
from collective.errors import InvalidArgumentError, describe_peers

__all__ = ["Group", "as_group", "new_group"]


@dataclass(frozen=True)
class Group:
    """The peers ``members`` (sorted peer ids) of a job; rank i is ``members[i]``."""

    members: tuple[int, ...]

    def __post_init__(self) -> None:
        given = self.members
        found = tuple(map(integer, given)) if isinstance(given, list | tuple) else ()
        members = tuple(peer for peer in found if peer is not None and peer >= 0)
        if not members or len(members) < len(found) or list(members) != sorted(set(members)):
            raise InvalidArgumentError(
                f"Group({given!r}): a group's members are distinct peer ids in increasing order; "
                f"make one with new_group(ranks)"
            )
        object.__setattr__(self, "members", members)  # (a list, numpy integers: as new_group gives them)

    @property
    def size(self) -> int:
        return len(self.members)

    def rank(self, peer: int) -> int:
        """The rank of ``peer`` in this group (InvalidArgumentError if it is not a member)."""
        try:
            return self.members.index(peer)
        except ValueError:
            raise InvalidArgumentError(
                f"peer {peer!r} is not a member of the group of {describe_peers(list(self.members))}: "
                f"only members call collectives on a group"
            ) from None

    def check_within(self, world: int) -> None:
        """InvalidArgumentError unless every member is a peer of a job of ``world`` peers."""
        unknown = [peer for peer in self.members if peer >= world]
        if unknown:
            raise InvalidArgumentError(
                f"the group names {describe_peers(unknown)}, but the job's peers are 0..{world - 1}"
            )

    def __repr__(self) -> str:
        return f"Group({list(self.members)})"


def new_group(ranks: Iterable[int], world: int | None = None) -> Group:
    """A group of the peers ``ranks`` (any order, no repeats); checked against ``world`` when known.

    Raises InvalidArgumentError for an empty list, repeats, or ids that are not peers of the job.
    """
    try:
        peers = list(ranks)
    except TypeError:
        raise InvalidArgumentError(f"new_group takes a list of peer ids, got {ranks!r}") from None
    bad = [p for p in peers if integer(p) is None or p < 0]
    if bad:
        raise InvalidArgumentError(f"new_group: {bad!r} are not peer ids (integers >= 0)")
    peers = [int(p) for p in peers]
    if not peers:
        raise InvalidArgumentError("new_group: the list of peers is empty; a group has at least one peer")
    repeated = sorted({p for p in peers if peers.count(p) > 1})
    if repeated:
        raise InvalidArgumentError(f"new_group: {describe_peers(repeated)} named more than once")
    group = Group(tuple(sorted(peers)))
    if world is not None:
        group.check_within(world)
    return group


def as_group(value: object) -> Group | None:
    """A ``group=`` argument as a Group: a Group, a list (or tuple) of peer ids as ``new_group``
    takes, or None (the whole job); InvalidArgumentError for anything else."""
    if value is None or isinstance(value, Group):
        return value
    if isinstance(value, list | tuple | range):
        return new_group(value)  # (the same members are the same group, whichever way named)
    raise InvalidArgumentError(f"group must be a value of new_group() or a list of peer ids, got {value!r}")
