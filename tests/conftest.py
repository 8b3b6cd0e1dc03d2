"""Shared fixtures: plugin distributions built and installed during the session."""

from __future__ import annotations

import os

import torch

# Triton kernels run under the interpreter on a machine without a GPU. The switch is
# read when a kernel is decorated, so it must be set before any test module imports
# triton (the compile-only checks run in subprocesses without it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PLUGINS = Path(__file__).parent / "plugins"


def install_distribution(source: Path, target: Path) -> Path:
    """pip-install the distribution at ``source`` into ``target`` (a sys.path entry).

    It is built from a copy next to ``target``: setuptools writes build/ and
    *.egg-info/ into the tree it builds, which must not be the source tree."""
    copy = target.with_name(target.name + "-src")
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    source = copy
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-compile",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    return target


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory):
    """name -> a directory holding that test plugin distribution, installed."""
    root = tmp_path_factory.mktemp("plugin-site")
    return {
        name: install_distribution(PLUGINS / name, root / name)
        for name in ("example", "broken", "duplicate")
    }


@pytest.fixture(scope="session")
def broken_backends_site(tmp_path_factory):
    """A directory holding the deliberately broken backends' distribution, installed."""
    return install_distribution(
        PLUGINS / "broken_backends", tmp_path_factory.mktemp("broken-backends") / "site"
    )
