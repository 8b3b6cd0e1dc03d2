import subprocess
import sys

import pagedkv
from pagedkv.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exit_:
        assert exit_.code == 0
    assert capsys.readouterr().out.strip() == f"pagedkv {pagedkv.__version__}"


def test_backends_table(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["backend", "available", "layout"]
    assert any(line.startswith("torch ") and " yes " in line for line in out.splitlines())


def test_demo_passes(capsys):
    assert main(["demo", "--backend", "torch", "--device", "cpu"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_console_script_is_installed():
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.startswith("pagedkv ")
