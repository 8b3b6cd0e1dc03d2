"""Exit status: a requested backend that cannot be tested fails the run (with the
reason), in ``pytest conformance/``, ``pytest --pyargs pagedkv.conformance`` and
``pagedkv conform``, unless unavailable backends are allowed (matrix jobs). The
plugin is a real installed distribution whose import fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pagedkv.cli import main
from pagedkv.conformance.run import ConformanceRun, ConformanceUsageError

ROOT = Path(__file__).resolve().parents[1]
# the reason names what the plugin failed to import (the registry words the rest)
REASON = r"[^\n]*No module named 'pagedkv_kernel_library_that_does_not_exist'"


def _run(args: list[str], site: Path | None, cwd: Path, timeout: int = 300):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PAGEDKV_PLUGINS", "PAGEDKV_BACKEND", "PYTEST_ADDOPTS", "PYTHONPATH")
    }
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def broken_site(plugin_site) -> Path:
    return plugin_site["broken"]


def test_pytest_pyargs_fails_a_requested_plugin_that_does_not_import(broken_site, tmp_path):
    args = ["-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "pagedkv.conformance"]
    proc = _run([*args, "--pagedkv-backend", "broken_import"], broken_site, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(
        "backend broken_import was requested but is unavailable here: " + REASON, proc.stdout
    )
    assert re.search(
        "^broken_import: REQUESTED BUT UNAVAILABLE: "
        + REASON
        + r"[^\n]*\(fails the run; --pagedkv-allow-unavailable skips it instead\)$",
        proc.stdout,
        re.M,
    )

    allowed = _run(
        [*args, "--pagedkv-backend", "broken_import", "--pagedkv-allow-unavailable"],
        broken_site,
        tmp_path,
    )
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "(skipped: unavailable backends are allowed)" in allowed.stdout


def test_pytest_conformance_fails_it_even_when_k_deselects_its_case(broken_site):
    """``pytest conformance/ --backend=...`` in the repository, as our users run it."""
    proc = _run(
        [
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "conformance/",
            "--backend=torch",
            "--backend=broken_import",
            "-k",
            "copy_blocks",
        ],
        broken_site,
        ROOT,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout  # torch's copy_blocks
    # the conformance summary counts the scenarios -k left out
    assert re.search(
        r"^torch: 0 passed, 0 failed, (\d+) deselected of \1 scenarios", proc.stdout, re.M
    )
    assert re.search("^broken_import: REQUESTED BUT UNAVAILABLE: " + REASON, proc.stdout, re.M)


def test_pagedkv_conform_fails_it_unless_allowed(broken_site, tmp_path):
    conform = ["-m", "pagedkv.cli", "conform", "--backend", "broken_import", "--device", "cpu"]
    proc = _run(conform, broken_site, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"^\[broken_import\] cannot be tested: " + REASON, proc.stdout, re.M)
    allowed = _run([*conform, "--allow-unavailable"], broken_site, tmp_path)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_a_device_this_host_lacks_is_refused(capsys):
    assert main(["conform", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv conform: error: --device 'cuda' is not usable on this host")
    assert "devices here: cpu" in err
    with pytest.raises(ConformanceUsageError, match="--device 'cuda:1' is not usable"):
        _ = ConformanceRun(["torch"], device_option="cuda:1").device


def test_an_unknown_backend_is_refused_before_running(capsys):
    assert main(["conform", "--backend", "torhc"]) == 2
    assert "unknown attention backend 'torhc'; did you mean 'torch'?" in capsys.readouterr().err


def test_pagedkv_conform_without_pytest_says_how_to_install_it(tmp_path):
    # a fresh interpreter in which pytest cannot be imported
    code = (
        "import sys\n"
        "class NoPytest:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('pytest', '_pytest'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoPytest())\n"
        "from pagedkv.cli import main\n"
        "sys.exit(main(['conform']))\n"
    )
    proc = _run(["-c", code], None, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith('install it with: pip install "pagedkv[conformance]"')


def test_the_conformance_extra_names_pytest():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(req.startswith("pytest") for req in project["optional-dependencies"]["conformance"])
