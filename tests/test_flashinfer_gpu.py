"""FlashInfer's real kernels against the float64 reference, NHD and HND, plus captured
pure-decode steps replayed on other steps (tests/graph_replay.py). Skipped without a CUDA device or without FlashInfer.

FlashInfer compiles one kernel module per (kernel family, dtypes, head size, window
on/off, soft cap on/off) on first use (~15-100 s each on the GPU host). The
scenarios are grouped so the whole file needs ten modules; layouts, page sizes,
head counts, batch shapes and causality are runtime arguments and cost nothing:

  base     fa2 fp16 d64 (decode rows) + fa3 fp16 d64 (prefill rows, auto on SM90)
  features fa2 bf16 d128 | fa2 fp16 d64 window+softcap | fa2 fp16/e4m3 d64
           | fa2 fp16/e5m2 d64 | AttentionSink fa2 fp16 d64, without and with window
  graph    reuses base's fa2 fp16 d64 and the AttentionSink fa2 fp16 d64 variant
  sinks    AttentionSink with the GPU's kernel family (fa3 on SM90), fp16 d64 and d128
"""

from __future__ import annotations

import pytest
import torch
from graph_replay import DECODE_BOUNDS, DECODE_STEPS, replay_errors
from pagedkv.backends.flashinfer.backend import FlashInferBackend
from pagedkv.conformance import Scenario, run_scenario

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
_available, _why = FlashInferBackend().is_available()
if not _available:
    pytest.skip(f"flashinfer backend unavailable: {_why}", allow_module_level=True)

MIXED = dict(seq_lens=(1, 17, 33, 64, 40, 5), query_lens=(1, 17, 5, 1, 8, 0))
BASE = [
    Scenario("mixed-padded", **MIXED, num_padding_tokens=3),
    Scenario("decode-first", seq_lens=(9, 32, 16, 40), query_lens=(1, 1, 16, 7)),
    Scenario("pure-decode-exact-pages", seq_lens=(16, 32, 48, 1), query_lens=(1, 1, 1, 1)),
    Scenario("prefill-block5", seq_lens=(23, 9), query_lens=(23, 9), block_size=5),
    Scenario("chunked-prefill-block64", seq_lens=(300, 129), query_lens=(45, 64), block_size=64),
    Scenario("gqa5", **MIXED, num_heads=10, num_kv_heads=2),
    Scenario("non-causal", seq_lens=(30, 12, 7), query_lens=(30, 12, 1), causal=False),
    # long contexts take FlashInfer's split-KV path; the pool needs 64-bit page offsets
    Scenario(
        "long-split-kv-large-pool",
        seq_lens=(4100, 3000, 2048),
        query_lens=(1, 1, 33),
        min_num_blocks=40_000,
    ),
]
FEATURES = [
    Scenario("mqa-bf16-d128", **MIXED, num_heads=8, num_kv_heads=1, head_size=128,
             dtype=torch.bfloat16),
    Scenario("window-softcap", **MIXED, sliding_window=20, logits_soft_cap=5.0),
    Scenario("window-smaller-than-block", **MIXED, sliding_window=5, logits_soft_cap=50.0),
    Scenario("fp8-e4m3", **MIXED, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0),
    Scenario("fp8-e5m2", **MIXED, kv_cache_dtype="fp8_e5m2", k_scale=0.25, v_scale=1.5),
    Scenario("sinks", **MIXED, use_sinks=True),
    Scenario("sinks-window", **MIXED, use_sinks=True, sliding_window=7),
]  # fmt: skip
CASES = [pytest.param(s, "auto", id=f"base-{s.name}") for s in BASE] + [
    # fa2 for multi-token rows too: the decode rows' module serves them, one compile each
    pytest.param(s, "fa2", id=f"features-{s.name}")
    for s in FEATURES
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("scenario", "prefill_backend"), CASES)
def test_conformance(scenario, prefill_backend, layout):
    backend = FlashInferBackend(kv_layout=layout, prefill_backend=prefill_backend)
    result = run_scenario(backend, scenario, "cuda", backend_label=repr(backend))
    print(result.report())
    assert result.passed, result.report()


@pytest.mark.gpu
@pytest.mark.parametrize("use_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_graph_replays_other_steps(layout, use_sinks):
    """Capture one padded pure-decode step, replay it on steps with other batch sizes and
    lengths built into the same buffers."""
    backend = FlashInferBackend(kv_layout=layout, prefill_backend="fa2")
    steps = [s.replace(use_sinks=use_sinks) for s in DECODE_STEPS]
    results = replay_errors(backend, steps, DECODE_BOUNDS)
    print("\n".join(f"{name}: max error {err:.3g}" for name, err, _ in results))
    assert all(ok for _, _, ok in results), results


@pytest.mark.gpu
def test_sink_layers_of_two_head_sizes_in_one_process():
    """FlashInfer names its sink module without the head size and keeps one module per
    name: through its own sink wrapper the second head size here ran the first one's
    kernel (H100: NaN from blocks outside the page table, or wrong values everywhere;
    docs/gpu-verification.md, thirty-seventh session). Each layer's module is named for
    its shape (backends/flashinfer/sinks.py); both run in this process, head 64 first."""
    backend = FlashInferBackend()
    for head_size in (64, 128):
        scenario = Scenario(f"sinks-d{head_size}", **MIXED, head_size=head_size, use_sinks=True)
        result = run_scenario(backend, scenario, "cuda", backend_label=repr(backend))
        print(result.report())
        assert result.passed, result.report()
