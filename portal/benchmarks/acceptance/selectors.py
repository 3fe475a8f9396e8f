"""Reads of node acceptances for the node's page. The calibration a finished acceptance fitted is
read by the simulator too, so its selector stays with the record (`node_latest_calibration` in
portal/inventory/selectors.py)."""

from __future__ import annotations

from portal.inventory.models import Node, NodeAcceptance


def node_latest_acceptance(node: Node) -> NodeAcceptance | None:
    """The node's most recent acceptance (running or finished), or None."""
    return node.acceptances.order_by("-started_at", "-id").first()
