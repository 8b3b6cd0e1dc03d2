"""HFModel through the engine; the attention function's guards."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs pagedkv[models] (transformers)")

from pagedkv.conformance.models import run_model_check
from pagedkv.models import ModelSupportError, load_model, reference_attention
from pagedkv.serving import Engine, EngineConfig, SamplingParams
from serving_model import assert_first_samples_agree, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tiny_llama_matches_transformers_through_the_scheduler(async_scheduling):
    result = run_model_check("tiny-llama", "torch", async_scheduling=async_scheduling)
    assert result.passed, result.report()
    assert result.max_abs_error < 1e-4


def test_the_attention_runs_only_inside_the_engine():
    model = load_model("tiny-llama")
    with pytest.raises(ModelSupportError, match="runs inside pagedkv's engine only"):
        model.model(torch.tensor([[1, 2, 3]]), use_cache=False)
    with reference_attention(model) as hf:
        assert hf.config._attn_implementation == "eager"
        logits = hf(torch.tensor([[1, 2, 3]]), use_cache=False).logits
        assert logits.shape == (1, 3, 256)
    assert model.model.config._attn_implementation == "pagedkv"


def test_forward_refuses_another_attention_implementation():
    model = load_model("tiny-llama")
    engine = Engine(model, EngineConfig(backend="torch", max_model_len=64))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    model.model.set_attn_implementation("eager")
    with pytest.raises(ModelSupportError, match="attention implementation is 'eager'"):
        engine.step()


def test_a_spec_that_disagrees_with_the_module_is_refused():
    model = load_model("tiny-gemma2")
    engine = Engine(model, EngineConfig(backend="torch", max_model_len=64))
    engine.add_request("a", list(range(20)), SamplingParams(max_tokens=2))
    model.modules[0].sliding_window = 5  # what the module passes no longer matches its spec
    with pytest.raises(ModelSupportError, match="layer 0: sliding_window 5 but the spec has 12"):
        engine.step()


def test_a_batched_call_is_refused_with_the_layer():
    model = load_model("tiny-llama")
    engine = Engine(model, EngineConfig(backend="torch", max_model_len=64))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    batched = model._run

    def run(input_ids, positions, logits_indices, step):  # two copies of the step's tokens
        out = model.model(
            input_ids=input_ids[None].expand(2, -1),
            position_ids=positions[None].expand(2, -1),
            use_cache=False,
            pagedkv_step=step,
        )
        return out.logits[0]

    model._run = run
    try:
        with pytest.raises(ModelSupportError, match="layer 0: batch dimension 2, expected 1"):
            engine.step()
    finally:
        model._run = batched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_llama_decode_graphs_equal_eager():
    model = load_model("tiny-llama", dtype=torch.bfloat16, device="cuda")
    prompts = [[(7 * i + j) % 256 for j in range(10 + 9 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=16, return_logits=True)

    def run(cuda_graph: bool):
        config = EngineConfig(
            backend="triton", device="cuda", max_model_len=128, cuda_graph=cuda_graph
        )
        engine = Engine(model, config)
        return engine, engine.generate(prompts, params)

    _, eager = run(False)
    engine, graphed = run(True)
    assert engine.runner.graphs.num_replays > 0
    assert_first_samples_agree(eager, graphed, atol=2e-2, rtol=2e-2)


def test_docs_example_runs():
    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    namespace: dict = {}
    exec(compile(code, "docs/serving.md", "exec"), namespace)
    samples = namespace["outputs"][0].samples
    assert len(samples) == 2 and all(len(s.token_ids) == 16 for s in samples)
    assert namespace["engine"].stats.prefix_hit_rate > 0  # the two prompts share a block
