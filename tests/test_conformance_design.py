"""The conformance harness in-process: the scenario design, the checks' diagnoses,
capability honesty, copy_blocks and the report."""

from __future__ import annotations

import dataclasses
import json

import pagedkv
import pytest
import torch
from pagedkv import Capabilities, Feature, MultipleOf
from pagedkv.backends.torch import TorchBackend
from pagedkv.backends.torch.impl import TorchAttentionImpl
from pagedkv.conformance import TOLERANCES, Scenario, compare_outputs, run_scenario
from pagedkv.conformance.cache import check_copy_blocks
from pagedkv.conformance.design import design_scenarios, jit_combinations
from pagedkv.conformance.honesty import capability_problems
from pagedkv.conformance.problem import build_problem, reference_output
from pagedkv.conformance.report import report_paths, write_report
from pagedkv.conformance.run import ConformanceRun
from pagedkv.registry import get_registry, reset_registry
from pagedkv.toolkit.kv_write import write_rows_by_slot

TORCH = pagedkv.get_backend("torch")


@pytest.fixture(scope="module")
def quick() -> list[Scenario]:
    return design_scenarios(TORCH, "quick", "cpu").scenarios


@pytest.fixture(scope="module")
def full() -> list[Scenario]:
    return design_scenarios(TORCH, "full", "cpu").scenarios


def _with(scenarios, **tags):
    return [s for s in scenarios if all((t in s.tags) == v for t, v in tags.items())]


# -- the design -------------------------------------------------------------------------


def test_quick_covers_the_batch_shapes(quick):
    pairs = [(s, q, sc.block_size) for sc in quick for s, q in zip(sc.seq_lens, sc.query_lens)]
    assert any(q == 1 for s, q, _ in pairs) and any(q == s > 1 for s, q, _ in pairs)
    assert any(0 < q < s and q > 8 for s, q, _ in pairs)  # chunked prefill with context
    assert {q for s, q, _ in pairs} >= set(range(2, 9)) - {6, 7}  # speculative 2-8 ...
    assert any(all(2 <= q <= 8 for q in sc.query_lens) for sc in quick)  # ... in one batch
    assert any(s % b == 0 for s, q, b in pairs) and any(s % b for s, q, b in pairs)
    assert any(s == q == 0 for s, q, _ in pairs)  # a zero-length padding request
    assert any(sc.num_padding_tokens for sc in quick)  # -1 slots
    assert max(s for s, _, _ in pairs) > 300  # one long sequence
    decodes_first = any(
        sc.query_lens[0] == 1 and sc.query_lens[1] == 1 and max(sc.query_lens) > 1 for sc in quick
    )
    interleaved = any(
        any(a > 1 and b == 1 for a, b in zip(sc.query_lens, sc.query_lens[1:])) for sc in quick
    )
    assert decodes_first and interleaved


def test_quick_covers_every_declared_axis(quick):
    ratios = {(sc.num_heads // sc.num_kv_heads, sc.num_kv_heads == 1) for sc in quick}
    assert {(1, False), (4, False), (5, False)} <= ratios and any(mqa for _, mqa in ratios)
    assert {sc.dtype for sc in quick} == {torch.float16, torch.bfloat16, torch.float32}
    assert len({sc.block_size for sc in quick}) >= 2
    assert any(sc.block_size & (sc.block_size - 1) for sc in quick)  # a non power of two
    assert len({sc.head_size for sc in quick}) >= 2
    for feature in ("sliding_window", "logits_soft_cap", "alibi", "sinks", "non_causal"):
        assert _with(quick, **{feature: True}), feature
    assert any(sc.sliding_window and sc.sliding_window < sc.block_size for sc in quick)
    fp8 = [sc for sc in quick if sc.kv_cache_dtype != "auto"]
    assert {sc.kv_cache_dtype for sc in fp8} == {"fp8_e4m3", "fp8_e5m2"}
    assert all(sc.k_scale != 1.0 and sc.v_scale != 1.0 for sc in fp8)
    assert any(sc.scale for sc in quick)  # a scale that is not head_size ** -0.5


def test_quick_stays_small_for_interpreters(quick):
    for sc in quick:
        assert max(sc.seq_lens) <= 400 and sum(sc.query_lens) <= 200, sc.name
        assert sc.num_heads <= 10 and sc.head_size <= 128, sc.name
        assert sc.min_num_blocks == 0


def test_full_has_large_pools_long_contexts_and_few_kernel_variants(full):
    big = [sc for sc in full if sc.min_num_blocks > 32768]
    assert big
    for sc in big:
        elements = sc.min_num_blocks * sc.block_size * sc.num_kv_heads * sc.head_size
        assert elements > 2**31  # K alone needs 64-bit element offsets
        problem = build_problem(sc, "cpu")
        highest = max(b for ids in problem.block_ids for b in ids)
        assert highest == problem.num_blocks - 1  # requests sit at the end of the pool
    assert max(max(sc.seq_lens) for sc in full) >= 8192
    assert {64, 128, 256} <= {sc.head_size for sc in full}
    # one kernel variant per (dtype, head size, features): keep it near a dozen (the
    # fifteenth: a bfloat16 layer over an fp8 cache, serving's usual pair; the
    # sixteenth: the score modifiers again at a second head size)
    assert len(jit_combinations(full)) <= 16


def test_full_runs_the_score_modifiers_again_at_another_head_size(full):
    """A library that keys a compiled variant without its head size hands the second
    layer the first one's kernel (FlashInfer 0.7.2's sink module): the full level runs
    the modifiers' set at its base head size, then at another, in one process."""
    names = [sc.name for sc in full]
    first = next(sc for sc in full if sc.tags >= {"sinks", "sliding_window", "logits_soft_cap"})
    again = next(sc for sc in full if sc.name == f"{first.name}-head-size-64")
    assert first.head_size == 128 and again.head_size == 64
    assert names.index(first.name) < names.index(again.name)
    assert again.replace(head_size=128, name=first.name, seed=first.seed, tags=first.tags) == first


class _Restricted(TorchBackend):
    name = "restricted"
    capabilities = Capabilities(
        dtypes=frozenset({torch.float16}),
        head_sizes=(128, 256),
        block_sizes=(MultipleOf(16, maximum=32),),
        features=frozenset({Feature.SLIDING_WINDOW}),
    )


def test_design_follows_declared_capabilities():
    plan = design_scenarios(_Restricted(), "quick", "cpu")
    assert plan.base is not None and plan.base.head_size == 128 and plan.base.block_size == 16
    assert {sc.dtype for sc in plan.scenarios} == {torch.float16}
    assert {sc.block_size for sc in plan.scenarios} == {16, 32}
    assert {sc.head_size for sc in plan.scenarios} == {128, 256}
    assert _with(plan.scenarios, sliding_window=True)
    assert not _with(plan.scenarios, alibi=True) and not _with(plan.scenarios, fp8_kv=True)
    reasons = {sc.name: r for sc, r in plan.not_applicable}
    assert reasons["alibi"] == ["alibi is not supported by restricted"]
    assert "kv_cache_dtype 'fp8_e4m3' not supported by restricted" in reasons["fp8-e4m3"][0]


class _MLAOnly(TorchBackend):
    name = "mla_only"
    capabilities = Capabilities(
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3"}),
        head_sizes=(80, 576),
        block_sizes=(16, 64),
        features=frozenset({Feature.MLA, Feature.FP8_KV}),
    )


def test_mla_design_uses_small_latents_quick_and_deepseek_dims_full():
    quick = design_scenarios(_MLAOnly(), "quick", "cpu")
    assert quick.base is not None and quick.base.kv_lora_rank == 64
    deepseek = [sc for sc in quick.scenarios if sc.kv_lora_rank == 512]
    assert deepseek and deepseek[0].qk_rope_head_dim == 64
    assert any(sc.kv_cache_dtype == "fp8_e4m3" and sc.k_scale != 1 for sc in quick.scenarios)
    assert any(sc.scale for sc in quick.scenarios)  # yarn-style scale, never derived
    full = design_scenarios(_MLAOnly(), "full", "cpu")
    assert full.base is not None
    assert (full.base.kv_lora_rank, full.base.qk_rope_head_dim) == (512, 64)
    assert (full.base.qk_nope_head_dim, full.base.v_head_dim) == (128, 128)
    assert any(sc.min_num_blocks > 32768 for sc in full.scenarios)


def test_mla_reference_equals_absorbed_attention():
    """An ideal absorbed kernel passes: the un-absorbed float64 reference equals
    attention of the absorbed query over the latent, up-projected."""
    sc = Scenario(
        "mla",
        seq_lens=(9, 20),
        query_lens=(1, 5),
        num_heads=4,
        dtype=torch.float32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
    )
    problem = build_problem(sc, "cpu")
    spec, w, lora = problem.spec, problem.mla_weights, 32
    rows, start = [], 0
    for latent, (s, q) in zip(problem.keys, zip(sc.seq_lens, sc.query_lens)):
        lat = latent[:, 0].double()
        query = problem.query[start : start + q].double()
        start += q
        scores = torch.einsum("thl,sl->hts", query, lat) * spec.scale
        visible = torch.arange(s)[None, :] <= torch.arange(s - q, s)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        rows.append(torch.einsum("hts,sl->thl", probs, lat[:, :lora]))
    absorbed = torch.einsum("thl,lhv->thv", torch.cat(rows), w["w_uv"].double())
    torch.testing.assert_close(absorbed, reference_output(problem), atol=1e-5, rtol=1e-5)


def test_each_feature_scenario_is_sensitive_to_its_feature(quick):
    """Ignoring a feature moves the reference far beyond tolerance, so a backend that
    declares it but ignores it fails."""
    off = {
        "sliding_window": {"sliding_window": None},
        "logits_soft_cap": {"logits_soft_cap": None},
        "alibi": {"alibi": False},
        "non_causal": {"causal": True},
        "scale": {"scale": None},
    }
    for tag, change in off.items():
        for sc in _with(quick, **{tag: True}):
            a = reference_output(build_problem(sc, "cpu"))
            b = reference_output(build_problem(sc.replace(**change), "cpu"))
            assert (a - b).abs().max() > 20 * TOLERANCES[sc.dtype].atol, (sc.name, tag)
    for sc in _with(quick, sinks=True):  # sinks: the same data without the sink logits
        problem = build_problem(sc, "cpu")
        a = reference_output(problem)
        problem.sinks = torch.full_like(problem.sinks, float("-inf"))
        assert (a - reference_output(problem)).abs().max() > 20 * TOLERANCES[sc.dtype].atol


# -- the checks' diagnoses --------------------------------------------------------------

MIXED = Scenario("mixed", seq_lens=(5, 20, 9), query_lens=(1, 20, 2), num_padding_tokens=2)


class _Raises(TorchAttentionImpl):
    def forward(self, *args, **kwargs):
        raise RuntimeError("kernel launch failed")


class _PadWriter(TorchAttentionImpl):
    """Writes the padded rows too: slot -1 wraps to the pool's last slot."""

    def write_kv(self, key, value, kv_cache, metadata):
        super().write_kv(key, value, kv_cache, metadata)
        slots = metadata.common.slot_mapping
        last = kv_cache.shape[1] * kv_cache.shape[2] - 1
        wrapped = torch.where(slots < 0, torch.full_like(slots, last), -1)
        write_rows_by_slot(key, kv_cache[0], wrapped)
        write_rows_by_slot(value, kv_cache[1], wrapped)


def _with_impl(impl):
    return type("B", (TorchBackend,), {"name": "custom", "get_impl_cls": lambda self: impl})()


def test_a_raising_backend_is_a_failure_naming_the_call():
    result = run_scenario(_with_impl(_Raises), MIXED, "cpu", backend_label="custom")
    assert not result.passed
    first = result.failures[0]
    assert first.check == "raised" and first.fields == {"call": "forward"}
    assert first.message.startswith("forward raised RuntimeError: kernel launch failed (at ")
    # located in the test's own frame, not in a library
    assert f"(at {__file__}:" in first.message
    assert "RuntimeError" in result.report()


def test_a_written_padding_row_is_named():
    result = run_scenario(_with_impl(_PadWriter), MIXED, "cpu", backend_label="custom")
    text = "\n".join(f.message for f in result.failures)
    # the pool's last block is either unreferenced (NaN poison) or some request's tail
    assert "was written (e.g. a -1 padding slot" in text or "holds a padding row" in text, text


def test_failure_report_names_scenario_request_head_and_reproduction():
    result = run_scenario(_with_impl(_Raises), MIXED, "cpu", backend_label="custom")
    report = result.report()
    assert report.startswith("[custom] scenario mixed: FAIL")
    assert "reproduce: python -c" in report and "Scenario('mixed', seq_lens=(5, 20, 9)" in report


# -- capabilities and copy_blocks -------------------------------------------------------


class _Dishonest(TorchBackend):
    """Declares ALiBi but rejects it; does not declare MLA but accepts anything."""

    name = "dishonest"

    def validate(self, spec, device=None):
        return ["alibi is broken here"] if spec.alibi_slopes is not None else []


@pytest.fixture
def dishonest_registered():
    class Plugin:
        @pagedkv.hookimpl
        def pagedkv_backends(self):
            return [_Dishonest]

    get_registry(reload=True).register_plugin(Plugin(), "dishonest-plugin")
    yield
    reset_registry()


def test_torch_capabilities_are_honest():
    base = design_scenarios(TORCH, "quick", "cpu").base
    assert capability_problems(TORCH, "torch", base.spec()) == []


def test_dishonest_capabilities_are_named(dishonest_registered):
    backend = _Dishonest()
    base = design_scenarios(backend, "quick", "cpu").base
    problems = capability_problems(backend, "dishonest", base.spec())
    text = "\n".join(problems)
    assert "alibi is declared, but validate() rejects a layer using it: alibi is broken" in text
    assert "alibi is declared, but select_backend('dishonest') refuses: alibi is broken" in text
    assert "mla is not declared, but validate() accepts a layer using it" in text
    assert "mla is not declared, but select_backend('dishonest') returned dishonest" in text


class _InPlaceCopy(TorchBackend):
    name = "in_place_copy"

    def copy_blocks(self, kv_cache, src, dst):
        for s, d in zip(src.tolist(), dst.tolist()):  # overwrites a source before reading it
            kv_cache[:, d] = kv_cache[:, s]


def test_copy_blocks_check():
    spec = Scenario("s", (1,), (1,)).spec()
    assert check_copy_blocks(TORCH, spec, "cpu") == []
    problems = check_copy_blocks(_InPlaceCopy(), spec, "cpu")
    assert any("block 5 of K does not equal block 4" in p for p in problems), problems


# -- the report -------------------------------------------------------------------------


def test_report_paths():
    assert [p.name for p in report_paths("out/r")] == ["r.json", "r.md"]
    assert [p.name for p in report_paths("out/r.json")] == ["r.json", "r.md"]


def test_report_has_the_matrix_and_failures(tmp_path):
    run = ConformanceRun(names=["torch"], level="quick", device_option="cpu")
    target = run.targets[0]
    plan = run.plan(target)
    run.run(target, plan.scenarios[0])
    json_path, md_path = write_report(run, tmp_path / "report")
    data = json.loads(json_path.read_text())
    assert data["level"] == "quick" and data["device"] == "cpu"
    assert data["backends"]["torch"]["passed"] == 1
    cells = {c["scenario"]: c for c in data["results"]}
    assert cells[plan.scenarios[0].name]["status"] == "pass"
    assert cells[plan.scenarios[1].name]["status"] == "not run"
    md = md_path.read_text()
    assert "| scenario | torch |" in md and f"| {plan.scenarios[0].name} | pass " in md


def test_a_pool_of_more_than_32k_blocks_hands_out_its_highest_blocks():
    sc = Scenario(
        "big-pool",
        seq_lens=(40, 3),
        query_lens=(1, 3),
        num_heads=2,
        num_kv_heads=1,
        head_size=16,
        min_num_blocks=40_000,
    )
    assert min(b for ids in build_problem(sc, "cpu").block_ids for b in ids) > 32768
    result = run_scenario(TORCH, sc, "cpu")
    assert result.passed, result.report()


def test_cross_backend_comparison_names_the_disagreement():
    a = run_scenario(TORCH, MIXED, "cpu", backend_label="a")
    b = run_scenario(TORCH, MIXED, "cpu", backend_label="b")
    assert compare_outputs(a, b) == []
    b.output = b.output.clone()
    b.output[3, 1, 0] += 1.0
    (message,) = compare_outputs(a, b)
    assert message.startswith("a and b differ by up to 1")
    assert "request 1 (seq_len 20, query_len 20), token 3 (position 2), query head 1" in message


def test_plugin_scenarios_are_filtered_and_duplicates_reported():
    extra = [
        Scenario("decode", (3,), (1,)),  # clashes with the built-in name
        Scenario("plugin-mla", (3,), (1,), num_heads=4, kv_lora_rank=64, qk_rope_head_dim=16),
    ]
    plan = design_scenarios(TORCH, "quick", "cpu", extra)
    assert plan.problems == ["two conformance scenarios are named 'decode'"]
    assert "plugin-mla" in {sc.name for sc, _ in plan.not_applicable}


class _VariantCacheWithoutHeadSize(TorchBackend):
    """Keeps each "compiled" score-modifier variant under a key without the head size,
    as FlashInfer 0.7.2 names its sink module: a layer of a second head size runs with
    the first one's compiled constant (here the softmax scale)."""

    name = "variant_cache_without_head_size"

    def __init__(self, **options):
        super().__init__(**options)
        self.compiled: dict = {}  # one per backend object, as a library keeps one per process

    def get_impl_cls(self):
        compiled = self.compiled

        class Impl(TorchAttentionImpl):
            def __init__(self, spec, **options):
                key = (spec.dtype, spec.use_sinks, spec.sliding_window is not None)
                scale = compiled.setdefault(key, spec.scale) if spec.use_sinks else spec.scale
                super().__init__(dataclasses.replace(spec, scale=scale), **options)

        return Impl


def test_a_variant_cache_without_the_head_size_fails_the_full_level():
    backend = _VariantCacheWithoutHeadSize()
    full = design_scenarios(backend, "full", "cpu").scenarios
    results = {
        sc.name: run_scenario(backend, sc, "cpu").passed
        for sc in full
        if {"sinks", "sliding_window"} <= sc.tags
    }
    assert results == {
        "window-softcap-alibi-sinks": True,
        "window-softcap-alibi-sinks-head-size-64": False,
    }
