"""Every error this library raises.

Hierarchy::

    CollectiveError                      root: ``except CollectiveError`` catches all of ours
    ├── ConfigError (ValueError)          an invalid CollectiveConfig, raised at construction
    ├── InvalidArgumentError (ValueError) a peer passed an unusable argument to a collective
    │                                     (unsupported dtype, unknown op, root outside the job);
    │                                     every peer of that collective gets it
    ├── RegistrationError                 register twice, unknown peer id, use before register()
    │                                     or after finish()
    ├── MismatchError                     peers called the same collective step with different
    │                                     collectives / ops / shapes / dtypes / roots; every peer
    │                                     gets it, naming the peers that differ
    ├── PeerLostError                     a peer left (finish) or died while others needed it
    ├── JobClosedError                    the job was reset() or closed under a waiting peer
    └── CollectiveTimeout (TimeoutError)  peers never arrived within the configured timeout;
                                          names them

Usability after an error (see docs/api.md): after InvalidArgumentError, MismatchError and
CollectiveTimeout the job stays usable (every peer moved on to the next collective); after
PeerLostError and JobClosedError it can only be finished.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CollectiveError",
    "CollectiveTimeout",
    "ConfigError",
    "InvalidArgumentError",
    "JobClosedError",
    "MismatchError",
    "PeerLostError",
    "RegistrationError",
    "describe_peers",
]


class CollectiveError(Exception):
    """Root of every error raised by this library."""


class ConfigError(CollectiveError, ValueError):
    """A configuration value is invalid; the message names the field and the allowed values."""


class InvalidArgumentError(CollectiveError, ValueError):
    """A peer passed an argument no collective can use (the message names the peer and the value)."""


class RegistrationError(CollectiveError):
    """A peer id was used out of its life cycle: register, collectives, finish."""


class MismatchError(CollectiveError):
    """Peers disagreed on a collective call (kind, op, shape, dtype, root, broadcast source)."""


class PeerLostError(CollectiveError):
    """A peer the collective needed has left the job or died."""

    def __init__(self, message: str, peers: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.peers: tuple[int, ...] = tuple(peers)


class JobClosedError(CollectiveError):
    """The job was reset or closed while this peer used it."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """The collective did not complete in time; ``missing`` names the peers that never arrived."""

    def __init__(self, message: str, missing: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.missing: tuple[int, ...] = tuple(missing)


def describe_peers(peers: list[int]) -> str:
    """[3] -> 'peer 3'; [0, 1, 2, 5] -> 'peers 0-2, 5'."""
    peers = sorted(peers)
    runs: list[str] = []
    start = previous = peers[0]
    for peer in [*peers[1:], None]:
        if peer is not None and peer == previous + 1:
            previous = peer
            continue
        runs.append(str(start) if start == previous else f"{start}-{previous}")
        if peer is not None:
            start = previous = peer
    return ("peer " if len(peers) == 1 else "peers ") + ", ".join(runs)
