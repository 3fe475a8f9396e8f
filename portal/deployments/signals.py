"""Deployments' answers to what the apps below it report.

A GPU sample that finds a degraded or lost GPU sends inventory's `gpus_sick`; the deployments on
those GPUs are drained on `control` (deployments.drain_sick_gpus, portal/deployments/gpu_drain.py).
"""

from __future__ import annotations

from django.dispatch import receiver

from portal.inventory.models import Node
from portal.inventory.signals import gpus_sick

from .dispatch import send_to_control


@receiver(gpus_sick, dispatch_uid="drain-sick-gpus")
def drain_sick_gpus_later(sender, node: Node, **kwargs) -> None:
    send_to_control("deployments.drain_sick_gpus", args=[node.name])
