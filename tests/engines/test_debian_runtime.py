"""The newer C/C++ runtime an engine environment gets when its vLLM's ops need it
(scripts/debian_runtime.py): nothing is used unless Debian's signature and hashes check out, and
the wrapped interpreter still runs inside its environment."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "debian"


def _load_script():
    spec = importlib.util.spec_from_file_location("debian_runtime", REPO / "scripts" / "debian_runtime.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


debian_runtime = _load_script()

needs_keyring = pytest.mark.skipif(
    not debian_runtime.KEYRING.exists(), reason="needs Debian's archive keyring (debian-archive-keyring)"
)


@needs_keyring
def test_it_reads_the_index_hash_from_the_signed_release_file():
    release = debian_runtime.verified_release((FIXTURES / "trixie-InRelease").read_bytes())

    digest = debian_runtime.index_sha256(release, "main/binary-amd64/Packages.xz")

    assert digest == "be3d7d96a040eda0505c1808cccc67f183bbc05dff0842c50f88e6c396557412"


@needs_keyring
def test_it_refuses_a_release_file_whose_signed_text_was_changed():
    signed = (FIXTURES / "trixie-InRelease").read_bytes()
    tampered = signed.replace(b"be3d7d96a040eda0505c", b"0000000000000000000c", 1)
    assert tampered != signed

    with pytest.raises(debian_runtime.RuntimeFetchError, match="did not verify"):
        debian_runtime.verified_release(tampered)


@needs_keyring
def test_text_after_the_signature_does_not_count():
    signed = (FIXTURES / "trixie-InRelease").read_bytes()
    appended = signed + b"\nSHA256:\n 00 1 main/binary-amd64/Packages.xz\n"

    release = debian_runtime.verified_release(appended)

    assert debian_runtime.index_sha256(release, "main/binary-amd64/Packages.xz").startswith("be3d7d96")


def test_it_finds_the_three_runtime_packages_in_the_index():
    index = (FIXTURES / "trixie-Packages-excerpt").read_text()

    files = debian_runtime.package_files(index, debian_runtime.PACKAGES)

    assert files["libc6"].filename == "pool/main/g/glibc/libc6_2.41-12+deb13u5_amd64.deb"
    assert files["libstdc++6"].version == "14.2.0-19"
    assert len(files["libgcc-s1"].sha256) == 64


def test_a_package_missing_from_the_index_is_named():
    index = (FIXTURES / "trixie-Packages-excerpt").read_text()

    with pytest.raises(debian_runtime.RuntimeFetchError, match="no package libfoo"):
        debian_runtime.package_files(index, ("libc6", "libfoo"))


def test_a_download_with_the_wrong_hash_is_refused():
    with pytest.raises(debian_runtime.RuntimeFetchError, match="expected 00"):
        debian_runtime._checked(b"not the package", "00", "pool/x.deb")


def test_the_wrapped_interpreter_stays_in_its_environment(tmp_path):
    """The wrapper execs the same interpreter under a loader with --argv0: Python must still find the
    environment's pyvenv.cfg. The system's own loader and libraries stand in for Debian 13's here."""
    venv = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    libdir = venv / "runtime" / debian_runtime.LIBDIR
    libdir.mkdir(parents=True)
    system_loader = Path("/lib64") / debian_runtime.LOADER
    if not system_loader.exists():
        pytest.skip("no x86-64 glibc loader on this machine")
    os.symlink(system_loader, libdir / debian_runtime.LOADER)

    wrapped = debian_runtime.write_python_wrapper(venv)

    assert not wrapped.is_symlink() and wrapped.read_text().startswith("#!/bin/sh")
    for name in ("python", "python3"):
        prefix = subprocess.run(
            [str(venv / "bin" / name), "-c", "import sys; print(sys.prefix)"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert Path(prefix) == venv
    # Run again (an interrupted install), and after `python -m venv` copied the interpreter over the
    # script: the same script, and the environment still works.
    assert debian_runtime.write_python_wrapper(venv).read_text() == wrapped.read_text()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    assert debian_runtime.write_python_wrapper(venv).read_text() == wrapped.read_text()
    prefix = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sys; print(sys.prefix)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(prefix) == venv
