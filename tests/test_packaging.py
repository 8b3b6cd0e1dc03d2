"""A normal wheel carries every package under its import name, and the entry points."""

from __future__ import annotations

import configparser
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    return zipfile.ZipFile(next(out.glob("pagedkv-*.whl")))


def test_every_source_module_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    mapping = {
        "core": "pagedkv",
        "backends": "pagedkv/backends",
        "conformance": "pagedkv/conformance",
    }
    for folder, package in mapping.items():
        for source in (ROOT / folder).rglob("*.py"):
            inside = f"{package}/{source.relative_to(ROOT / folder).as_posix()}"
            assert inside in names, f"{source.relative_to(ROOT)} missing from the wheel as {inside}"
    for config in (ROOT / "core" / "models" / "configs").glob("*.json"):  # package data
        assert f"pagedkv/models/configs/{config.name}" in names, f"{config.name} not in the wheel"


def test_entry_points(wheel):
    text = next(wheel.read(n).decode() for n in wheel.namelist() if n.endswith("entry_points.txt"))
    parser = configparser.ConfigParser()
    parser.read_string(text)
    backends = set(parser["pagedkv"])
    assert {"torch", "triton", "flashinfer", "flash_attn", "pallas", "mla"} <= backends
    for name in backends:
        assert parser["pagedkv"][name] == f"pagedkv.backends.{name}"
    assert parser["pytest11"]["pagedkv"] == "pagedkv.conformance.plugin"
    assert parser["console_scripts"]["pagedkv"] == "pagedkv.cli:main"


def test_the_pytest_plugin_imports_without_torch():
    # loaded into every pytest run of an environment holding pagedkv: it must stay cheap
    code = "import sys, pagedkv.conformance.plugin, pagedkv; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
