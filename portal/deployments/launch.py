"""A deployment profile → its launch settings: the one door every caller goes through.

The planner (a profile's plan, a deployment's check), the agent's start (the argv), the benchmark
snapshot and node acceptance all read a profile's knobs through `launch_settings`; loose values
from a form or a request (no profile yet) go through `settings_from`. The knobs themselves are
listed once, in inference/profile.py's ProfileSettings (each with its vLLM flag).
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any

from inference.errors import InputError
from inference.profile import ProfileSettings
from inference.vllm_args import LaunchSettings
from portal.core.errors import ApplicationError

if TYPE_CHECKING:
    from .models import DeploymentProfile


def settings_from(**values: Any) -> ProfileSettings:
    """ProfileSettings from loose values (a form, flags, a request); impossible values
    become an ApplicationError naming the field."""
    try:
        return ProfileSettings(**values)
    except InputError as error:
        raise ApplicationError.from_input_error(error) from error


def launch_settings(profile: DeploymentProfile, *, engine_version: str = "") -> LaunchSettings:
    """The profile's knobs, extras and (given the node's vLLM version) what that version accepts,
    checked: an ApplicationError naming the field otherwise ("profile" for a flag the version
    lacks, "extra_args" for one the portal owns). Blank quantization in the row means none."""
    values = {spec.name: getattr(profile, spec.name) for spec in fields(ProfileSettings)}
    values["quantization"] = values["quantization"] or None
    try:
        return LaunchSettings(
            profile=ProfileSettings(**values),
            extra_args=tuple(profile.extra_args or ()),
            engine_version=engine_version,
        )
    except InputError as error:
        raise ApplicationError.from_input_error(error) from error


def knob_values(profile: DeploymentProfile) -> dict[str, Any]:
    """The profile's knobs by name (for a snapshot or a simulator sweep)."""
    return asdict(launch_settings(profile).profile)
