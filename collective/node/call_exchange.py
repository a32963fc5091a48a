"""The call exchange of one step among a group's nodes: every node checks every other node's call
before any data moves, so a mismatch anywhere is the same error everywhere.

Each node sends its locally agreed call (or the error its local step ended with, as a verdict) to
every other node of the group, then reads theirs. A node that timed out waiting for another tells
the others, so a late node cannot complete a step the others gave up; any verdict ends the step
with the same error on every node. (collective.node.NodeJob.agree runs it for ThreePhase.)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from collective.calls import rules_of
from collective.calls.fields import as_sent
from collective.calls.layout import Layout
from collective.calls.signature import Signature, agree
from collective.errors import CollectiveError, CollectiveTimeout, MismatchError, PeerLostError, describe_peers
from collective.node.protocol import (
    VERDICT_GRACE,
    CallMessage,
    VerdictMessage,
    decode_call,
    given_up,
    verdict_error,
)
from collective.transport.network import NodeNetwork
from collective.transport.wire import WireError

__all__ = ["CallExchange"]


@dataclass(frozen=True)
class CallExchange:
    """The exchange of the group ``members`` (placed by ``layout``) on ``channel`` of ``network``."""

    network: NodeNetwork
    layout: Layout
    members: tuple[int, ...]
    channel: int
    gone: Callable[[list[int]], CollectiveError | None] | None = None  # once one of these peers finished

    def run(
        self, step: int, mine: Signature | CollectiveError, small: Any, deadline: float
    ) -> tuple[Signature, dict[int, Any]]:
        """The agreed call and the small contributions that came with the calls (by node position)."""
        network, layout, channel = self.network, self.layout, self.channel
        describe = self.describe
        me = network.index
        now = time.time()  # (wall clock: what every node's deadline is told in)
        # calls that came long enough ago to matter are sorted already: no drain before our call
        # goes out (a drain here delays it, and every node's next message with it)
        late = given_up(network.queued(list(layout.nodes), step, "call", channel, drain=False), now)
        if late is not None and not isinstance(mine, CollectiveError):  # too late: a timeout, everywhere
            here = self.peers_at(layout.me)
            mine = CollectiveTimeout(
                f"step {step}: {describe(me)} came {late[1]:.2f}s after the deadline of "
                f"{describe(late[0])}, too late to join the step",
                here,
            )
        if isinstance(mine, CollectiveError):
            message: CallMessage | VerdictMessage = VerdictMessage.of(step, mine)
        else:
            until = now + deadline - time.monotonic() + VERDICT_GRACE  # when this node gives up
            message = CallMessage(step, mine, None if small is None else small.tobytes(), until)
        header = {**message.encode(), "ch": channel}
        for other in layout.nodes:
            if other != me:
                network.send(other, header)
        calls: dict[int, Signature] = {}
        payloads: dict[int, Any] = {layout.me: small}
        verdicts = [(me, message)] if isinstance(message, VerdictMessage) else []
        for position, other in enumerate(layout.nodes):
            if other == me:
                continue
            there = self.peers_at(position)
            gone = None if self.gone is None else partial(self.gone, there)  # (their node's call follows)
            try:
                until, waiting_for = deadline + VERDICT_GRACE, f"the call of {describe(other)}"
                theirs, _ = network.receive(other, step, until, waiting_for, channel, gone)
            except CollectiveTimeout as exc:  # name the group's peers there (transport knows no peers)
                error = CollectiveTimeout(str(exc), there)
                verdict = {**VerdictMessage.of(step, error).encode(), "ch": channel}
                for node in layout.nodes:  # a late node must not complete the step the others gave up
                    if node != me:
                        with contextlib.suppress(PeerLostError):
                            network.send(node, verdict)
                raise error from None
            try:
                decoded = decode_call(theirs)
            except WireError as exc:
                raise MismatchError(
                    f"step {step}: {describe(other)} sent an unusable call: {exc} "
                    f"(the nodes called different numbers of collectives?)"
                ) from None
            if decoded.seq != step:
                raise MismatchError(
                    f"step {step}: {describe(other)} sent the call of step {decoded.seq}: "
                    f"the nodes called different numbers of collectives"
                )
            if isinstance(decoded, VerdictMessage):
                verdicts.append((other, decoded))
                continue
            calls[other] = decoded.signature
            payloads[position] = decoded.small
        if not verdicts:  # a node that timed out waiting for this one said so, after its call
            others = [node for node in layout.nodes if node != me]
            for other, found in network.queued(others, step, "verdict", channel):
                told = decode_call(found)
                if isinstance(told, VerdictMessage):
                    verdicts.append((other, told))
        if verdicts:
            raise verdict_error(step, verdicts, describe)
        assert not isinstance(mine, CollectiveError)
        calls[me] = as_sent(mine)  # (a long list of parts travels as its digest)
        who = lambda nodes: ", ".join(map(describe, nodes))  # noqa: E731
        return agree(calls, f"#{step}", rules_of, who=who), payloads

    def peers_at(self, position: int) -> list[int]:
        """The group's peers whose call the node at ``position`` sends (a host's leader: its host's)."""
        return [peer for rank, peer in enumerate(self.members) if self.layout.position[rank] == position]

    def describe(self, node: int) -> str:
        """'node 2 (peers 4-5)': the node and the group's peers its call stands for."""
        return f"node {node} ({describe_peers(self.peers_at(self.layout.nodes.index(node)))})"
