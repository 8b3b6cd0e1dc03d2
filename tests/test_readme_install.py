"""The README's "Install" and "Write a backend" sections, followed verbatim in a fresh
virtual environment on a copy of this repository: every command of their bash
blocks, then every ``run:`` step of the CI job, in order. Only the lines that
install torch are left out: the fresh environment reuses, through a .pth file, the
site-packages holding the running interpreter's torch (with pip, setuptools and
pytest), and pip may not reach an index (PIP_NO_INDEX), so whatever the commands
need must already be there or come from the copy."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SCRIPT = """#!{python}
import sys
from {module} import {attr}
sys.exit({attr}())
"""


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end]


def _blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def _without_torch_installs(script: str) -> str:
    lines = script.splitlines()
    kept = [line for line in lines if not line.startswith("pip install torch")]
    assert len(kept) < len(lines) or "pip install torch" not in script
    return "\n".join(kept)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """(a copy of the repository, the environment of a fresh venv on PATH)."""
    root = tmp_path_factory.mktemp("readme")
    repo = root / "pagedkv"
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # torch and its neighbours (numpy, pluggy, pytest, pip, setuptools: `make setup`
    # installs them together) from the running interpreter
    reused = Path(torch.__file__).resolve().parents[1]
    (Path(site) / "reused-packages.pth").write_text(f"{reused}\n")
    # the console scripts (pip, pytest, ...) pip would have written for those packages
    for dist in importlib.metadata.distributions(path=[str(reused)]):
        for ep in dist.entry_points.select(group="console_scripts"):
            script = venv / "bin" / ep.name
            if not script.exists():
                script.write_text(SCRIPT.format(python=python, module=ep.module, attr=ep.attr))
                script.chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PAGEDKV_", "PYTEST_", "PIP_")) and k not in ("PYTHONPATH",)
    }
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
        VIRTUAL_ENV=str(venv),
        PIP_NO_INDEX="1",
        PIP_NO_BUILD_ISOLATION="0",  # pip's spelling of "off": build with what is installed
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    return repo, env


def _bash(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{script}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_install_then_write_a_backend_then_its_ci_job(fresh):
    repo, env = fresh
    (install,) = _blocks(_section("Install"), "bash")
    out = _bash(_without_torch_installs(install), repo, env).stdout
    assert re.search(r"^torch\b", out, re.M)  # pagedkv backends lists the torch backend

    section = _section("Write a backend")
    (local,) = _blocks(section, "bash")
    out = _bash(local, repo, env).stdout
    assert "my_backend" in out
    summary = re.search(r"my_backend: (\d+) passed, 0 failed of (\d+) scenarios", out)
    assert summary and summary[1] == summary[2], out[-3000:]

    (job,) = _blocks(section, "yaml")
    job_env = dict(re.findall(r"^ {6}(\w+): \"(.*)\"$", job, re.M))
    steps = [m.strip() for m in re.findall(r"^ {6}- run: (.*)$", job, re.M)]
    assert job_env == {"PAGEDKV": "pagedkv[conformance]"} and len(steps) == 3
    plugin = repo.parent / "my-backend"  # the plugin's checkout, where the job runs
    _bash(_without_torch_installs("\n".join(steps)), plugin, {**env, **job_env})
    report = json.loads((plugin / "conformance.json").read_text())
    entry = report["backends"]["my_backend"]
    assert entry["available"] and entry["failed"] == 0 and entry["passed"] == entry["planned"]
