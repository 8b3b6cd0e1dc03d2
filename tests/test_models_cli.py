"""``pagedkv generate``: a real generation by default; bad values exit 2 with the reason."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs pagedkv[models] (transformers)")

from pagedkv.cli import main
from serving_model import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def test_generate_prints_tokens_speed_blocks_and_hits(capsys):
    argv = ["generate", "--n", "2", "--temperature", "0.8", "--max-tokens", "5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "model tiny-llama (llama, 2 layers, random weights seed 0) on cpu, float32" in out
    assert "layers 0,1: torch" in out
    assert out.count("  sample 1 [length]") == 3  # three prompts, two samples each
    assert "30 tokens in" in out and "tokens/s" in out
    assert "prefix-cache hit rate" in out and "3 forks" in out


def test_generate_takes_token_ids_and_a_prompts_file(capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3 4\n\n5,6,7\n")
    argv = ["generate", "--token-ids", "--prompts-file", str(prompts), "--max-tokens", "3"]
    assert main([*argv, "9 9"]) == 0
    out = capsys.readouterr().out
    assert "prompt 0: '9 9' (2 tokens)" in out and "prompt 2: '5,6,7' (3 tokens)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--n", "0"], "argument --n: expected a positive integer, got '0'"),
        (["--top-p", "1.5"], "argument --top-p: expected a number in (0, 1], got '1.5'"),
        (["--temperature", "x"], "argument --temperature: expected a finite number >= 0, got 'x'"),
        (["--backend", "torch("], "argument --backend:"),
    ],
)
def test_bad_values_are_usage_errors(argv, message, capsys):
    assert main(["generate", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nope"], "pagedkv: error: --model 'nope' is neither a built-in model"),
        (["--prompts-file", "/nonexistent/p"], "--prompts-file /nonexistent/p: No such file"),
        (["--max-model-len", "16"], "leaves no room to generate within max_model_len 16"),
        (["--backend", "flashinfer"], "no usable attention backend for config 'flashinfer'"),
        (["--token-ids", "1 x"], "--token-ids: '1 x' is not a list of integers"),
    ],
)
def test_bad_setups_exit_2_with_the_reason(argv, message, capsys):
    assert main(["generate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_generate_tensor_parallel_prints_the_tp1_tokens(capfd):
    """--tp 2: two gloo processes; rank 0 prints; the tokens are the single process's."""
    argv = ["generate", "--max-tokens", "3", "--n", "2", "--temperature", "0.8"]
    assert main(argv) == 0
    single = capfd.readouterr().out
    assert main([*argv, "--tp", "2"]) == 0
    out = capfd.readouterr().out
    assert "tensor parallel over 2 ranks" in out and "2/1 heads x 64" in out

    def samples(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("  sample ")]

    assert len(samples(out)) == 6 and samples(out) == samples(single)


def test_list_models(capsys):
    assert main(["generate", "--list-models"]) == 0
    assert "tiny-deepseek-v3" in capsys.readouterr().out.split()
