"""HFModel(compile=...): the model's decoder layers under torch.compile (its whole
forward when it has no list of them), each layer's paged attention one opaque op.
The compiled model gives the eager model's tokens and logits through the engine
(prefill chunks, decodes, forks), with no graph break and one compiled graph for
each kind of layer, however many layers there are."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs pagedkv[models] (transformers)")

import torch._dynamo
from pagedkv.models import (
    HFModel,
    ModelSupportError,
    builtin_config,
    load_model,
    random_model,
    reference_attention,
)
from pagedkv.models import attention as attn
from pagedkv.serving import Engine, EngineConfig, SamplingParams
from serving_model import assert_first_samples_agree, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[(5 * i + j) % 200 for j in range(6 + 11 * i)] for i in range(3)]


def _generate(model, backend: str = "torch", device: str = "cpu") -> list:
    # eager decode steps on a GPU too: the subject is the compiled layers (decode graphs
    # are test_serving_graphs'), and DeepSeek-V3's MoE (torch._grouped_mm) copies from
    # the host, which a CUDA-graph capture refuses
    config = EngineConfig(
        backend=backend,
        device=device,
        max_model_len=64,
        max_num_batched_tokens=16,
        cuda_graph=False,
    )
    params = [SamplingParams(max_tokens=5, return_logits=True)] * 2
    params.append(SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=1, return_logits=True))
    return Engine(model, config).generate(PROMPTS, params)


def _assert_same(eager: list, compiled: list) -> None:
    for a, b in zip(eager, compiled, strict=True):
        for x, y in zip(a.samples, b.samples, strict=True):
            assert x.token_ids == y.token_ids
            for p, q in zip(x.logits, y.logits, strict=True):
                torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


def _counting_compiles() -> dict:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch._dynamo.utils.counters


# llama: GQA; gemma2: sliding windows and a logit soft cap; gpt-oss: attention sinks;
# deepseek-v3: MLA (absorbed, through the mla backend; its output has another layout).
# graphs: prefill chunks, decode batches and single rows share one graph per kind of
# layer (the token counts are unbacked, so a count of 1 compiles nothing new); gemma2
# and gpt-oss alternate sliding and global layers, whose window is a constant of the
# compiled code (the op checks it against the layer's spec), deepseek-v3's first layer
# is dense and its second MoE: two kinds of layer, two graphs
@pytest.mark.parametrize(
    ("name", "backend", "graphs"),
    [
        ("tiny-llama", "torch", 1),
        ("tiny-gemma2", "torch", 2),
        ("tiny-gpt-oss", "torch", 2),
        ("tiny-deepseek-v3", "mla", 2),
    ],
)
def test_a_compiled_model_equals_the_eager_one(name, backend, graphs):
    # on a GPU host the Triton kernels (mla) run on the GPU: its CPU needs the
    # interpreter, which is off there
    device = "cuda" if torch.cuda.is_available() else "cpu"
    counters = _counting_compiles()
    eager = _generate(load_model(name, device=device), backend, device)
    model = load_model(name, device=device, compile="aot_eager")
    assert model.compiled_layers is model.model.model.layers
    compiled = _generate(model, backend, device)
    assert not counters["graph_break"], "attention must stay one op"
    assert counters["stats"]["unique_graphs"] == graphs
    _assert_same(eager, compiled)


def test_compiled_layers_share_their_code_however_deep():
    """Regional compilation: a 4-layer Llama compiles what a 2-layer one does, once
    (the layer index is an input of the graph, not a constant)."""

    def compiled_calls(num_layers: int) -> tuple[int, int]:
        counters = _counting_compiles()
        config = builtin_config("tiny-llama")
        config.num_hidden_layers = num_layers
        model = random_model(config, dtype=torch.float32, device="cpu", seed=0)
        engine = Engine(HFModel(model, compile="aot_eager"), EngineConfig(backend="torch"))
        engine.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
        return counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]

    two_layers = compiled_calls(2)
    assert two_layers[0] == 1
    assert compiled_calls(4) == two_layers


def test_a_model_without_a_layer_list_compiles_its_whole_forward():
    def without_layer_list(compile: str | None) -> HFModel:
        model = random_model(
            builtin_config("tiny-llama"), dtype=torch.float32, device="cpu", seed=0
        )
        model.model.layers = torch.nn.Sequential(*model.model.layers)  # not a ModuleList
        return HFModel(model, compile=compile)

    counters = _counting_compiles()
    eager = _generate(without_layer_list(None))
    model = without_layer_list("aot_eager")
    assert model.compiled_layers is None
    compiled = _generate(model)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1
    _assert_same(eager, compiled)


def test_before_torch_2_5_the_whole_forward_is_compiled(monkeypatch):
    """Before torch 2.5 dynamo did not inline modules, so each layer would compile its
    own graph: the whole forward is compiled instead."""
    monkeypatch.setattr(torch, "__version__", "2.4.1+cpu")
    counters = _counting_compiles()
    model = load_model("tiny-llama", compile="aot_eager")
    assert model.compiled_layers is None
    _generate(model)
    assert counters["stats"]["unique_graphs"] == 1


def test_hf_attention_on_a_compiled_model_runs_the_layers_eagerly():
    """The compiled layers serve pagedkv's steps only: HF's own attention (e.g. its
    generate as a reference) neither compiles them nor runs their compiled code."""
    counters = _counting_compiles()
    compiled, eager = load_model("tiny-llama", compile="aot_eager"), load_model("tiny-llama")
    ids = torch.tensor([PROMPTS[1]])
    with reference_attention(compiled) as a, reference_attention(eager) as b:
        torch.testing.assert_close(a(ids, use_cache=False).logits, b(ids, use_cache=False).logits)
    assert not counters["frames"]


def test_the_op_refuses_to_run_outside_a_step():
    with pytest.raises(ModelSupportError, match="outside step_context"):
        torch.ops.pagedkv.hf_attention(
            torch.zeros(3, 2, 4), torch.zeros(3, 1, 4), torch.zeros(3, 1, 4),
            torch.tensor(0), 4, None, None, None, False,
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
    assert_first_samples_agree(eager, compiled, atol=3e-2, rtol=3e-2)
