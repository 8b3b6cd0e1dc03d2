"""Shared fixtures: plugin distributions built and installed during the session."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PLUGINS = Path(__file__).parent / "plugins"


def install_distribution(source: Path, target: Path) -> Path:
    """pip-install the distribution at ``source`` into ``target`` (a sys.path entry)."""
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
