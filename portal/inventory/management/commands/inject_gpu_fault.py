"""`manage.py inject_gpu_fault --node N --gpu I --kind xid79|ecc|hot`: rehearse a GPU failure on a
simulated node (portal/inventory/fault_rehearsal.py). `mark healthy` on the node page ends it."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.core.errors import ApplicationError
from portal.inventory.fault_rehearsal import GpuFault, gpu_fault_inject
from portal.inventory.models import Node


class Command(BaseCommand):
    help = "Write a GPU fault into a simulated node's readings, as its sampler would record it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--node", required=True, help="a simulated node, e.g. dgx-v100-01")
        parser.add_argument("--gpu", required=True, type=int, help="the GPU's index on the node")
        parser.add_argument(
            "--kind",
            required=True,
            choices=[fault.value for fault in GpuFault],
            help="xid79: fell off the bus (lost); ecc: uncorrectable ECC errors (degraded); hot: a warning",
        )

    def handle(self, *args, node: str, gpu: int, kind: str, **options) -> None:
        found = Node.objects.filter(name=node).first()
        if found is None:
            names = ", ".join(Node.objects.filter(engine="sim").values_list("name", flat=True)) or "none"
            raise CommandError(f"no node {node!r} (simulated nodes: {names})")
        try:
            changes = gpu_fault_inject(node=found, gpu_index=gpu, fault=GpuFault(kind))
        except ApplicationError as error:
            raise CommandError(error.message) from error
        gpu_row = found.gpus.get(index=gpu)
        self.stdout.write(f"{node}:{gpu} is {gpu_row.health_state}")
        for finding in gpu_row.health_findings:
            self.stdout.write(f"  {finding.get('level')}: {finding.get('message')}")
        if not changes:
            self.stdout.write("  (its state did not change)")
