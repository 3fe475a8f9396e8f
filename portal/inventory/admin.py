from django import forms
from django.contrib import admin, messages

from portal.core.errors import ApplicationError
from portal.core.forms import EmptyJSONIsDefaultAdmin, LabelledTabularInline

from .models import Gpu, Node, NodeAcceptance
from .services import node_apply_nvidia_smi_text, nvidia_smi_text_parse


class GpuInline(LabelledTabularInline, admin.TabularInline):
    model = Gpu
    extra = 0
    fields = [
        "index",
        "name",
        "catalog_key",
        "memory_mib",
        "compute_capability",
        "bandwidth_gb_s",
        "fp16_tflops",
        "nvlink_peers",
    ]


class NodeForm(forms.ModelForm):
    nvidia_smi_query = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 6, "cols": 100}),
        help_text="Optional: paste `nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total,"
        "compute_cap,driver_version --format=csv` to replace the GPUs below.",
    )
    nvidia_smi_topology = forms.CharField(
        required=False,
        strip=False,  # the header row's leading tab aligns the columns
        widget=forms.Textarea(attrs={"rows": 6, "cols": 100}),
        help_text="Optional: paste `nvidia-smi topo -m` (NVLink peers come from it).",
    )

    class Meta:
        model = Node
        fields = ["name", "hostname", "description", "vllm_python"]

    def clean(self) -> dict:
        """Refuse the whole form, pasted text kept, when a pasted part does not read: saving the node
        without the GPUs the operator pasted would look like success."""
        super().clean()
        data = self.cleaned_data
        query, topology = data.get("nvidia_smi_query", ""), data.get("nvidia_smi_topology", "")
        if topology.strip() and not query.strip():
            self.add_error("nvidia_smi_topology", "the topology needs the GPU list (CSV) above; paste both")
        elif query.strip():
            try:
                nvidia_smi_text_parse(query_csv=query, topology_text=topology)
            except ApplicationError as error:
                self.add_error(error.field if error.field in self.fields else None, error.message)
        return data


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    form = NodeForm
    list_display = ["name", "hostname", "gpu_summary", "interconnect", "driver_version", "discovered_at"]
    list_filter = ["interconnect"]
    search_fields = ["name", "hostname", "description"]
    readonly_fields = ["interconnect", "driver_version", "discovered_at", "topology_text"]
    inlines = [GpuInline]

    @admin.display(description="GPUs")
    def gpu_summary(self, node: Node) -> str:
        gpus = list(node.gpus.all())
        return f"{len(gpus)} × {gpus[0].name}" if gpus else "CPU only"

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("gpus")

    def save_related(self, request, form, formsets, change) -> None:
        super().save_related(request, form, formsets, change)
        query = form.cleaned_data.get("nvidia_smi_query", "")
        if query.strip():
            try:
                gpus = node_apply_nvidia_smi_text(
                    node=form.instance,
                    query_csv=query,
                    topology_text=form.cleaned_data.get("nvidia_smi_topology", ""),
                )
            except ApplicationError as error:
                messages.error(request, f"nvidia-smi output not applied: {error.message}")
            else:
                messages.success(request, f"{len(gpus)} GPUs recorded from nvidia-smi output.")


@admin.register(Gpu)
class GpuAdmin(EmptyJSONIsDefaultAdmin, admin.ModelAdmin):
    list_display = [
        "__str__",
        "catalog_key",
        "memory_mib",
        "compute_capability",
        "bandwidth_gb_s",
        "fp16_tflops",
        "health_state",
        "health_checked_at",
    ]
    list_filter = ["catalog_key", "compute_capability", "node", "health_state"]
    search_fields = ["name", "uuid", "node__name"]
    # Health is what the agent's samples say; staff mark a GPU healthy on its node page (audited there).
    readonly_fields = [
        "health_state",
        "health_findings",
        "health_checked_at",
        "health_since",
        "health_cleared_at",
        "throttled_since",
    ]


@admin.register(NodeAcceptance)
class NodeAcceptanceAdmin(EmptyJSONIsDefaultAdmin, admin.ModelAdmin):
    """Read-only: an acceptance is written by its run (the node page's button or `accept_node`)."""

    list_display = ["id", "node", "state", "shape", "enforce_eager", "engine_start_s", "started_at"]
    list_filter = ["state", "shape"]
    search_fields = ["node__name", "verdict", "error"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
