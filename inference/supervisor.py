"""Start, check and stop one inference server process on this machine.

What a node agent does with a vLLM (or simulator) server, as plain functions:

- `launch` starts the argv in its own session (so its process group holds the
  API server *and* the engine processes vLLM forks: `VLLM::EngineCore`,
  `VLLM::Worker`), with `CUDA_VISIBLE_DEVICES` set and stdout/stderr to a log file;
- `wait_until_ready` polls `/health` and `/v1/models` until the served model is
  listed, the process dies, or a deadline passes;
- `warm_up` and `smoke_test` send the first requests (docs/v100-field-guide.md#operating-habits: a bf16
  checkpoint on V100 produced garbage with no error, so a start is not done
  until a fixed prompt gets a sane reply);
- `stop_group` sends SIGTERM to the group, SIGKILL after a grace period, and
  returns only when no process of the group is left (zombies included);
- `check_health`, `scrape_metrics` and `group_rss_mb` are what supervision reads.

The server's log file (rotation, tail) is inference/server_log.py; when to restart a server is
inference/restart_policy.py. Nothing here knows about Django; the portal stores what these return.
Linux only: process groups are read from /proc.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from inference.vllm_metrics import VllmMetrics, parse_vllm_metrics

SMOKE_PROMPT = "Say hello in one short sentence."
# The environment variable vLLM (and inference.sim) read their API key from; never an argv flag,
# which `ps`, the deployment's command line and the server log would show.
API_KEY_ENV = "VLLM_API_KEY"
WARM_UP_PROMPT = "Hello"


@dataclass
class Launched:
    pid: int
    pgid: int
    log_path: str
    # Only in the process that launched it: poll() reaps the child and keeps its exit code.
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)
    identity: ProcessIdentity | None = None


class ServerExited(RuntimeError):
    """The server process ended while we were waiting for it."""

    def __init__(self, returncode: int | None) -> None:
        self.returncode = returncode
        super().__init__(f"the server process exited (code {returncode})")


class NotReady(RuntimeError):
    """The server did not become ready before the deadline."""


class SmokeTestFailed(RuntimeError):
    pass


# --- Ports --------------------------------------------------------------------


def port_is_free(host: str, port: int) -> bool:
    """Whether a listening socket could bind host:port now (what vLLM will try)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # vLLM's own socket sets SO_REUSEADDR, so TIME_WAIT leftovers of a stopped
        # server do not count as taken; a live listener does.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free now (another process may still take it before vLLM binds;
    the startup classifier reports that as `address_in_use`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def wait_port_free(host: str, port: int, *, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if port_is_free(host, port):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


# --- Processes ----------------------------------------------------------------


def launch(
    argv: Sequence[str],
    *,
    log_path: str | Path,
    cuda_visible_devices: str,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    api_key: str = "",
) -> Launched:
    """Start argv in a new session (its own process group), output appended to log_path.

    `api_key` reaches the server as `VLLM_API_KEY` in its environment only (vLLM and the
    simulator then refuse `/v1/*` without `Authorization: Bearer <key>`).
    Raises FileNotFoundError / PermissionError when the executable cannot run.
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    child_env = {**(env if env is not None else os.environ)}
    # An empty CUDA_VISIBLE_DEVICES hides every GPU (right for a CPU node);
    # leaving it unset would expose all of them.
    child_env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    # Never inherit the agent's own key: the server gets exactly the deployment's.
    child_env.pop(API_KEY_ENV, None)
    if api_key:
        child_env[API_KEY_ENV] = api_key
    with open(log_path, "ab") as log:
        process = subprocess.Popen(  # noqa: S603 - argv built by vllm_args, never a shell
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
        )
    return Launched(
        pid=process.pid,
        pgid=process.pid,
        log_path=str(log_path),
        process=process,
        identity=_identity_after_exec(process.pid),
    )


def _identity_after_exec(pid: int, wait_s: float = 2.0) -> ProcessIdentity | None:
    """The new process's identity once its command line is readable.

    Popen returns when the child's exec has released the parent (vfork), which is before the
    kernel has laid out the new program's arguments: /proc/<pid>/cmdline reads empty for that
    moment, and an identity without its command line cannot tell a reused pid apart.
    """
    deadline = time.monotonic() + wait_s
    identity = process_identity(pid)
    while identity is not None and not identity.cmdline and time.monotonic() < deadline:
        time.sleep(0.005)
        identity = process_identity(pid)
    return identity


@dataclass(frozen=True)
class ProcessIdentity:
    """Which process a recorded pid was: the boot it ran in, its start time and command line.

    After a reboot (or once the process is gone) the same number may belong to an unrelated
    process, or lead an unrelated process group; signalling the recorded pid or pgid then hits a
    stranger. `start_ticks` is field 22 of /proc/<pid>/stat (clock ticks after boot): within one
    boot, pid + start time name one process.
    """

    boot_id: str
    start_ticks: int
    cmdline: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"boot_id": self.boot_id, "start_ticks": self.start_ticks, "cmdline": list(self.cmdline)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ProcessIdentity | None:
        if not data:
            return None
        try:
            return cls(str(data["boot_id"]), int(data["start_ticks"]), tuple(data.get("cmdline") or ()))
        except (KeyError, TypeError, ValueError):
            return None


def boot_id() -> str:
    """This boot's random id (changes with every reboot)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_identity(pid: int | None) -> ProcessIdentity | None:
    """The identity of a running pid (None when it is gone or unreadable)."""
    if not pid:
        return None
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rfind(")") + 2 :].split()  # fields[0] is field 3 (state)
    args = tuple(part.decode("utf-8", errors="replace") for part in cmdline.split(b"\0") if part)
    return ProcessIdentity(boot_id=boot_id(), start_ticks=int(fields[19]), cmdline=args)


def is_same_process(pid: int | None, identity: ProcessIdentity) -> bool:
    """Whether pid is still the process `identity` describes: same boot and start time.

    Within a known boot those two name one process, whatever its command line says now: a
    server may retitle itself (vLLM's setproctitle), and taking it for a stranger would start
    a second server next to it. Without a boot id (/proc/sys/kernel/random/boot_id unreadable)
    a start time may repeat across reboots, so the command line must match too (a zombie's is
    empty and is not compared).
    """
    current = process_identity(pid)
    if current is None or current.boot_id != identity.boot_id or current.start_ticks != identity.start_ticks:
        return False
    if identity.boot_id:
        return True
    return not (current.cmdline and identity.cmdline) or current.cmdline == identity.cmdline


def group_is_ours(pgid: int | None, identity: ProcessIdentity | None) -> bool:
    """Whether process group `pgid` is still the one launched with leader `identity`.

    No identity (recorded before identities were) cannot be checked and counts as ours.
    Another boot: nothing of ours survives a reboot. Same boot, leader gone: the kernel does not
    give a number to a new process while a group of that number has members, so the members
    left are the group we launched (an engine process that outlived its API server).
    """
    if not pgid:
        return False
    if identity is None:
        return True
    if identity.boot_id != boot_id():
        return False
    if process_identity(pgid) is None:
        return True
    return is_same_process(pgid, identity)


def _reap(pid: int) -> None:
    """Collect the exit status of our own child so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of a pid from /proc, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[2])


def process_alive(pid: int | None, identity: ProcessIdentity | None = None) -> bool:
    """Whether pid runs (a zombie counts as dead) and, given its identity, is still that process."""
    if not pid:
        return False
    _reap(pid)
    stat = _proc_stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    return identity is None or is_same_process(pid, identity)


def group_members(pgid: int | None, identity: ProcessIdentity | None = None) -> list[int]:
    """Live (non-zombie) pids whose process group is pgid (none when it is another group now)."""
    if not pgid:
        return []
    _reap(pgid)
    if not group_is_ours(pgid, identity):
        return []
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if stat is not None and stat[1] == pgid and stat[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def group_alive(pgid: int | None, identity: ProcessIdentity | None = None) -> bool:
    return bool(group_members(pgid, identity))


def group_rss_mb(pgid: int | None, identity: ProcessIdentity | None = None) -> float | None:
    """Resident memory of the whole group (API server + engine processes), MiB."""
    members = group_members(pgid, identity)
    if not members:
        return None
    total_kib = 0
    for pid in members:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
                    break
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total_kib / 1024


@dataclass(frozen=True)
class StopResult:
    signal: str  # "none" (nothing ran), "SIGTERM" or "SIGKILL"
    seconds: float
    gone: bool


def stop_group(
    pgid: int | None,
    *,
    grace_s: float = 30.0,
    kill_wait_s: float = 15.0,
    identity: ProcessIdentity | None = None,
) -> StopResult:
    """SIGTERM the group, SIGKILL it after `grace_s`, and wait until no member is left.

    Given the leader's `identity`, a group that is no longer the one launched (a reboot, a
    reused number) is left alone and reported gone: it is not ours to signal.
    """
    started = time.monotonic()
    if pgid is None or not group_alive(pgid, identity):
        return StopResult(signal="none", seconds=0.0, gone=True)
    _signal_group(pgid, signal.SIGTERM)
    if _wait_group_gone(pgid, grace_s, identity):
        return StopResult(signal="SIGTERM", seconds=time.monotonic() - started, gone=True)
    if group_alive(pgid, identity):  # checked again right before the signal
        _signal_group(pgid, signal.SIGKILL)
    gone = _wait_group_gone(pgid, kill_wait_s, identity)
    return StopResult(signal="SIGKILL", seconds=time.monotonic() - started, gone=gone)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _wait_group_gone(pgid: int, timeout_s: float, identity: ProcessIdentity | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid, identity):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


# --- HTTP -----------------------------------------------------------------------


def auth_headers(api_key: str) -> dict[str, str]:
    """The header a server started with `VLLM_API_KEY` wants (none when it has no key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def check_health(base_url: str, *, timeout_s: float = 5.0, api_key: str = "") -> bool:
    """vLLM's `/health` answers 200 with an empty body when the engine is alive."""
    try:
        response = httpx.get(f"{base_url}/health", timeout=timeout_s, headers=auth_headers(api_key))
        return response.status_code == 200
    except httpx.HTTPError:
        return False


def served_models(base_url: str, *, timeout_s: float = 5.0, api_key: str = "") -> list[str] | None:
    cards = served_model_cards(base_url, timeout_s=timeout_s, api_key=api_key)
    return None if cards is None else [card["id"] for card in cards]


def served_model_cards(
    base_url: str, *, timeout_s: float = 5.0, api_key: str = ""
) -> list[dict[str, Any]] | None:
    """`/v1/models`'s entries as {"id", "max_model_len", "root"}; None when the server does not answer.

    vLLM adds `max_model_len` and `root` (the path or hub id it loaded) to OpenAI's model card.
    """
    try:
        response = httpx.get(f"{base_url}/v1/models", timeout=timeout_s, headers=auth_headers(api_key))
        if response.status_code != 200:
            return None
        cards = []
        for entry in response.json().get("data", []):
            length = entry.get("max_model_len")
            cards.append(
                {
                    "id": str(entry["id"]),
                    "max_model_len": length if isinstance(length, int) and length > 0 else None,
                    "root": entry.get("root") if isinstance(entry.get("root"), str) else None,
                }
            )
        return cards
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


def refuses_key(base_url: str, *, api_key: str = "", timeout_s: float = 5.0) -> bool:
    """Whether the server turns our key (or its absence) away on /v1 (HTTP 401/403).

    /health and /metrics stay open on vLLM whatever its key, so they cannot tell."""
    try:
        response = httpx.get(f"{base_url}/v1/models", timeout=timeout_s, headers=auth_headers(api_key))
    except httpx.HTTPError:
        return False
    return response.status_code in (401, 403)


def scrape_metrics(base_url: str, *, timeout_s: float = 5.0, api_key: str = "") -> VllmMetrics | None:
    try:
        response = httpx.get(f"{base_url}/metrics", timeout=timeout_s, headers=auth_headers(api_key))
        if response.status_code != 200:
            return None
        return parse_vllm_metrics(response.text)
    except (httpx.HTTPError, ValueError):
        return None


def wait_until_ready(
    base_url: str,
    model: str,
    *,
    deadline_s: float,
    alive: Callable[[], bool],
    returncode: Callable[[], int | None] = lambda: None,
    on_health: Callable[[], None] | None = None,
    keep_going: Callable[[], None] | None = None,
    interval_s: float = 0.5,
    api_key: str = "",
) -> None:
    """Poll `/health`, then `/v1/models` until `model` is listed.

    Raises ServerExited as soon as the process is gone (no point waiting out the
    deadline for a server that crashed), NotReady at the deadline. `on_health` is
    called once when /health first answers; `keep_going` on every poll (the
    caller renews its lease there and may raise to abandon the wait).
    """
    deadline = time.monotonic() + deadline_s
    healthy = False
    while True:
        if keep_going is not None:
            keep_going()
        if not alive():
            raise ServerExited(returncode())
        if not healthy and check_health(base_url, timeout_s=2.0, api_key=api_key):
            healthy = True
            if on_health is not None:
                on_health()
        if healthy:
            models = served_models(base_url, timeout_s=2.0, api_key=api_key)
            if models is not None and model in models:
                return
        if time.monotonic() >= deadline:
            what = "/v1/models to list the model" if healthy else "/health"
            raise NotReady(f"no answer from {what} within {deadline_s:.0f} s")
        time.sleep(interval_s)


def _chat(
    base_url: str, model: str, prompt: str, *, max_tokens: int, timeout_s: float, api_key: str = ""
) -> str:
    """One non-streamed chat completion; falls back to /v1/completions when the
    model has no chat template (vLLM answers 400 for chat then)."""
    response = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        timeout=timeout_s,
        headers=auth_headers(api_key),
    )
    if response.status_code == 400 and "chat template" in response.text.lower():
        response = httpx.post(
            f"{base_url}/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
            timeout=timeout_s,
            headers=auth_headers(api_key),
        )
        response.raise_for_status()
        return _text(response.json(), chat=False)
    response.raise_for_status()
    return _text(response.json(), chat=True)


def _text(body: object, *, chat: bool) -> str:
    try:
        choice = body["choices"][0]  # type: ignore[index]
        text = choice["message"]["content"] if chat else choice["text"]
    except (KeyError, IndexError, TypeError) as error:
        raise SmokeTestFailed(f"malformed reply: {str(body)[:200]}") from error
    if not isinstance(text, str):
        raise SmokeTestFailed(f"malformed reply: content is {type(text).__name__}")
    return text


def warm_up(base_url: str, model: str, *, timeout_s: float = 120.0, api_key: str = "") -> float:
    """One throwaway request (the first one pays for lazy initialisation); returns seconds."""
    started = time.monotonic()
    try:
        _chat(base_url, model, WARM_UP_PROMPT, max_tokens=4, timeout_s=timeout_s, api_key=api_key)
    except (httpx.HTTPError, SmokeTestFailed) as error:
        raise SmokeTestFailed(f"warm-up request failed: {error}") from error
    return time.monotonic() - started


def smoke_test(
    base_url: str, model: str, *, expected_substring: str = "", timeout_s: float = 60.0, api_key: str = ""
) -> str:
    """A fixed prompt; the reply must be well-formed, non-empty and contain the expected text.

    Returns the reply. Raises SmokeTestFailed saying what was wrong.
    """
    try:
        reply = _chat(base_url, model, SMOKE_PROMPT, max_tokens=16, timeout_s=timeout_s, api_key=api_key)
    except httpx.HTTPStatusError as error:
        raise SmokeTestFailed(
            f"smoke test got HTTP {error.response.status_code}: {error.response.text[:200]}"
        ) from error
    except httpx.HTTPError as error:
        raise SmokeTestFailed(f"smoke test request failed: {error}") from error
    if not reply.strip():
        raise SmokeTestFailed("smoke test reply is empty")
    if expected_substring and expected_substring.lower() not in reply.lower():
        raise SmokeTestFailed(f"smoke test reply lacks {expected_substring!r}: {reply[:200]!r}")
    return reply
