"""HFModel(compile=...): the model's forward under torch.compile, each layer's paged
attention one opaque op. The compiled model gives the eager model's tokens and
logits through the engine (prefill chunks, decodes, forks), with no graph break and
one compiled graph."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs pagedkv[models] (transformers)")

import torch._dynamo
from pagedkv.models import ModelSupportError, load_model
from pagedkv.models import attention as attn
from pagedkv.serving import Engine, EngineConfig, SamplingParams
from serving_model import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[(5 * i + j) % 200 for j in range(6 + 11 * i)] for i in range(3)]


def _generate(model, backend: str = "torch") -> list:
    config = EngineConfig(backend=backend, max_model_len=64, max_num_batched_tokens=16)
    params = [SamplingParams(max_tokens=5, return_logits=True)] * 2
    params.append(SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=1, return_logits=True))
    return Engine(model, config).generate(PROMPTS, params)


# llama: GQA; gemma2: sliding windows and a logit soft cap; gpt-oss: attention sinks;
# deepseek-v3: MLA (absorbed, through the mla backend; its output has another layout)
@pytest.mark.parametrize(
    ("name", "backend"),
    [
        ("tiny-llama", "torch"),
        ("tiny-gemma2", "torch"),
        ("tiny-gpt-oss", "torch"),
        ("tiny-deepseek-v3", "mla"),
    ],
)
def test_a_compiled_model_equals_the_eager_one(name, backend):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = _generate(load_model(name), backend)
    compiled = _generate(load_model(name, compile="aot_eager"), backend)
    assert not torch._dynamo.utils.counters["graph_break"], "attention must stay one op"
    # prefill chunks, decode batches and single rows share one graph: the token and row
    # counts are unbacked, so nothing is compiled again for a count of 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for a, b in zip(eager, compiled, strict=True):
        for x, y in zip(a.samples, b.samples, strict=True):
            assert x.token_ids == y.token_ids
            for p, q in zip(x.logits, y.logits, strict=True):
                torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


def test_the_op_refuses_to_run_outside_a_step():
    with pytest.raises(ModelSupportError, match="outside step_context"):
        torch.ops.pagedkv.hf_attention(
            torch.zeros(1, 2, 3, 4), torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4),
            0, 4, None, None, None, False,
        )  # fmt: skip
    assert attn._steps == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's GPU kernels need CUDA")
def test_inductor_compiled_llama_replays_decode_graphs():
    """On the GPU: inductor's fused kernels inside the CUDA-graph decode steps."""

    def run(compile):
        model = load_model("tiny-llama", dtype=torch.bfloat16, device="cuda", compile=compile)
        config = EngineConfig(backend="triton", device="cuda", max_model_len=128, cuda_graph=True)
        engine = Engine(model, config)
        params = SamplingParams(max_tokens=12, return_logits=True)
        return engine, engine.generate(PROMPTS, params)

    _, eager = run(None)
    engine, compiled = run("inductor")
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    for a, b in zip(eager, compiled, strict=True):
        pairs = zip(a.samples[0].token_ids, b.samples[0].token_ids, strict=True)
        for step, (x, y) in enumerate(pairs):
            torch.testing.assert_close(
                a.samples[0].logits[step], b.samples[0].logits[step], atol=3e-2, rtol=3e-2
            )
            if x != y:  # a bf16 near tie: later steps see different tokens
                break
