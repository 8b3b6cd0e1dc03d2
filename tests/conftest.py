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


class PluginSites(dict):
    """name -> a directory holding the test plugin distribution tests/plugins/<name>,
    installed on first use (a test pays only for the distributions it uses)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        self[name] = install_distribution(PLUGINS / name, self.root / name)
        return self[name]


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory):
    """name -> a directory holding that test plugin distribution, installed."""
    return PluginSites(tmp_path_factory.mktemp("plugin-site"))


@pytest.fixture(scope="session")
def broken_backends_site(tmp_path_factory):
    """A directory holding the deliberately broken backends' distribution, installed."""
    return install_distribution(
        PLUGINS / "broken_backends", tmp_path_factory.mktemp("broken-backends") / "site"
    )
