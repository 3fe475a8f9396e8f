"""The planner form: a GPU, a model and the profile knobs."""

from __future__ import annotations

from typing import Any

from django import forms
from django.utils.text import slugify

from inference.hardware import GPU_CATALOG
from inference.hf_config import known_configs
from inference.profile import knob_type, launch_knobs
from portal.core.forms import choice_field, model_choice_field
from portal.inventory.models import Node
from portal.registry.models import ModelVersion

from .models import DeploymentProfile, Dtype

# GPUs on which vLLM should run eager (no CUDA graphs): the planner's `eager_off_on_volta` rule.
EAGER_GPUS = tuple(key for key, spec in GPU_CATALOG.items() if spec.is_volta)


def _model_choices() -> list[tuple[str, list[tuple[str, str]]]]:
    from portal.registry.selectors import model_versions_listed

    registered = [(m.name, m.name) for m in model_versions_listed().only("name")]
    # Node acceptance's random-weight reference models come last: never the planner's default.
    acceptance = [(m.name, m.name) for m in model_versions_listed(acceptance=True).only("name")]
    # A registered name wins over a bundled config of the same name (resolve_model does the same).
    names = {name for name, _ in registered + acceptance}
    bundled = [(name, f"{name} (bundled config)") for name in sorted(known_configs()) if name not in names]
    groups = [("Registered", registered), ("Bundled configs", bundled)]
    if acceptance:
        groups.append(("Node acceptance reference models", acceptance))
    return groups


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
        choice_field(self, "model").choices = _model_choices()
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
        kinds = {spec.name: knob_type(spec)[0] for spec, _ in launch_knobs()}
        for name in self.SETTINGS_FIELDS:
            value = data[name]
            if name == "tensor_parallel_size" or value is None or value == "" or value is False:
                continue
            # The admin reads any non-empty value of a checkbox as checked: name only those that are on.
            query[name] = "on" if kinds[name] == "bool" else value
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


# A node has at most this many GPUs (nvidia-smi indices 0 … 63): bounds what the GPU field parses.
MAX_GPU_INDEX = 63


def parse_gpu_indices(text: str) -> list[int]:
    """`0-3`, `0,2`, `0-1, 4, 6-7` or blank (a CPU node) → sorted indices; a clear error otherwise."""
    text = (text or "").strip()
    if text.startswith("[") and text.endswith("]"):  # what the API and the old form took: [0, 1]
        text = text[1:-1]
    indices: list[int] = []
    for part in (p.strip() for p in text.replace(" ", ",").split(",")):
        if not part:
            continue
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise forms.ValidationError(
                f"'{part[:20]}' is not a GPU index or range: write them like 0-3 or 0,2 (blank: no GPU)"
            ) from None
        if not 0 <= first <= last <= MAX_GPU_INDEX:
            raise forms.ValidationError(
                f"'{part[:20]}': GPU indices run from 0 to {MAX_GPU_INDEX}, a range low to high"
            )
        indices.extend(range(first, last + 1))
    if len(set(indices)) != len(indices):
        raise forms.ValidationError("a GPU is listed twice")
    return sorted(indices)


def format_gpu_indices(indices: list[int]) -> str:
    """[0, 1, 2, 3, 6] → `0-3,6`: the form's text for stored indices."""
    runs: list[list[int]] = []
    for index in sorted(indices):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class GpuIndicesField(forms.Field):
    """GPU indices typed as ranges and lists (`0-3`, `0,2`), instead of raw JSON."""

    widget = forms.TextInput

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("required", False)
        kwargs.setdefault("label", "GPUs")
        kwargs.setdefault(
            "help_text",
            "GPU indices on the node, like 0-3 or 0,2 (as many as the profile's tensor "
            "parallel size); blank on a CPU node.",
        )
        super().__init__(**kwargs)

    def prepare_value(self, value):
        if isinstance(value, list | tuple):
            return format_gpu_indices([int(v) for v in value])
        return value

    def to_python(self, value) -> list[int]:
        if isinstance(value, list | tuple):
            return sorted(int(v) for v in value)
        return parse_gpu_indices(str(value or "")[:500])


class DeploymentCreateForm(forms.Form):
    """The portal's "Create a deployment" page (staff): placement checked by the same services as
    the API and the admin (`deployment_check`, then `deployment_create`)."""

    name = forms.SlugField(
        max_length=100, help_text="Lowercase letters, digits and dashes, e.g. search-llama-7b."
    )
    # Their querysets are set per form (__init__).
    team: forms.ModelChoiceField[Any] = forms.ModelChoiceField(
        queryset=None, help_text="Whose GPU quota it counts against."
    )
    model_version: forms.ModelChoiceField[Any] = forms.ModelChoiceField(queryset=None, label="Model version")
    profile: forms.ModelChoiceField[Any] = forms.ModelChoiceField(
        queryset=None, help_text="The vLLM settings it starts with."
    )
    node: forms.ModelChoiceField[Any] = forms.ModelChoiceField(queryset=None)
    gpu_indices = GpuIndicesField()
    gpu_boxes = forms.TypedMultipleChoiceField(
        coerce=int,
        required=False,
        label="or tick the GPUs",
        widget=forms.CheckboxSelectMultiple,
    )
    desired_state = forms.ChoiceField(
        label="Desired state",
        choices=[("running", "running: start it now"), ("stopped", "stopped: create it only")],
        initial="running",
    )
    concurrency_cap = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=100_000,
        label="Gateway concurrency cap",
        help_text="In-flight requests the gateway sends it at once (blank: none).",
    )
    shared = forms.BooleanField(
        required=False, help_text="Every team's keys may call it (else its team's only)."
    )

    def __init__(self, *args, **kwargs) -> None:
        from portal.teams.models import Team

        from .models import DeploymentProfile

        super().__init__(*args, **kwargs)
        from portal.inventory.models import ACCEPTANCE_TEAM_SLUG
        from portal.registry.selectors import acceptance_model_q

        # Node acceptance's team, reference models and profiles are its own: not offered here.
        teams = Team.objects.exclude(slug=ACCEPTANCE_TEAM_SLUG).order_by("name")
        model_choice_field(self, "team").queryset = teams
        model_choice_field(self, "model_version").queryset = (
            ModelVersion.objects.filter(external=False).exclude(acceptance_model_q()).order_by("name")
        )
        model_choice_field(self, "profile").queryset = (
            DeploymentProfile.objects.select_related("model_version")
            .exclude(acceptance_model_q("model_version__"))
            .order_by("name")
        )
        model_choice_field(self, "node").queryset = Node.objects.order_by("name")
        most = max((n.gpus.count() for n in Node.objects.prefetch_related("gpus")), default=0)
        choice_field(self, "gpu_boxes").choices = [(i, str(i)) for i in range(min(most, MAX_GPU_INDEX + 1))]
        if not most:
            del self.fields["gpu_boxes"]

    def clean_name(self) -> str:
        name = self.cleaned_data["name"]
        if name == "new":
            raise forms.ValidationError("'new' is the address of this page; choose another name.")
        return name

    def clean(self) -> dict:
        super().clean()
        cleaned = self.cleaned_data
        typed, ticked = cleaned.get("gpu_indices") or [], cleaned.get("gpu_boxes") or []
        if typed and ticked and sorted(typed) != sorted(ticked):
            self.add_error("gpu_indices", "the typed GPUs and the ticked ones differ: use one or the other")
        cleaned["gpu_indices"] = sorted(set(typed) | set(ticked))
        return cleaned

    def create_values(self) -> dict:
        """Keyword arguments for `deployment_create` from a valid form."""
        data = self.cleaned_data
        keys = ("name", "team", "model_version", "profile", "node", "gpu_indices", "desired_state")
        values = {key: data[key] for key in keys}
        values.update(concurrency_cap=data["concurrency_cap"], shared=data["shared"])
        return values
