"""FlashAttention's real kernels (the adapter installed here; on the H200 host that is
FA4, flash-attn-4 4.0.0b36) against the float64 reference: the plain call, long
decodes split by pagedkv's combinator (FA4 cannot split on SM90), the log-sum-exp FA4
returns, captured steps replayed on other steps, and long-decode speed against
FlashInfer. Skipped without a CUDA device or without a FlashAttention library. FA4
compiles each configuration with the CuTe DSL on first call (~4 s each)."""

from __future__ import annotations

import pytest
import torch
from graph_replay import DECODE_BOUNDS, DECODE_STEPS, MIXED_BOUNDS, MIXED_STEPS, replay_errors
from pagedkv import BackendMetadata, CommonAttentionMetadata
from pagedkv.backends.flash_attn.backend import FlashAttnBackend
from pagedkv.backends.torch import TorchBackend
from pagedkv.conformance import Scenario, run_scenario
from pagedkv.conformance.problem import build_problem

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
# long decodes next to prefill rows, cut into slices (forced count) and merged
SPLIT = dict(seq_lens=(4100, 17, 9000, 300, 2048), query_lens=(1, 17, 1, 40, 1))
SPLIT_SCENARIOS = [
    Scenario("split-padded", **SPLIT, num_padding_tokens=3),
    Scenario("split-sinks-bf16-d128", **SPLIT, use_sinks=True, dtype=torch.bfloat16,
             head_size=128),
    Scenario("split-softcap-gqa4", **SPLIT, num_heads=8, num_kv_heads=2, logits_soft_cap=5.0),
    Scenario("split-block128-tma", **SPLIT, block_size=128),
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


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [4, 37])
@pytest.mark.parametrize("scenario", SPLIT_SCENARIOS, ids=lambda s: s.name)
def test_long_decodes_split(scenario, num_splits):
    """FA4's own split where it has one (SM100), pagedkv's combinator elsewhere (SM90)."""
    backend = FlashAttnBackend(num_splits=num_splits)
    if backend.adapter.name != "fa4":
        pytest.skip(f"split-KV through num_splits is FA4's path; {backend.adapter.name} runs here")
    spec = scenario.spec()
    md = backend.make_builder(spec, "cuda").build(build_problem(scenario, "cuda").common)
    print(f"sliced: {md.sliced is not None}, library splits: {md.num_splits}")
    assert md.sliced is not None or md.num_splits == num_splits
    result = run_scenario(backend, scenario, "cuda", backend_label=repr(backend))
    print(result.report())
    assert result.passed, result.report()


@pytest.mark.gpu
def test_fa4_log_sum_exp_matches_the_torch_backend():
    backend = FlashAttnBackend()
    if not backend.adapter.returns_lse:
        pytest.skip(f"{backend.adapter.name} does not return the log-sum-exp")
    problem = build_problem(Scenario("lse", **MIXED, num_padding_tokens=2, use_sinks=True), "cuda")
    spec, n = problem.spec, problem.common.num_actual_tokens
    results = []
    for b in (backend, TorchBackend()):
        cache = b.allocate_kv_cache(problem.num_blocks, spec, "cuda")
        impl = b.make_impl(spec, sinks=problem.sinks)
        everything = CommonAttentionMetadata.from_requests(
            problem.scenario.seq_lens, problem.scenario.seq_lens, problem.block_ids,
            spec.block_size, "cuda",
        )  # fmt: skip
        impl.write_kv(torch.cat(problem.keys).cuda(), torch.cat(problem.values).cuda(), cache,
                      BackendMetadata(everything))  # fmt: skip
        out = torch.empty(problem.common.num_tokens, spec.num_heads, spec.head_size_v,
                          dtype=spec.dtype, device="cuda")  # fmt: skip
        lse = torch.empty(problem.common.num_tokens, spec.num_heads, device="cuda")
        md = b.make_builder(spec, "cuda").build(problem.common)
        out, lse = impl.attend_with_lse(problem.query, cache, md, out, lse)
        results.append((out[:n].float(), lse[:n]))
    (fa_out, fa_lse), (ref_out, ref_lse) = results
    torch.testing.assert_close(fa_lse, ref_lse, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fa_out, ref_out, rtol=5e-3, atol=5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("steps", "bounds", "num_splits"),
    [(DECODE_STEPS, DECODE_BOUNDS, None), (DECODE_STEPS, DECODE_BOUNDS, 4),
     (MIXED_STEPS, MIXED_BOUNDS, None)],
    ids=["decode", "decode-sliced", "mixed"],
)  # fmt: skip
@pytest.mark.parametrize("use_sinks", [False, True], ids=["plain", "sinks"])
def test_graph_replays_other_steps(steps, bounds, num_splits, use_sinks):
    """Decides FA4's declared graph support: capture one step, replay it on steps with
    other batches and lengths built into the same buffers, compare with the reference."""
    backend = FlashAttnBackend(num_splits=num_splits)
    if str(backend.capabilities.graph_support) == "never":
        pytest.skip(f"{backend.adapter.name} declares no CUDA-graph support")
    results = replay_errors(backend, [s.replace(use_sinks=use_sinks) for s in steps], bounds)
    print("\n".join(f"{name}: max error {err:.3g}" for name, err, _ in results))
    assert all(ok for _, _, ok in results), results


# -- long-decode speed against FlashInfer -----------------------------------------------
