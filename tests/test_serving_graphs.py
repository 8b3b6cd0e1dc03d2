"""CUDA-graph decode: which backends qualify, how buffers are reserved, and (on a GPU)
replays equal to eager steps."""

from __future__ import annotations

from types import SimpleNamespace

import pagedkv
import pytest
import torch
from pagedkv.serving import Engine, EngineConfig, SamplingParams, supports_decode_graphs
from pagedkv.serving.graphs import reserve
from serving_model import TinyDecoder


class _Builder:
    def reserve_cuda_graph(self, *args, **kwargs):
        self.called = (args, kwargs)


def test_reserve_passes_graph_bounds_when_the_contract_has_them(monkeypatch):
    class Bounds:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    monkeypatch.setattr(pagedkv, "GraphBounds", Bounds, raising=False)
    builder = _Builder()
    reserve(builder, 8, 32)
    (bounds,), _ = builder.called
    assert bounds.kwargs == dict(
        max_num_reqs=8, max_num_tokens=8, max_blocks_per_req=32, max_query_len=1
    )


def test_reserve_without_graph_bounds_uses_the_keyword_form(monkeypatch):
    monkeypatch.setattr(pagedkv, "GraphBounds", None, raising=False)
    builder = _Builder()
    reserve(builder, 4, 16)
    assert builder.called == ((4, 4, 16), {"max_query_len": 1})


def test_which_backends_capture_decode(monkeypatch):
    monkeypatch.setattr(pagedkv, "GraphSupport", None, raising=False)
    assert not supports_decode_graphs(pagedkv.get_backend("torch"))
    assert supports_decode_graphs(pagedkv.get_backend("triton"))

    class Support:
        NEVER, PURE_DECODE = "never", "pure_decode"

    monkeypatch.setattr(pagedkv, "GraphSupport", Support, raising=False)
    for level, expected in (("never", False), ("pure_decode", True)):
        backend = SimpleNamespace(capabilities=SimpleNamespace(cuda_graph=level))
        assert supports_decode_graphs(backend) is expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("backend", ["triton"])
def test_graph_replays_equal_eager_steps(backend):
    model = TinyDecoder(head_size=32).cuda()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 17, 30, 9, 40)]
    params = SamplingParams(max_tokens=12, return_logits=True)

    def run(cuda_graph: bool) -> tuple[Engine, list]:
        config = EngineConfig(
            backend=backend,
            device="cuda",
            max_model_len=128,
            max_num_seqs=8,
            cuda_graph=cuda_graph,
            cuda_graph_batch_sizes=(1, 2, 4, 8),
        )
        engine = Engine(model, config)
        return engine, engine.generate(prompts, params)

    _, eager = run(False)
    engine, graphed = run(True)
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    for a, b in zip(eager, graphed, strict=True):
        assert a.samples[0].token_ids == b.samples[0].token_ids
        for x, y in zip(a.samples[0].logits, b.samples[0].logits, strict=True):
            torch.testing.assert_close(x, y, atol=1e-3, rtol=1e-3)
