"""CUDA-graph decode: which backends qualify, how buffers are reserved, and (on a GPU)
replays equal to eager steps."""

from __future__ import annotations

import dataclasses

import pagedkv
import pytest
import torch
from pagedkv.serving import (
    Engine,
    EngineConfig,
    EngineConfigError,
    SamplingParams,
    supports_decode_graphs,
)
from pagedkv.serving.graphs import DecodeGraphs, decode_bounds
from serving_model import TinyDecoder

# the graph path without capture runs where the triton backend runs: the GPU, or the
# CPU under Triton's interpreter (conftest sets it when there is no GPU)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_which_backends_capture_decode():
    """From the declared GraphSupport: PURE_DECODE and MIXED capture decode steps."""
    expected = {"torch": False, "pallas": True, "mla": True, "flashinfer": True}
    for name, capture in expected.items():
        assert supports_decode_graphs(pagedkv.get_backend(name)) is capture, name


def test_decode_bounds_reserve_one_token_per_sequence():
    bounds = decode_bounds(8, 32)
    assert bounds == pagedkv.GraphBounds(
        max_num_reqs=8, max_num_tokens=8, max_blocks_per_req=32, max_query_len=1
    )


def test_a_backend_without_graphs_is_refused_when_graphs_are_required():
    config = EngineConfig(backend="torch", cuda_graph=True, max_model_len=64, max_num_seqs=2)
    with pytest.raises(EngineConfigError, match="has no decode CUDA-graph support"):
        Engine(TinyDecoder(head_size=32), config)


class _RecordingModel:
    """Forwards to a model and records the tensors of each call."""

    def __init__(self, model: TinyDecoder) -> None:
        self.model = model
        self.calls: list[tuple[torch.Tensor, ...]] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.model, name)

    def forward(self, input_ids, positions, rows, attention):
        self.calls.append((input_ids, positions, rows))
        return self.model.forward(input_ids, positions, rows, attention)


def test_replays_read_only_tensors_the_graph_holds():
    """A CUDA graph replays the addresses it captured: every tensor its forward read
    must be held by the DecodeGraph, and a replay reads exactly those (a temporary
    made at capture and dropped would be freed memory at replay, as the rows of the
    logits once were: a device-side index assert on the H200)."""
    model = _RecordingModel(TinyDecoder(head_size=32).to(DEVICE))
    config = EngineConfig(
        backend="triton", device=DEVICE, cuda_graph=False, max_model_len=64, max_num_seqs=2
    )
    engine = Engine(model.model, config)
    graphs = DecodeGraphs(model, engine.runner.kv, (2,), config.max_blocks_per_seq, capture=False)
    graph = graphs.graphs[2]
    captured = model.calls[-1]
    held = (graph.input_ids, graph.positions, graph.rows)
    assert all(a is b for a, b in zip(captured, held, strict=True))
    engine.runner.graphs = graphs
    engine.generate([[3, 1, 4], [2, 7]], [SamplingParams(max_tokens=3)] * 2)
    assert graphs.num_replays > 0
    for call in model.calls[1:]:
        assert all(a is b for a, b in zip(call, held, strict=True))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("backend", ["triton"])
def test_decode_buckets_replay_what_was_reserved(backend, async_scheduling):
    """The graph path without the CUDA graph (capture=False), on a CPU: decode steps
    run in padded buckets over the builders' reserved buffers and the metadata fixed
    at capture, and give the eager steps' tokens and logits."""
    model = TinyDecoder(head_size=32).to(DEVICE)
    prompts = [[3, 1, 4, 1, 5], list(range(20, 37)), [2, 7, 1, 8, 2, 8, 1]]
    params = [SamplingParams(max_tokens=n, return_logits=True) for n in (4, 6, 3)]
    config = EngineConfig(
        backend=backend, device=DEVICE, cuda_graph=False, max_model_len=64, max_num_seqs=4
    )
    eager = Engine(model, config).generate(prompts, params)
    engine = Engine(model, dataclasses.replace(config, async_scheduling=async_scheduling))
    runner = engine.runner
    runner.graphs = DecodeGraphs(model, runner.kv, (1, 4), config.max_blocks_per_seq, capture=False)
    replayed = engine.generate(prompts, params)
    # decodes of 3 and 3 and 2 sequences in bucket 4, then two of 1 in bucket 1
    assert runner.graphs.num_replays == 5
    for a, b in zip(eager, replayed, strict=True):
        assert a.samples[0].token_ids == b.samples[0].token_ids
        for x, y in zip(a.samples[0].logits, b.samples[0].logits, strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("backend", ["triton", "flashinfer", "flash_attn", "pallas"])
def test_graph_replays_equal_eager_steps(backend, async_scheduling):
    available, why = pagedkv.get_backend(backend).is_available()
    if not available:
        pytest.skip(f"{backend}: {why}")
    if backend in ("triton", "pallas"):
        model = TinyDecoder(head_size=32).cuda()
        tol = 1e-3
    else:  # 16-bit and head sizes from 64 only
        model = TinyDecoder(head_size=64, windows=(None,), dtype=torch.bfloat16).cuda()
        tol = 2e-2
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 17, 30, 9, 40)]
    params = SamplingParams(max_tokens=12, return_logits=True)

    def run(cuda_graph: bool, async_scheduling: bool = False) -> tuple[Engine, list]:
        config = EngineConfig(
            async_scheduling=async_scheduling,
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
    engine, graphed = run(True, async_scheduling)
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    for a, b in zip(eager, graphed, strict=True):
        assert a.samples[0].token_ids == b.samples[0].token_ids
        for x, y in zip(a.samples[0].logits, b.samples[0].logits, strict=True):
            torch.testing.assert_close(x, y, atol=tol, rtol=tol)
