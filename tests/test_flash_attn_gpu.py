"""FlashAttention's real kernels (the adapter installed here; on the H200 host that is
FA4, flash-attn-4 4.0.0b36) against the float64 reference. Skipped without a CUDA
device or without a FlashAttention library. FA4 compiles each configuration with
the CuTe DSL on first call (~4 s each)."""

from __future__ import annotations

import pytest
import torch
from pagedkv.backends.flash_attn.backend import FlashAttnBackend
from pagedkv.conformance import Scenario, run_scenario

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
_available, _why = FlashAttnBackend().is_available()
if not _available:
    pytest.skip(f"flash_attn backend unavailable: {_why}", allow_module_level=True)

MIXED = dict(seq_lens=(1, 17, 33, 64, 40, 5), query_lens=(1, 17, 5, 1, 8, 0))
SCENARIOS = [
    Scenario("mixed-padded", **MIXED, num_padding_tokens=3),
    Scenario("pure-decode-exact-pages", seq_lens=(16, 32, 48, 1), query_lens=(1, 1, 1, 1)),
    Scenario("prefill-block5", seq_lens=(23, 9), query_lens=(23, 9), block_size=5),
    Scenario("block64", **MIXED, block_size=64),
    # a page of 128 holds whole key tiles: FA4 loads pages by TMA, tails included
    Scenario("block128-tma", seq_lens=(300, 129, 1), query_lens=(45, 1, 1), block_size=128),
    Scenario("gqa5-bf16-d128", **MIXED, num_heads=10, num_kv_heads=2, head_size=128,
             dtype=torch.bfloat16),
    Scenario("window-softcap", **MIXED, sliding_window=9, logits_soft_cap=5.0),
    Scenario("window-smaller-than-block", **MIXED, sliding_window=5),
    Scenario("sinks", **MIXED, use_sinks=True),
    Scenario("non-causal-window", seq_lens=(30, 12), query_lens=(30, 12), causal=False,
             sliding_window=9),
    Scenario("long-large-pool", seq_lens=(4100, 3000, 2048), query_lens=(1, 1, 33),
             min_num_blocks=40_000),
]  # fmt: skip


@pytest.mark.gpu
def test_is_available_names_the_adapter():
    assert _why.startswith("runs ") and FlashAttnBackend().choice().adapter is not None


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_conformance(scenario):
    backend = FlashAttnBackend()
    if backend.validate(scenario.spec(), "cuda"):
        pytest.skip(f"{backend.adapter.name}: {'; '.join(backend.validate(scenario.spec()))}")
    result = run_scenario(backend, scenario, "cuda", backend_label=f"{backend!r} [{_why}]")
    print(result.report())
    assert result.passed, result.report()
