import json
import subprocess
import sys

import pagedkv
import pytest
from pagedkv.cli import main


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pagedkv {pagedkv.__version__}"


@pytest.mark.parametrize("argv", [["--version"], ["--help"], []])
def test_version_and_help_import_no_torch(argv):
    code = (
        "import sys\n"
        "from pagedkv.cli import main\n"
        f"code = main({argv!r})\n"
        "print(code, 'torch' in sys.modules, file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    expected = 2 if not argv else 0  # no command: the help, and a usage error
    assert out.stderr.split() == [str(expected), "False"]
    assert "usage: pagedkv" in out.stdout or out.stdout.startswith("pagedkv ")


def test_console_script_is_installed():
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.startswith("pagedkv ")


def test_demo_passes(capsys):
    assert main(["demo", "--backend", "torch", "--device", "cpu"]) == 0
    assert "PASS" in capsys.readouterr().out


# -- pagedkv backends --------------------------------------------------------------------


def test_backends_table(capsys):
    assert main(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["backend", "available", "devices", "dtypes"]
    assert "head size" in lines[0] and "block size" in lines[0] and "features" in lines[0]
    assert any(line.startswith("torch ") and " yes " in line for line in lines)


@pytest.mark.parametrize("columns", [80, 132])
def test_backends_fits_the_terminal_and_shows_notes(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= columns
    flat = " ".join(out.split())  # undo the wrapping
    # the reasons and the notes, in full
    assert "notes: " in flat or "\nnotes:" in out
    assert "pallas: CUDA graphs with the direct launcher (the default on CUDA)" in flat
    assert "flashinfer (pagedkv " in flat and "flashinfer-python is not installed" in flat


def test_backends_wide_and_json(capsys):
    assert main(["backends", "--wide"]) == 0
    wide = capsys.readouterr().out
    torch_line = next(line for line in wide.splitlines() if line.startswith("torch "))
    assert "(2, num_blocks, block_size, num_kv_heads, head_size)" in torch_line
    assert "alibi, fp8_kv, logits_soft_cap, non_causal, sinks, sliding_window" in torch_line
    assert main(["backends", "--json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert records["pallas"]["notes"][0].startswith("CUDA graphs with the direct launcher")
    assert records["pallas"]["capabilities"]["cuda_graph"] == "mixed"
    assert records["torch"]["capabilities"]["devices"] == ["cpu", "cuda"]
    assert records["torch"]["warnings"] == []


# -- bad values: `pagedkv: error: <what>, <what was expected>`, exit 2, nothing computed ---

MODEL = ["--num-layers", "40", "--num-kv-heads", "8", "--head-size", "128"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["capacity", *MODEL, "--head-size-v", "-128", "--kv-budget", "1"],
            "argument --head-size-v: expected a positive integer, got '-128'",
        ),
        (
            ["capacity", *MODEL, "--kv-budget", "nan"],
            "argument --kv-budget: expected a finite number > 0, got 'nan'",
        ),
        (["capacity", *MODEL, "--kv-budget", "inf"], "argument --kv-budget: expected a finite"),
        (["capacity", *MODEL, "--kv-budget", "0"], "argument --kv-budget: expected a finite"),
        (["capacity", *MODEL, "--gpu-memory", "inf"], "argument --gpu-memory: expected a finite"),
        (
            ["capacity", *MODEL, "--gpu-memory", "80", "--weights", "-5"],
            "argument --weights: expected a finite number >= 0, got '-5'",
        ),
        (
            ["capacity", *MODEL, "--gpu-memory", "80", "--weights", "5", "--overhead", "-1"],
            "argument --overhead: expected a finite number >= 0, got '-1'",
        ),
        (
            ["capacity", "--num-layers", "40", "--num-kv-heads", "0", "--head-size", "128"],
            "argument --num-kv-heads: expected a positive integer, got '0'",
        ),
        (["capacity", *MODEL, "--head-size", "-64"], "argument --head-size: expected a positive"),
        (["capacity", *MODEL, "--tp", "0"], "argument --tp: expected a positive integer"),
        (["capacity", *MODEL, "--block-size", "1.5"], "argument --block-size: expected a positive"),
        (["capacity", *MODEL, "--output-len", "100"], "--output-len needs --prompt-len"),
        (["capacity", *MODEL, "--concurrency", "8"], "--concurrency needs --prompt-len"),
        (["capacity", *MODEL, "--weights", "5"], "--weights needs --gpu-memory"),
        (
            ["capacity", *MODEL, "--kv-budget", "1", "--gpu-memory", "80"],
            "give --kv-budget or --gpu-memory, not both",
        ),
        (
            ["capacity", "--mla", *MODEL],
            "an MLA model caches one latent row per token: --num-kv-heads and --head-size-v",
        ),
        (
            ["capacity", "--model", "deepseek-v3", "--num-kv-heads", "8"],
            "an MLA model caches one latent row per token",
        ),
        (["capacity", "--model", "llama-3-8b", "--mla"], "--mla describes a model by hand"),
        (["capacity", *MODEL, "--tp", "3"], "num_kv_heads 8 is not divisible by tp_size 3"),
        (["capacity", *MODEL, "--kv-dtype", "int3"], "argument --kv-dtype: invalid choice"),
        (["simulate", "--granule", "0"], "argument --granule: expected a positive integer"),
        (["simulate", "--granule", "-64"], "argument --granule: expected a positive integer"),
        (["simulate", "--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
        (["simulate", "--pool-tokens", "0"], "argument --pool-tokens: expected a positive"),
        (["simulate", "--num-requests", "0"], "argument --num-requests: expected a positive"),
        (["simulate", "--max-model-len", "-1"], "argument --max-model-len: expected a positive"),
        (
            ["simulate", "--block-sizes", "16,-8"],
            "argument --block-sizes: expected comma-separated positive integers, got '16,-8'",
        ),
        (
            ["simulate", "--trace", "/nonexistent/trace.csv"],
            "argument --trace: expected an existing file",
        ),
        (
            ["simulate", "--pool-tokens", "100", "--max-model-len", "512", "--no-plot"],
            "cannot hold one max_model_len",
        ),
        (["demo", "--device", "gpu0"], "argument --device: expected a torch device"),
        (["demo", "--backend", "torch("], "argument --backend: malformed backend config"),
        (["backends", "--colour"], "unrecognized arguments: --colour"),
        # a prefix of an option is no option (it took --prompt '' for --prompts-file '')
        (["generate", "--prompt", ""], "unrecognized arguments: --prompt"),
        (["bench", "--backend", "torch"], "unrecognized arguments: --backend torch"),
    ],
)
def test_bad_values_are_usage_errors(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)  # simulate writes its outputs next to the prefix
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("pagedkv: error: ")
    assert message in captured.err
    assert "Traceback" not in captured.err
    assert "kv budget" not in captured.out and "contiguous" not in captured.out


def test_an_unwritable_output_is_refused_before_simulating(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    prefix = blocker / "sub" / "sim"  # its directory cannot be created: a file is in the way
    argv = ["simulate", "--num-requests", "5", "--pool-tokens", "4096", "--no-plot"]
    assert main([*argv, "--output", str(prefix)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("pagedkv: error: --output: cannot write to ")
    assert "expected a writable location" in captured.err
    assert captured.out == ""  # refused before any work
    (tmp_path / "sim.md").mkdir()
    assert main([*argv, "--output", str(tmp_path / "sim")]) == 2
    assert "expected a writable file" in capsys.readouterr().err
