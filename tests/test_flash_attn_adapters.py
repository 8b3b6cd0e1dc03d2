"""FlashAttention backend on the CPU: adapter detection and choice, declared
capabilities and rejection reasons, layout and write path (FA4's finite-rows rule).

The libraries run only on a GPU; the end-to-end checks here replace each adapter's
kernel with a model of its documented signature and semantics (FA4
flash_attn.cute.flash_attn_varlen_func, FA3 flash_attn_interface.flash_attn_with_kvcache,
FA2 flash_attn.flash_attn_varlen_func): same parameter names, same page-table and
window rules. That checks how the backend maps a step onto each call; the real FA4
kernel is checked by tests/test_flash_attn_gpu.py.
"""

from __future__ import annotations

import math

import numpy as np
import pagedkv
import pytest
import torch
from graph_replay import DECODE_BOUNDS, DECODE_STEPS, MIXED_BOUNDS, MIXED_STEPS, replay_errors
from pagedkv import AttentionSpec, CommonAttentionMetadata, UnsupportedError
from pagedkv.backends.flash_attn import adapters as fa_adapters
from pagedkv.backends.flash_attn import builder as fa_builder
from pagedkv.backends.flash_attn.adapters import (
    ADAPTERS,
    FA2,
    FA4,
    Adapter,
    choose_adapter,
    installed_adapters,
)
from pagedkv.backends.flash_attn.backend import FlashAttnBackend
from pagedkv.backends.flash_attn.configs import slice_choice
from pagedkv.conformance import Scenario, run_scenario
from pagedkv.conformance.problem import build_problem
from pagedkv.toolkit.kv_write import write_rows_by_slot
from pagedkv.toolkit.split_kv import SliceCapacity

ALL = {"fa4": True, "fa3": True, "fa2": True}
NONE = {"fa4": False, "fa3": False, "fa2": False}


# -- choosing an adapter -------------------------------------------------------------


@pytest.mark.parametrize(
    ("installed", "major", "expected"),
    [
        (ALL, 9, "fa3"),  # Hopper: FA3 first
        ({**ALL, "fa3": False}, 9, "fa4"),
        (ALL, 10, "fa4"),  # Blackwell: FA3 does not run there
        ({**NONE, "fa2": True}, 10, "fa2"),
        (ALL, 8, "fa2"),  # Ampere: FA4 has no paged KV on SM80
        (ALL, 12, "fa2"),
        ({**NONE, "fa3": True}, None, "fa3"),  # no GPU: by generation among installed
        (ALL, None, "fa4"),
    ],
)
def test_auto_picks_the_strongest_installed_adapter_for_the_gpu(installed, major, expected):
    choice = choose_adapter(None, installed, major)
    assert choice.adapter is ADAPTERS[expected] and choice.reason == ""


def test_choice_says_why_nothing_runs():
    choice = choose_adapter(None, NONE, 9)
    assert choice.adapter is None
    assert choice.reason == (
        "no FlashAttention adapter can run: "
        "fa3: FlashAttention-3 is not installed (pip distribution 'flash_attn_3', module "
        "flash_attn_interface); "
        "fa4: FlashAttention-4 is not installed (pip distribution 'flash-attn-4', module "
        "flash_attn.cute); "
        "fa2: FlashAttention-2 is not installed (pip distribution 'flash-attn', module flash_attn)"
    )
    wrong_arch = choose_adapter(None, {**NONE, "fa3": True}, 8)
    assert wrong_arch.reason == (
        "no FlashAttention adapter can run: fa2: FlashAttention-2 is not installed "
        "(pip distribution 'flash-attn', module flash_attn)"
    )


def test_forced_adapter_must_be_installed_and_fit_the_gpu():
    assert choose_adapter("fa2", ALL, 9).adapter is FA2
    assert choose_adapter("fa3", {**ALL, "fa3": False}, 9).reason == (
        "impl=fa3: FlashAttention-3 is not installed (pip distribution 'flash_attn_3', "
        "module flash_attn_interface)"
    )
    assert choose_adapter("fa3", ALL, 10).reason == (
        "impl=fa3: FlashAttention-3 runs Hopper (SM90) only; this GPU is SM10x"
    )
    assert choose_adapter("fa4", ALL, 8).reason == (
        "impl=fa4: FlashAttention-4 runs paged KV on SM90 and SM100/SM110 only; this GPU is SM8x"
    )


def _package(root, name, files):
    for rel, text in files.items():
        path = root / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_detection_imports_nothing(tmp_path, monkeypatch):
    # FA4 alone: flash_attn is a namespace holding cute/
    fa4_site = tmp_path / "fa4"
    _package(fa4_site, "flash_attn", {"cute/__init__.py": "raise RuntimeError('imported')"})
    monkeypatch.syspath_prepend(str(fa4_site))
    assert installed_adapters() == {"fa4": True, "fa3": False, "fa2": False}
    # FA2's regular package, whose __init__ must not run just to look
    fa2_site = tmp_path / "fa2"
    _package(fa2_site, "flash_attn", {"__init__.py": "raise RuntimeError('imported')"})
    (fa2_site / "flash_attn_2_cuda.py").write_text("raise RuntimeError('imported')")
    (fa2_site / "flash_attn_interface.py").write_text("raise RuntimeError('imported')")
    monkeypatch.syspath_prepend(str(fa2_site))
    assert installed_adapters() == {"fa4": False, "fa3": True, "fa2": True}


# -- the backend's declarations --------------------------------------------------------

SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16, block_size=16)


def test_layout_and_options():
    backend = pagedkv.get_backend("flash_attn", impl="fa4")
    assert backend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    assert backend.layout == "(2, num_blocks, block_size, num_kv_heads, head_size)"
    cache = backend.allocate_kv_cache(3, SPEC, "cpu")
    k, v = backend.kv_cache_to_logical(cache, SPEC)
    assert k.data_ptr() == cache.data_ptr() and v.data_ptr() == cache[1].data_ptr()
    with pytest.raises(pagedkv.ConfigError, match=r"impl='fa1': expected one of fa4, fa3, fa2"):
        FlashAttnBackend(impl="fa1")


def test_validate_reasons_follow_the_adapter():
    fa4, fa3, fa2 = (FlashAttnBackend(impl=n) for n in ("fa4", "fa3", "fa2"))
    assert fa4.validate(SPEC) == [] and fa3.validate(SPEC) == []
    assert fa2.validate(SPEC) == [
        "block_size 16 not supported by flash_attn (supports multiple of 256)"
    ]
    assert fa2.validate(SPEC.replace(block_size=512)) == []
    sinks = SPEC.replace(use_sinks=True)
    assert fa4.validate(sinks) == []
    assert fa3.validate(sinks) == ["sinks is not supported by flash_attn"]
    alibi = SPEC.replace(block_size=256, alibi_slopes=tuple(2.0**-i for i in range(1, 9)))
    assert fa2.validate(alibi) == []
    (reason,) = fa2.validate(alibi.replace(causal=False))
    assert reason.startswith("alibi with non-causal attention is not supported by flash_attn (fa2)")
    assert fa4.validate(alibi) == ["alibi is not supported by flash_attn"]
    fp8 = SPEC.replace(kv_cache_dtype="fp8_e4m3")
    for backend in (fa4, fa3):
        assert backend.validate(fp8) == [
            "kv_cache_dtype 'fp8_e4m3' not supported by flash_attn (supports auto)",
            "fp8_kv is not supported by flash_attn",
        ]
    assert fa4.validate(SPEC.replace(head_size=192)) == [
        "head_size 192 not supported by flash_attn (supports multiple of 8 in [8, 128], 256)"
    ]
    assert fa3.validate(SPEC.replace(head_size=192)) == []
    assert fa4.validate(SPEC, device="cpu") == [
        "device cpu not supported by flash_attn (supports cuda)"
    ]
    assert "dtype float32 not supported" in fa4.validate(SPEC.replace(dtype=torch.float32))[0]
    window = SPEC.replace(sliding_window=32, logits_soft_cap=30.0, causal=False)
    assert fa4.validate(window) == fa3.validate(window) == []
    # the capabilities are the adapter's, CUDA graphs included
    assert fa4.capabilities is FA4.capabilities and str(fa4.capabilities.graph_support) == "mixed"
    assert str(fa3.capabilities.graph_support) == str(fa2.capabilities.graph_support) == "never"


def test_num_splits_option():
    assert FlashAttnBackend(impl="fa4", num_splits=8).validate(SPEC) == []
    (reason,) = FlashAttnBackend(impl="fa2", num_splits=4).validate(SPEC.replace(block_size=256))
    assert reason.startswith("num_splits=4 is not supported by flash_attn (fa2): its paged call")
    # FA4 splits through the combinator without a GPU that splits natively
    (reason,) = FlashAttnBackend(impl="fa4", num_splits=4).validate(SPEC.replace(sliding_window=64))
    assert reason.startswith("num_splits=4: flash_attn (fa4) splits through pagedkv's combinator")
    assert "sliding window" in reason
    assert (
        FlashAttnBackend(impl="fa4", num_splits=1).validate(SPEC.replace(sliding_window=64)) == []
    )
    with pytest.raises(pagedkv.ConfigError, match=r"num_splits=65: expected 0 \(choose\) to 64"):
        FlashAttnBackend(num_splits=65)
    with pytest.raises(pagedkv.ConfigError, match="num_splits=-1"):
        pagedkv.get_backend("flash_attn", num_splits="-1")


def test_is_available_names_the_adapter_or_why_not(monkeypatch):
    monkeypatch.setattr(fa_adapters, "installed_adapters", lambda: {**NONE, "fa4": True})
    if not torch.cuda.is_available():
        assert FlashAttnBackend().is_available() == (
            False,
            "no CUDA device (torch.cuda.is_available() is False); "
            f"{FA4.describe()} would run on one",
        )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(
        Adapter, "load", lambda self: (_ for _ in ()).throw(ImportError("no triton"))
    )
    assert FlashAttnBackend().is_available() == (
        False,
        f"{FA4.describe()} is installed but importing flash_attn.cute.flash_attn_varlen_func "
        "failed: ImportError: no triton",
    )
    monkeypatch.setattr(Adapter, "load", lambda self: _fake_fa4)
    assert FlashAttnBackend().is_available() == (True, f"runs {FA4.describe()}")
    available, why = FlashAttnBackend(impl="fa3").is_available()
    assert not available and why.startswith("impl=fa3: FlashAttention-3 is not installed")
    with pytest.raises(UnsupportedError, match="impl=fa3: FlashAttention-3 is not installed"):
        FlashAttnBackend(impl="fa3").make_impl(SPEC)


# -- the pool and the write path keep FA4's last-page rows finite ------------------------


def test_pool_is_zero_filled_and_writes_stay_finite(monkeypatch):
    monkeypatch.setattr(fa_adapters, "installed_adapters", lambda: dict(ALL))
    backend = CPUFlashAttn(impl="fa4")
    cache = backend.allocate_kv_cache(4, SPEC, "cpu")
    assert not cache.any()
    # 5 tokens in a 16-token block: rows 5..15 of block 2 are read by FA4's TMA loads
    md = CommonAttentionMetadata.from_requests([5], [5], [[2]], 16, num_tokens=7)
    key = torch.full((7, 2, 64), 60000.0).half()  # near fp16's max, still finite
    value = torch.randn(7, 2, 64).half()
    impl = backend.make_impl(SPEC)  # the write path needs no library
    impl.write_kv(key, value, cache, backend.make_builder(SPEC, "cpu").build(md))
    assert torch.isfinite(cache).all()
    assert torch.equal(cache[0, 2, :5], key[:5]) and not cache[:, 2, 5:].any()
    assert not cache[:, [0, 1, 3]].any()  # padding rows (slot -1) were not written
    # fp8 pools (the same writer, kv_write) saturate instead of storing inf/NaN
    fp8 = torch.zeros(2, 4, 16, 2, 64, dtype=torch.float8_e5m2)
    write_rows_by_slot(torch.full((7, 2, 64), 1e9), fp8[0], md.slot_mapping, scale=0.5)
    stored = fp8.float()
    assert torch.isfinite(stored).all()
    assert (stored[0, 2, :5] == torch.finfo(torch.float8_e5m2).max).all()


# -- models of the three kernels ---------------------------------------------------------


def _paged(q, k_cache, v_cache, qsl, seq_lens, table, *, scale, causal, left, right,
           softcap, sinks=None, alibi=None, check_finite_tail=False):  # fmt: skip
    """Paged attention as FlashAttention documents it, in float64: the output (rows no
    request owns: NaN, as they would hold whatever the library left) and the
    log-sum-exp [num_heads, rows] of each row's scores (sink included)."""
    bs = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.full(q.shape, math.nan, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), math.nan, dtype=torch.float64)
    qsl, seq_lens = qsl.tolist(), seq_lens.tolist()
    assert qsl[-1] <= q.shape[0] and qsl == sorted(qsl)
    for b in range(len(seq_lens)):
        n, ql = seq_lens[b], qsl[b + 1] - qsl[b]
        if ql == 0:
            continue
        pages = table[b, : -(-n // bs)].long()
        assert n == 0 or int(pages.max()) < k_cache.shape[0], f"request {b} reads past the cache"
        k_rows, v_rows = k_cache[pages].flatten(0, 1), v_cache[pages].flatten(0, 1)
        if check_finite_tail:  # FA4: a tile loads the whole last page
            assert (
                torch.isfinite(k_rows[n:].float()).all()
                and torch.isfinite(v_rows[n:].float()).all()
            )
        k = k_rows[:n].double().repeat_interleave(group, 1)
        v = v_rows[:n].double().repeat_interleave(group, 1)
        qi = q[qsl[b] : qsl[b + 1]].double()
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(n - ql, n)[:, None]
        key = torch.arange(n)[None, :]
        keep = torch.ones(ql, n, dtype=torch.bool)
        if causal:
            keep &= key <= pos
        if left is not None and left >= 0:
            keep &= key >= pos - left
        if right is not None and right >= 0:
            keep &= key <= pos + right
        if alibi is not None:
            s = s - alibi.double().view(-1, 1, 1) * (pos - key).abs()
        s = s.masked_fill(~keep, -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks.double().view(-1, 1, 1).expand(-1, ql, 1)], -1)
        o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1)[..., :n], v)
        out[qsl[b] : qsl[b + 1]] = o
        lse[:, qsl[b] : qsl[b + 1]] = torch.logsumexp(s, -1)
    return out.to(q.dtype), lse.float()


# the GPU generation the FA4 model runs on (its split-KV is SM100-only)
FA4_ARCH = {"major": 9}
FA4_CALLS: list[dict] = []


def _fake_fa4(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
              gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
              window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
              pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None,
              mask_mod=None, block_sparse_tensors=None, aux_tensors=None, aux_scalars=None,
              return_lse=False, scheduler_metadata=None, seqlen_k_per_split=None,
              disable_scheduler_metadata=False, gather_bwd_recompute_p=False,
              gather_bwd_token_chunk=None):  # fmt: skip
    assert page_table is not None and seqused_k is not None and cu_seqlens_k is None
    assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1
    assert q.dtype == k.dtype == v.dtype
    assert learnable_sink is None or learnable_sink.dtype == torch.float32
    assert max_seqlen_q is not None and max_seqlen_q >= int(
        (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()
    )
    if num_splits > 1:
        assert FA4_ARCH["major"] != 9, "SplitKV not supported on SM 9.0"
        assert max_seqlen_k is not None and max_seqlen_k >= int(seqused_k.max())
    FA4_CALLS.append(dict(batch=len(seqused_k), rows=q.shape[0], num_splits=num_splits,
                          return_lse=return_lse, sinks=learnable_sink is not None))  # fmt: skip
    left, right = window_size
    out, lse = _paged(q, k, v, cu_seqlens_q, seqused_k, page_table, scale=softmax_scale,
                      causal=causal, left=left, right=0 if causal else right, softcap=softcap,
                      sinks=learnable_sink, check_finite_tail=True)  # fmt: skip
    return out, lse if return_lse else None


def _fake_fa3(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
              cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
              cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
              q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
              window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
              scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
              return_softmax_lse=False):  # fmt: skip
    assert page_table is not None and cu_seqlens_q is not None and max_seqlen_q is not None
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert num_splits == FA3_SPLITS["expected"], num_splits
    left, right = window_size
    return _paged(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, page_table,
                  scale=softmax_scale, causal=causal, left=left,
                  right=0 if causal else right, softcap=softcap)[0]  # fmt: skip


FA3_SPLITS = {"expected": 0}  # what the backend passes: 0 lets FA3's heuristic choose


def _fake_fa2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
              softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, deterministic=False, return_attn_probs=False,
              block_table=None):  # fmt: skip
    assert block_table is not None and k.shape[1] % 256 == 0, "FA2 pages are multiples of 256"
    assert alibi_slopes is None or alibi_slopes.dtype == torch.float32
    seq_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    left, right = window_size
    return _paged(q, k, v, cu_seqlens_q, seq_lens, block_table, scale=softmax_scale,
                  causal=causal, left=left, right=0 if causal else right, softcap=softcap,
                  alibi=alibi_slopes)[0]  # fmt: skip


FAKES = {"fa4": _fake_fa4, "fa3": _fake_fa3, "fa2": _fake_fa2}


@pytest.fixture
def fakes(monkeypatch):
    """Every adapter installed, each library replaced by its model, on an SM90 GPU."""
    monkeypatch.setattr(fa_adapters, "installed_adapters", lambda: dict(ALL))
    monkeypatch.setattr(Adapter, "load", lambda self: FAKES[self.name])
    monkeypatch.setitem(FA4_ARCH, "major", 9)
    monkeypatch.setattr(fa_builder, "gpu_major", lambda device=None: FA4_ARCH["major"])
    FA4_CALLS.clear()
    return FA4_CALLS


class CPUFlashAttn(FlashAttnBackend):
    """The real backend with the device check lifted, to run against the models."""

    def validate(self, spec, device=None):
        return super().validate(spec, None)


MIXED = dict(seq_lens=(1, 17, 33, 64, 40, 5), query_lens=(1, 17, 5, 1, 8, 0))
LONG = dict(seq_lens=(300, 520, 7), query_lens=(1, 40, 7))
SCENARIOS = {
    "fa4": [
        Scenario("mixed-padded", **MIXED, num_padding_tokens=3),
        Scenario("prefill-block5", seq_lens=(23, 9), query_lens=(23, 9), block_size=5),
        Scenario("window-softcap", **MIXED, sliding_window=9, logits_soft_cap=5.0),
        Scenario("sinks-bf16", **MIXED, use_sinks=True, dtype=torch.bfloat16),
        Scenario("non-causal-window", seq_lens=(30, 12), query_lens=(30, 12), causal=False,
                 sliding_window=9),
    ],
    "fa3": [
        Scenario("mixed-padded", **MIXED, num_padding_tokens=3),
        Scenario("window-softcap-gqa5", **MIXED, num_heads=10, sliding_window=9,
                 logits_soft_cap=5.0),
        Scenario("non-causal-window", seq_lens=(30, 12), query_lens=(30, 12), causal=False,
                 sliding_window=9),
    ],
    "fa2": [
        Scenario("mixed-block256", **LONG, block_size=256, num_padding_tokens=2),
        Scenario("alibi-window-softcap", **LONG, block_size=256, alibi=True, sliding_window=100,
                 logits_soft_cap=20.0),
    ],
}  # fmt: skip


@pytest.mark.parametrize(
    ("impl", "scenario"),
    [(i, s) for i, scenarios in SCENARIOS.items() for s in scenarios],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_adapter_calls_match_reference(fakes, impl, scenario):
    backend = CPUFlashAttn(impl=impl)
    result = run_scenario(backend, scenario, "cpu", backend_label=repr(backend))
    assert result.passed, result.report()


def test_forward_checks_the_cache(fakes):
    backend = CPUFlashAttn(impl="fa3")
    md = backend.make_builder(SPEC, "cpu").build(
        CommonAttentionMetadata.from_requests([5], [1], [[1]], 16)
    )
    q = torch.randn(1, 8, 64).half()
    wrong = torch.zeros(4, 2, 16, 2, 64, dtype=torch.float16)  # FlashInfer's NHD order
    with pytest.raises(
        UnsupportedError,
        match=r"kv_cache: expected the kv_first layout \[2, num_blocks, 16, 2, 64\]",
    ):
        backend.make_impl(SPEC).forward(q, None, None, wrong, md)


# -- split-KV: FA4's own (SM100) or pagedkv's combinator (SM90) ----------------------------

LONG_DECODES = dict(seq_lens=(700, 17, 1100, 40, 300), query_lens=(1, 17, 1, 8, 1))
SPLIT_SCENARIOS = [
    Scenario("long-decodes-padded", **LONG_DECODES, num_padding_tokens=2),
    Scenario("long-decodes-sinks-bf16", **LONG_DECODES, use_sinks=True, dtype=torch.bfloat16),
    Scenario("long-decodes-softcap-gqa4", **LONG_DECODES, num_heads=8, num_kv_heads=2,
             logits_soft_cap=5.0),
    Scenario("long-decodes-non-causal-block5", seq_lens=(260, 33, 101), query_lens=(1, 33, 1),
             causal=False, block_size=5),
]  # fmt: skip


@pytest.mark.parametrize("scenario", SPLIT_SCENARIOS, ids=lambda s: s.name)
def test_fa4_on_sm90_splits_through_the_combinator(fakes, scenario):
    backend = CPUFlashAttn(impl="fa4", num_splits=4)
    result = run_scenario(backend, scenario, "cpu", backend_label=repr(backend))
    assert result.passed, result.report()
    (call,) = [c for c in fakes if c["return_lse"]]  # the context write calls nothing
    # the long decodes became slices (extra requests); sinks are merged, never passed
    assert call["batch"] > len(scenario.seq_lens) and call["num_splits"] == 1
    assert not call["sinks"]


def test_fa4_on_sm100_splits_itself(fakes, monkeypatch):
    monkeypatch.setitem(FA4_ARCH, "major", 10)
    scenario = SPLIT_SCENARIOS[1]
    backend = CPUFlashAttn(impl="fa4", num_splits=4)
    result = run_scenario(backend, scenario, "cpu", backend_label=repr(backend))
    assert result.passed, result.report()
    (call,) = fakes
    assert call == dict(batch=5, rows=28, num_splits=4, return_lse=False, sinks=True)


def test_the_policy_splits_long_decodes_of_small_batches(fakes):
    # one decode over 2048 keys, 2 KV heads: 2 programs on the 4-SM CPU stand-in (FA4:
    # one program per SM). The makespan rule: 2 slices of 1024 keys fill the SMs in one
    # wave (1024 + 224 keys of time); 4 of 512 take two (2 x (512 + 224))
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16,
                         block_size=16)  # fmt: skip
    backend = CPUFlashAttn(impl="fa4")
    builder = backend.make_builder(spec, "cpu")
    step = CommonAttentionMetadata.from_requests([2048], [1], [list(range(1, 129))], 16)
    md = builder.build(step)
    assert md.sliced is not None and md.sliced.slices.keys_per_split == 1024
    assert md.sliced.metadata.common.seq_lens_cpu.tolist() == [1024] * 2
    # a ragged batch: the long request is sliced in fixed ranges, the short ones stay whole
    ragged = CommonAttentionMetadata.from_requests(
        [4096, 300, 200], [1] * 3, [list(range(1, 257)), [257] * 19, [300] * 13], 16
    )
    md = builder.build(ragged)
    assert md.sliced is not None
    kept = md.sliced.metadata.common.seq_lens_cpu.tolist()
    per = md.sliced.slices.keys_per_split
    assert kept == [per] * (4096 // per) + [300, 200], kept
    # many decodes fill the GPU: no split
    many = CommonAttentionMetadata.from_requests([2048] * 2, [1] * 2, [list(range(1, 129))] * 2, 16)
    assert builder.build(many).sliced is None
    # nor for layers the combinator cannot split
    window = backend.make_builder(spec.replace(sliding_window=256), "cpu").build(step)
    assert window.sliced is None and window.num_splits == 1


@pytest.mark.parametrize(
    ("seq_lens", "expected"),
    [([32767], (16, 2048)), ([32767] * 4, (4, 8192)), ([4096] * 64, (1, 4096))],
    ids=["1x32k", "4x32k", "64x4096"],
)
def test_slices_keep_the_h200_measurements(seq_lens, expected):
    """Hq 32 / Hkv 8 on 132 SMs: the slice counts the H200 measured fastest (1 x 32k: 16
    slices 49.9 us against 52.9 for 33 and 65.1 for 64, docs/benchmarks.md); a full
    grid does not split."""
    choice = slice_choice(np.array(seq_lens), 4, 8, 16, 132)
    assert (choice.num_splits, choice.keys_per_split) == expected


@pytest.mark.parametrize(("forced", "passed"), [(None, 0), (1, 1), (6, 6)])
def test_fa3_splits_by_its_own_heuristic_unless_forced(fakes, monkeypatch, forced, passed):
    monkeypatch.setitem(FA3_SPLITS, "expected", passed)
    backend = CPUFlashAttn(impl="fa3", num_splits=forced)
    result = run_scenario(backend, SPLIT_SCENARIOS[0], "cpu", backend_label=repr(backend))
    assert result.passed, result.report()


# -- CUDA graphs: the reserved path on the FA4 model ---------------------------------------


@pytest.mark.parametrize(
    ("num_splits", "use_sinks"),
    [(1, False), (3, False), (3, True)],
    ids=["whole", "sliced", "sliced-sinks"],
)
def test_graph_steps_on_the_model(fakes, num_splits, use_sinks):
    """tests/test_flash_attn_gpu.py's graph steps, each "replay" an eager forward: every
    call has the same shape (batch, rows), whatever the step."""
    backend = CPUFlashAttn(impl="fa4", num_splits=num_splits)
    for steps, bounds in ((DECODE_STEPS, DECODE_BOUNDS), (MIXED_STEPS, MIXED_BOUNDS)):
        fakes.clear()
        steps = [s.replace(use_sinks=use_sinks) for s in steps]
        results = replay_errors(backend, steps, bounds, "cpu")
        assert len(results) == len(steps) + 1 and all(ok for _, _, ok in results), results
        shapes = {(c["batch"], c["rows"], c["return_lse"]) for c in fakes}
        assert len(shapes) == 1, shapes
        (batch, rows, sliced) = shapes.pop()
        # slices serve decode-only reservations; mixed ones keep the plain call
        assert sliced == (num_splits > 1 and bounds is DECODE_BOUNDS)
        capacity = SliceCapacity.for_bounds(bounds, num_splits)
        if sliced:
            assert (batch, rows) == (capacity.num_requests, capacity.num_rows)
        else:
            assert (batch, rows) == (bounds.max_num_reqs, bounds.max_num_tokens)


def test_graph_slices_live_in_persistent_buffers(fakes):
    spec = DECODE_STEPS[0].spec()
    builder = CPUFlashAttn(impl="fa4", num_splits=3).make_builder(spec, "cpu")
    builder.reserve_cuda_graph(DECODE_BOUNDS)
    a, b = (builder.build(build_problem(s, "cpu").common) for s in DECODE_STEPS[:2])
    assert a.sliced is not None and b.sliced is not None
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        assert getattr(a.sliced.metadata.common, name) is getattr(b.sliced.metadata.common, name)
    assert a.sliced.slices.query_rows is b.sliced.slices.query_rows
    assert a.sliced.metadata.cu_seqlens_k is b.sliced.metadata.cu_seqlens_k
    assert a.cu_seqlens_k is b.cu_seqlens_k


def test_graph_reservations_follow_the_adapter(fakes):
    spec = DECODE_STEPS[0].spec()
    for impl in ("fa3", "fa2"):
        builder = CPUFlashAttn(impl=impl).make_builder(spec.replace(block_size=256), "cpu")
        with pytest.raises(UnsupportedError, match="declares graph support never"):
            builder.reserve_cuda_graph(MIXED_BOUNDS)
