"""What the choice of a schedule needs from an agreed call and a group's layout (collective.tuning
chooses): the strategy the call asks for, its size, and where the leaders' schedule runs."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from collective.algorithms.strategies import Strategy, parse_strategy
from collective.calls.layout import Layout
from collective.calls.signature import Signature
from collective.tuning import Key

if TYPE_CHECKING:
    from collective.node import NodeJob

__all__ = ["call_size", "leaders_hosts", "leaders_key", "requested"]


def requested(agreed: Signature, configured: Strategy) -> Strategy:
    """The strategy an agreed call asks for: its own, else the configured one (maybe ``auto``)."""
    return configured if agreed.strategy is None else parse_strategy(agreed.strategy)


def call_size(agreed: Signature) -> tuple[int, int]:
    """(bytes, elements) of the array each peer of an agreed call passes (the root's for broadcast
    and scatter; every array's of a coalesced call); 0 where it states none."""
    dtype = agreed.dtype
    if agreed.parts:
        elements = sum(math.prod(shape) for shape, _ in agreed.parts)
        dtype = agreed.parts[0][1]
    elif agreed.shape is not None:
        elements = math.prod(agreed.shape)
    else:
        return 0, 0
    return elements * (np.dtype(dtype).itemsize if dtype is not None else 1), elements


def leaders_key(layout: Layout, hosts: int, kind: str) -> Key:
    """Where the schedule among the leaders of ``layout`` (nodes, or hosts) runs."""
    return Key("zmq", kind, layout.size, hosts, max(map(len, layout.ranks_at)))


def leaders_hosts(node: NodeJob, layout: Layout, tiered: bool) -> int:
    """The hosts the leaders of ``layout`` span (a host tier's leaders are one per host)."""
    return layout.size if tiered else len({node.host_of(n) for n in layout.nodes})
