"""The planner form: a GPU, a model and the profile knobs."""

from __future__ import annotations

from django import forms
from django.utils.text import slugify

from inference.hardware import GPU_CATALOG
from inference.hf_config import known_configs
from portal.inventory.models import Node
from portal.registry.models import ModelVersion

from .models import DeploymentProfile, Dtype

# GPUs on which vLLM should run eager (no CUDA graphs): the planner's `eager_off_on_volta` rule.
EAGER_GPUS = tuple(key for key, spec in GPU_CATALOG.items() if spec.is_volta)


def _model_choices() -> list[tuple[str, str]]:
    registered = [(m.name, m.name) for m in ModelVersion.objects.only("name")]
    # A registered name wins over a bundled config of the same name (resolve_model does the same).
    names = {name for name, _ in registered}
    bundled = [(name, f"{name} (bundled config)") for name in sorted(known_configs()) if name not in names]
    return [("Registered", registered), ("Bundled configs", bundled)]


class PlannerForm(forms.Form):
    model = forms.ChoiceField()
    gpu = forms.ChoiceField(
        label="GPU",
        choices=[(key, spec.display_name) for key, spec in GPU_CATALOG.items()],
        initial="v100-sxm2-32gb",
    )
    gpus = forms.IntegerField(min_value=1, max_value=64, initial=1, label="GPUs")
    interconnect = forms.ChoiceField(
        choices=[("", "from the GPU (SXM: NVLink)"), ("nvlink", "NVLink"), ("pcie", "PCIe only")],
        required=False,
    )
    dtype = forms.ChoiceField(label="dtype", choices=Dtype.choices, initial=Dtype.FLOAT16)
    tensor_parallel_size = forms.IntegerField(
        min_value=1, max_value=64, required=False, label="Tensor parallel (blank: all GPUs)"
    )
    quantization = forms.CharField(required=False)
    max_model_len = forms.IntegerField(
        min_value=1, required=False, label="Max model length (blank: the model's)"
    )
    gpu_memory_utilization = forms.FloatField(
        label="GPU memory utilization", min_value=0.05, max_value=1.0, initial=0.9
    )
    max_num_seqs = forms.IntegerField(min_value=1, initial=256)
    block_size = forms.TypedChoiceField(
        coerce=int, choices=[(n, n) for n in (8, 16, 32, 64, 128)], initial=16
    )
    enforce_eager = forms.BooleanField(required=False)
    enable_prefix_caching = forms.BooleanField(required=False)
    enable_chunked_prefill = forms.BooleanField(required=False)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["model"].choices = _model_choices()
        # Eager mode is the safe default on Volta (the planner warns without it), so the form's
        # default follows the GPU: here for the first GPU, in the page's script on a change.
        if not self.is_bound and "enforce_eager" not in self.initial:
            gpu = GPU_CATALOG.get(self.initial.get("gpu") or self.fields["gpu"].initial)
            self.initial["enforce_eager"] = bool(gpu and gpu.is_volta)
        self.fields["gpu"].widget.attrs["data-eager-gpus"] = " ".join(EAGER_GPUS)

    # The profile knobs the form carries, by ProfileSettings' names.
    SETTINGS_FIELDS = (
        "dtype",
        "tensor_parallel_size",
        "quantization",
        "max_model_len",
        "gpu_memory_utilization",
        "max_num_seqs",
        "block_size",
        "enforce_eager",
        "enable_prefix_caching",
        "enable_chunked_prefill",
    )

    def target_values(self) -> dict:
        """Keyword arguments naming the model and GPUs, as the planning services take them."""
        data = self.cleaned_data
        return {
            "model": data["model"],
            "gpu": data["gpu"],
            "gpus": data["gpus"],
            "nvlink": {"nvlink": True, "pcie": False}.get(data["interconnect"]),
        }

    def settings_values(self) -> dict:
        """The profile knobs of a valid form (blank quantization means none)."""
        values = {name: self.cleaned_data[name] for name in self.SETTINGS_FIELDS}
        values["quantization"] = values["quantization"] or None
        return values

    def profile_query(self) -> dict | None:
        """The admin's "add profile" form filled from this valid form; None when the model is not
        registered (a profile names a registered model version)."""
        data = self.cleaned_data
        version = ModelVersion.objects.filter(name=data["model"], external=False).first()
        if version is None:
            return None
        tp = data["tensor_parallel_size"] or data["gpus"]
        query = {
            "name": slugify(f"{version.name}-{data['gpu']}-tp{tp}")[:100],
            "model_version": version.pk,
            "target_gpu": data["gpu"],
            "target_gpu_count": data["gpus"],
            "tensor_parallel_size": tp,
        }
        for name in ("dtype", "max_model_len", "gpu_memory_utilization", "max_num_seqs", "block_size"):
            if data[name] is not None:
                query[name] = data[name]
        if data["quantization"]:
            query["quantization"] = data["quantization"]
        # The admin reads any non-empty value of a checkbox as checked: name only those that are on.
        for name in ("enforce_eager", "enable_prefix_caching", "enable_chunked_prefill"):
            if data[name]:
                query[name] = "on"
        return query

    @classmethod
    def initial_from_node(cls, node: Node) -> dict:
        """The node's GPUs as the planner's target: catalog model, count and interconnect."""
        gpus = list(node.gpus.all())
        keys = {gpu.catalog_key for gpu in gpus}
        if not gpus or len(keys) != 1 or next(iter(keys)) not in GPU_CATALOG:
            return {}
        linked = any(gpu.nvlink_peers for gpu in gpus)
        return {"gpu": keys.pop(), "gpus": len(gpus), "interconnect": "nvlink" if linked else "pcie"}

    @classmethod
    def initial_from_profile(cls, profile: DeploymentProfile) -> dict:
        initial = {name: getattr(profile, name) for name in cls.SETTINGS_FIELDS}
        if profile.model_version:
            initial["model"] = profile.model_version.name
        if profile.target_gpu:
            initial["gpu"] = profile.target_gpu
            initial["gpus"] = profile.target_gpu_count
        return initial
