"""pagedkv's pytest plugin is loaded into every pytest run of an environment holding
pagedkv: it must never break another project's options. A real second project (its
own conftest.py defining --device and --backend, and a test reading them) runs in a
subprocess next to the installed plugin."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CONFTEST = """
def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="the other project's device")
    parser.addoption("--backend", default="numpy", help="the other project's backend")
"""

TEST = """
def test_the_options_are_the_projects_own(request):
    assert request.config.getoption("--device") == "tpu:3"
    assert request.config.getoption("--backend") == "jax"
"""


@pytest.fixture(scope="module")
def other_project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("other-project")
    (root / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (root / "test_other.py").write_text(textwrap.dedent(TEST))
    return root


def _pytest(cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PAGEDKV_PLUGINS", "PAGEDKV_BACKEND")
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_another_projects_options_win_and_ours_stay_reachable(other_project):
    # --pagedkv-level parses only when pagedkv's plugin is loaded: it is, beside them
    proc = _pytest(
        other_project, "-q", "--device", "tpu:3", "--backend=jax", "--pagedkv-level=full"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


def test_the_conformance_suite_runs_in_that_project_through_namespaced_options(other_project):
    proc = _pytest(
        other_project,
        "-q",
        "--pyargs",
        "pagedkv.conformance",
        "--pagedkv-backend",
        "torch",
        "--pagedkv-device",
        "cpu",
        "--device",
        "tpu:3",
        "-k",
        "copy_blocks",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pagedkv conformance (quick level, cpu)" in proc.stdout
    assert (
        "note: --device belongs to another plugin or conftest here (it was not passed to "
        "pagedkv); pagedkv's option is --pagedkv-device" in proc.stdout
    )


def test_help_shows_their_options_and_our_namespaced_ones(other_project, tmp_path):
    theirs = _pytest(other_project, "--help").stdout
    assert "the other project's device" in theirs
    ours = _section(theirs, "pagedkv conformance:")
    assert "--pagedkv-device" in ours and "--conformance-device" in ours  # a free alias
    assert not re.search(r"^\s+--(device|backend)\b", ours, re.M)  # theirs
    alone = _section(_pytest(tmp_path, "--help").stdout, "pagedkv conformance:")
    assert "--device=DEVICE, --conformance-device=DEVICE" in alone
    assert "--backend=NAME, --conformance-backend=NAME" in alone


def _section(help_text: str, title: str) -> str:
    """One option group of ``pytest --help``: from its title to the next blank line."""
    start = help_text.index(title)
    end = help_text.find("\n\n", start)
    return help_text[start : end if end >= 0 else None]


def test_p_no_pagedkv_disables_the_plugin(other_project):
    proc = _pytest(other_project, "-q", "-p", "no:pagedkv", "--device", "tpu:3", "--backend=jax")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gone = _pytest(other_project, "-q", "-p", "no:pagedkv", "--pagedkv-level=full")
    assert gone.returncode == 4 and "unrecognized arguments: --pagedkv-level=full" in gone.stderr
