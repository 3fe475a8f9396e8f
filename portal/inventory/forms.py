"""The "Add a node" form: the node's facts and, optionally, pasted nvidia-smi output."""

from __future__ import annotations

from django import forms

from .models import Node
from .services import nvidia_smi_text_problems

QUERY_COMMAND = (
    "nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total,compute_cap,driver_version --format=csv"
)


class NodeCreateForm(forms.Form):
    name = forms.CharField(
        max_length=63, help_text="Short name, e.g. dgx-v100-02; its agent's queue follows it."
    )
    hostname = forms.CharField(max_length=255, required=False, help_text="How the portal reaches the node.")
    description = forms.CharField(max_length=255, required=False)
    vllm_python = forms.CharField(
        max_length=Node._meta.get_field("vllm_python").max_length,
        required=False,
        label="vLLM Python",
        help_text=Node._meta.get_field("vllm_python").help_text,
    )
    nvidia_smi_query = forms.CharField(
        required=False,
        label="GPUs (nvidia-smi CSV)",
        max_length=200_000,
        widget=forms.Textarea(attrs={"rows": 8, "cols": 100, "spellcheck": "false"}),
        help_text=f"Optional: paste the output of `{QUERY_COMMAND}`. Without it the node is CPU-only "
        "until its agent reports its GPUs.",
    )
    nvidia_smi_topology = forms.CharField(
        required=False,
        label="Topology (nvidia-smi topo -m)",
        max_length=200_000,
        # Not stripped: the header row starts with a tab, and without it every column shifts left.
        strip=False,
        widget=forms.Textarea(attrs={"rows": 8, "cols": 100, "spellcheck": "false"}),
        help_text="Optional: paste `nvidia-smi topo -m`; NVLink peers come from it.",
    )

    def clean_name(self) -> str:
        name = self.cleaned_data["name"]
        if name == "new":
            raise forms.ValidationError("'new' is the address of this page; choose another name.")
        return name

    def clean(self) -> dict:
        # The pasted texts are checked here too, so every error shows on the first submit (issue 38).
        super().clean()
        data = self.cleaned_data
        problems = nvidia_smi_text_problems(
            query_csv=data.get("nvidia_smi_query") or "", topology_text=data.get("nvidia_smi_topology") or ""
        )
        for field, message in problems.items():
            self.add_error(field, message)
        return data
