"""REST API for nodes and GPUs."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from inference.errors import InputError
from inference.hardware import get_gpu
from portal.audit.api import AuditedModelViewSetMixin
from portal.audit.services import audit_event_record
from portal.core.api import ModelCleanMixin, StaffOnlyFieldsMixin

from . import services
from .dispatch import send_to_node
from .filters import GpuFilter, NodeFilter
from .models import Gpu, Node
from .selectors import node_list

HEALTH_FIELDS = ["health_state", "health_findings", "health_checked_at", "health_since", "health_cleared_at"]


class GpuSerializer(ModelCleanMixin, serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", queryset=Node.objects.all())
    bandwidth_gb_s = serializers.FloatField(required=False)
    fp16_tflops = serializers.FloatField(required=False)
    compute_capability = serializers.CharField(required=False)

    class Meta:
        model = Gpu
        fields = [
            "id",
            "node",
            "index",
            "name",
            "catalog_key",
            "uuid",
            "pci_bus_id",
            "memory_mib",
            "compute_capability",
            "bandwidth_gb_s",
            "fp16_tflops",
            "nvlink_peers",
            *HEALTH_FIELDS,
        ]
        read_only_fields = HEALTH_FIELDS

    def validate(self, attrs):
        # A GPU entered by hand with a catalog key takes its facts from the catalog
        # unless they are given explicitly.
        key = attrs.get("catalog_key")
        if key:
            try:
                spec = get_gpu(key)
            except InputError as error:
                raise serializers.ValidationError({"catalog_key": error.message}) from error
            attrs["catalog_key"] = spec.key
            attrs.setdefault("bandwidth_gb_s", spec.bandwidth_gb_s)
            attrs.setdefault("fp16_tflops", spec.fp16_tflops)
            attrs.setdefault("compute_capability", spec.compute_capability)
        return super().validate(attrs)


SOFTWARE_FIELDS = (
    "vllm_version",
    "torch_version",
    "torch_cuda_version",
    "torch_arch_list",
    "vllm_kernel_archs",
    "software_python",
    "software_probed_at",
    "software_error",
)


class NodeSerializer(StaffOnlyFieldsMixin, ModelCleanMixin, serializers.ModelSerializer):
    staff_only_fields = ("hostname",)

    gpus = GpuSerializer(many=True, read_only=True)
    queue = serializers.CharField(read_only=True)
    agent_state = serializers.SerializerMethodField(help_text="listening, silent or never (the heartbeat).")

    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "hostname",
            "description",
            "interconnect",
            "vllm_python",
            "engine",
            "driver_version",
            "queue",
            "discovered_at",
            "discovery_notes",
            *SOFTWARE_FIELDS,
            "agent_state",
            "agent_seen_at",
            "agent_versions",
            "gpus",
        ]
        read_only_fields = [
            "interconnect",
            "driver_version",
            "discovered_at",
            "discovery_notes",
            *SOFTWARE_FIELDS,
            "agent_seen_at",
            "agent_versions",
        ]

    def get_agent_state(self, node: Node) -> str:
        return node.agent.state.value


class NvidiaSmiInputSerializer(serializers.Serializer):
    query_csv = serializers.CharField(
        allow_blank=True, help_text="Output of `nvidia-smi --query-gpu=… --format=csv`."
    )
    topology = serializers.CharField(
        required=False,
        allow_blank=True,
        default="",
        trim_whitespace=False,  # the header row's leading tab aligns the columns
        help_text="Output of `nvidia-smi topo -m`.",
    )


class NodeViewSet(AuditedModelViewSetMixin, viewsets.ModelViewSet):
    filterset_class = NodeFilter
    serializer_class = NodeSerializer
    lookup_field = "name"
    queryset = node_list()

    @extend_schema(request=NvidiaSmiInputSerializer, responses=NodeSerializer)
    @action(detail=True, methods=["post"], url_path="nvidia-smi")
    def nvidia_smi(self, request, name=None):
        """Replace the node's GPUs with what pasted nvidia-smi output says."""
        node = self.get_object()
        data = NvidiaSmiInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        gpus = services.node_apply_nvidia_smi_text(
            node=node,
            query_csv=data.validated_data["query_csv"],
            topology_text=data.validated_data["topology"],
        )
        audit_event_record(action="node.apply_nvidia_smi", target=node, changes={"gpus": len(gpus)})
        return Response(NodeSerializer(node_list().get(pk=node.pk)).data)

    @extend_schema(request=None, responses={202: None})
    @action(detail=True, methods=["post"])
    def discover(self, request, name=None):
        """Ask the node's agent to read its GPUs with nvidia-smi."""
        node = self.get_object()
        task_id = send_to_node(node, "inventory.discover_gpus", args=[node.name])
        audit_event_record(action="node.discover", target=node, changes={"task_id": task_id})
        return Response({"task_id": task_id, "queue": node.queue}, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: None})
    @action(detail=True, methods=["post"], url_path="probe-software")
    def probe_software(self, request, name=None):
        """Ask the node's agent to report its vLLM environment (vLLM, torch, CUDA, kernels)."""
        node = self.get_object()
        task_id = send_to_node(node, "inventory.probe_software", args=[node.name])
        audit_event_record(action="node.probe_software", target=node, changes={"task_id": task_id})
        return Response({"task_id": task_id, "queue": node.queue}, status=status.HTTP_202_ACCEPTED)


class GpuViewSet(AuditedModelViewSetMixin, viewsets.ModelViewSet):
    filterset_class = GpuFilter
    serializer_class = GpuSerializer
    queryset = Gpu.objects.select_related("node")

    @extend_schema(request=None, responses=GpuSerializer)
    @action(detail=True, methods=["post"], url_path="mark-healthy")
    def mark_healthy(self, request, pk=None):
        """Staff: the GPU was reset (or its node rebooted); it takes work again. The next health
        sample judges it afresh."""
        gpu = services.gpu_mark_healthy(gpu=self.get_object(), user=request.user)
        return Response(GpuSerializer(gpu).data)
