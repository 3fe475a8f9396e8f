"""A deployment profile → the argv of `python -m vllm.entrypoints.openai.api_server`.

One function builds the flags for both engines: the real vLLM and the simulator
(`python -m inference.sim`), which accepts the same flags plus `--hardware`.
The portal owns where a server listens and what it serves (`--model`,
`--served-model-name`, `--host`, `--port`), so a profile's free-form extras may
not set those; everything else in the extras is passed through unchanged, after
the profile's own flags (argparse keeps the last value, so an extra wins).

Flags are written only where they say something: a value equal to vLLM's own
default is still written when it matters on V100 (dtype, eager mode), because
vLLM's defaults changed across versions and the command line on the deployment
page should read as the whole launch recipe.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from inference.engines import engine_line
from inference.errors import InputError
from inference.profile import Knob, ProfileSettings, Write, knob_type, launch_knobs

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
SIM_MODULE = "inference.sim"

# Flags the portal sets itself; an extra arg naming one would silently move the
# server away from the port and model the portal routes to (--model, --served-model-name,
# --host, --port), open the API key the gateway holds (--api-key), drop or replace the engine
# guard (--middleware), or move every route under a prefix the gateway does not use (--root-path).
RESERVED_FLAGS = frozenset(
    {
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--hardware",
        "--api-key",
        "--middleware",
        "--root-path",
    }
)
# vLLM's own default for --swap-space (GiB) in the versions that had the flag.
# Newer vLLM (V1 engine only, e.g. 0.32) removed it: the flag is written only
# when a profile asks for something else, and the startup classifier explains
# the "unrecognized arguments" error on a vLLM that no longer knows it.
VLLM_DEFAULT_SWAP_SPACE_GB = 4.0


@dataclass(frozen=True)
class ServerArgs:
    """Where the server reads its model and listens."""

    model_path: str
    served_model_name: str
    host: str
    port: int


@dataclass(frozen=True)
class LaunchSettings:
    """Everything a deployment's server is launched with, checked: the profile's knobs, its free-form
    extras and the node's engine version ("" for the simulator, which takes the newest line's flags).

    A deployment's is built in one place (`portal.deployments.launch.launch_settings`). One that
    exists can be launched: construction refuses an extra that sets a flag the portal owns, and a
    knob the engine version's parser lacks (InputError, field "extra_args" or "profile"), rather
    than vLLM's "unrecognized arguments" after launch.
    """

    profile: ProfileSettings = field(default_factory=ProfileSettings)
    extra_args: tuple[str, ...] = ()
    engine_version: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        check_extra_args(self.extra_args)
        problems = version_problems(self.profile, self.engine_version)
        if problems:
            raise InputError("profile", "; ".join(problems))


def vllm_args(launch: LaunchSettings, server: ServerArgs) -> list[str]:
    """The flags after `-m vllm.entrypoints.openai.api_server` (or `-m inference.sim`): where the
    server listens and what it serves, every knob as its Knob says, then the profile's extras."""
    if not 0 < server.port < 65536:
        raise InputError("port", f"must be 1..65535, got {server.port}")
    return _server_args(server) + knob_args(launch.profile) + list(launch.extra_args)


def _server_args(server: ServerArgs) -> list[str]:
    return [
        "--model",
        server.model_path,
        "--served-model-name",
        server.served_model_name,
        "--host",
        server.host,
        "--port",
        str(server.port),
    ]


def knob_args(profile: ProfileSettings) -> list[str]:
    """Each knob's flag as its Knob.write says (inference/profile.py, ProfileSettings).

    vLLM's V1 engine turns prefix caching and chunked prefill on by default; the V0 engine had them
    off. Writing both ways makes the profile mean the same on every version: 0.8.5's parser already
    generates the --no- forms (argparse.BooleanOptionalAction for every bool field), as do later ones.
    Swap space is written only off its default: newer vLLM (V1 only, e.g. 0.32) removed the flag.
    """
    args: list[str] = []
    for spec, knob in launch_knobs():
        value = getattr(profile, spec.name)
        if knob.write is Write.BOTH_WAYS:
            args.append(knob.flag if value else "--no-" + knob.flag.removeprefix("--"))
        elif knob.write is Write.WHEN_TRUE:
            args += [knob.flag] if value else []
        elif not _left_to_vllm(knob, value, spec.default):
            args += [knob.flag, _text(value)]
    return args


def add_knob_arguments(
    parser: argparse.ArgumentParser, *, portal_defaults: bool = False, **overrides: dict[str, Any]
) -> None:
    """Every knob's flag on `parser`, `dest` the knob's name: as vLLM's own parser takes it (vLLM's
    default where it differs from the portal's), or with `portal_defaults` the profile's defaults
    (the `plan` and `simulate` commands). `overrides` by knob name replace argparse options; a
    "flags" entry replaces the option strings (`plan`'s `--tp`). What `python -m inference.sim`
    and the commands accept follows the knob list by itself."""
    for spec, knob in launch_knobs():
        kind, _ = knob_type(spec)
        default = (
            knob.engine_default if knob.engine_default is not None and not portal_defaults else spec.default
        )
        options: dict[str, Any] = {"dest": spec.name, "default": default, "help": knob.help or None}
        if knob.write is Write.BOTH_WAYS:
            options["action"] = argparse.BooleanOptionalAction
        elif knob.write is Write.WHEN_TRUE:
            options["action"] = "store_true"
        else:
            options["type"] = {"int": int, "float": float, "str": str}[kind]
            if knob.choices is not None:
                options["choices"] = knob.choices
        options |= overrides.get(spec.name, {})
        flags = options.pop("flags", (knob.flag, *knob.aliases))
        parser.add_argument(*flags, **options)


def knob_options(options: dict[str, Any]) -> dict[str, Any]:
    """The knobs' values from parsed options (a command's `options`, `vars(args)`), by name."""
    return {spec.name: options[spec.name] for spec, _ in launch_knobs()}


def settings_from_args(args: argparse.Namespace) -> ProfileSettings:
    """The knobs of parsed flags (`add_knob_arguments`); InputError for an impossible value."""
    return ProfileSettings(**knob_options(vars(args)))


def profile_flags(profile: ProfileSettings) -> list[str]:
    """The option names `vllm_args` writes for this profile (for the version check)."""
    server = ServerArgs(model_path="m", served_model_name="m", host="127.0.0.1", port=1)
    return [arg for arg in _server_args(server) + knob_args(profile) if arg.startswith("--")]


def version_problems(profile: ProfileSettings, engine_version: str) -> list[str]:
    """Why the node's vLLM cannot run this profile as written ([] when it can, or when the
    version is blank or on no line of the table: then vLLM's own parser has the last word and
    the startup classifier explains its "unrecognized arguments")."""
    line = engine_line(engine_version)
    if line is None:
        return []
    problems = []
    for flag in profile_flags(profile):
        if flag in line.flags:
            continue
        if flag == "--swap-space":
            problems.append(
                f"{line.label()} has no --swap-space (the V1 engine removed CPU swap): "
                f"leave swap space at {_number(VLLM_DEFAULT_SWAP_SPACE_GB)} GiB or run the 0.8.5 line"
            )
        else:
            problems.append(f"{line.label()} does not accept {flag}")
    return problems


def normalise_flag(arg: str) -> str:
    """The option an argument names, as vLLM's parser reads it: "--served_model_name=x" →
    "--served-model-name", "--hos" → "--host".

    vLLM's FlexibleArgumentParser turns underscores into dashes in option names, and argparse
    (allow_abbrev is on in every version read, 0.8.5 to 0.32) takes an unambiguous prefix of a
    long option. A prefix of a reserved flag is read as that flag even where vLLM would find it
    ambiguous: refusing what vLLM would refuse anyway costs nothing.
    """
    if not arg.startswith("--") or len(arg) < 3:
        return arg
    flag = "--" + arg[2:].split("=", 1)[0].replace("_", "-")
    if flag in RESERVED_FLAGS:
        return flag
    matches = sorted(known for known in RESERVED_FLAGS if known.startswith(flag))
    return matches[0] if matches else flag


def check_extra_args(extra_args: Sequence[str]) -> None:
    """Refuse extras that are not strings or that set a flag the portal owns, in any spelling
    vLLM's parser accepts (underscores, `=value`, a unique prefix)."""
    for arg in extra_args:
        if not isinstance(arg, str):
            raise InputError("extra_args", f"must be strings, got {arg!r}")
        flag = normalise_flag(arg)
        if flag in RESERVED_FLAGS:
            shown = arg.split("=", 1)[0]
            named = flag if shown == flag else f"{shown} (vLLM reads it as {flag})"
            raise InputError("extra_args", f"{named} is set by the portal; remove it from the profile")


# Guards every path but /health, /metrics, /ping and /version with VLLM_API_KEY (vLLM itself
# guards only /v1, /v2, /inference and /cohere); needs the portal's code on PYTHONPATH.
VLLM_GUARD_MIDDLEWARE = "inference.vllm_guard.guard"


def vllm_command(python: str, args: Sequence[str], *, guard: bool = False) -> list[str]:
    """The real engine, from the node's vLLM environment (`guard`: with inference.vllm_guard)."""
    return [python, "-m", VLLM_MODULE, *args, *(["--middleware", VLLM_GUARD_MIDDLEWARE] if guard else [])]


def sim_command(python: str, args: Sequence[str], *, hardware: str | None) -> list[str]:
    """The simulator with the same flags, plus the catalog key of the GPUs it pretends to be."""
    command = [python, "-m", SIM_MODULE, *args]
    if hardware:
        command += ["--hardware", hardware]
    return command


def command_line(argv: Sequence[str]) -> str:
    """The argv as a shell would need it typed (for the deployment page)."""
    return shlex.join(argv)


def _number(value: float) -> str:
    """0.93 → "0.93", 4.0 → "4" (what an operator would type)."""
    return f"{value:g}"


def _left_to_vllm(knob: Knob, value: object, default: object) -> bool:
    if knob.write is Write.WHEN_SET:
        return value in (None, "")
    return knob.write is Write.UNLESS_DEFAULT and value == default


def _text(value: object) -> str:
    return _number(value) if isinstance(value, float) else str(value)
