"""A process's membership of a multi-node job: ``NodeJob`` (orchestrator client, data service,
topology), the call exchange among a group's nodes, and the typed messages between nodes."""

from __future__ import annotations

from collective.node.membership import Host, NodeJob

__all__ = ["Host", "NodeJob"]
