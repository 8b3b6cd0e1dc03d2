"""The FlashInfer backend's plumbing on the CPU: CSR conversion, batch split, plan()
arguments, run() calls and the scatter back to token order, checked end to end
against the float64 reference.

FlashInfer's kernels need a GPU, so here its three wrappers are replaced by a model
of their documented plan()/run() contract (flashinfer 0.7.2 decode.py / prefill.py /
attention/_core.py): the same constructor and plan() keyword names (an unknown one
raises TypeError), the same paged-KV reading rules (CSR pages, last_page_len,
NHD/HND 5-D caches, window_left inclusive, sm_scale * k_scale, out * v_scale) and,
for wrappers made with ``use_cuda_graph=True``, the fixed buffers: plan() copies into
them (batch size fixed, indices within the buffer, total query rows fixed by the first
plan) and run() reads them, as a replayed graph does. The model also holds the plans to
what the backend promises FlashInfer: every planned request has at least one page, all
of them inside the cache, and a last page of 1..page_size tokens.
The real kernels are checked by tests/test_flashinfer_gpu.py.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pagedkv
import pytest
import torch
from graph_replay import DECODE_BOUNDS, DECODE_STEPS, replay_errors
from pagedkv import (
    AttentionSpec,
    CommonAttentionMetadata,
    GraphBounds,
    MetadataError,
    UnsupportedError,
)
from pagedkv.backends.flashinfer import builder as fi_builder
from pagedkv.backends.flashinfer import impl as fi_impl
from pagedkv.backends.flashinfer.backend import FlashInferBackend
from pagedkv.backends.flashinfer.sinks import SinkModule
from pagedkv.conformance import TOLERANCES, Scenario, run_scenario
from pagedkv.conformance.problem import build_problem, reference_output

# -- a model of FlashInfer's wrappers ------------------------------------------------


def _attend(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: str,
    plan: dict,
    *,
    causal: bool,
    k_scale: float | None,
    v_scale: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """What a FlashInfer paged run computes, in float64."""
    k_cache, v_cache = kv_cache.unbind(1)
    if layout == "HND":  # [pages, heads, page_size, dim] -> [pages, page_size, heads, dim]
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    ps, wl, cap = plan["page_size"], plan["window_left"], plan["logits_soft_cap"]
    indptr, indices = plan["indptr"].tolist(), plan["indices"].cpu().long()
    last, qo = plan["last_page_len"].tolist(), plan["qo_indptr"].tolist()
    group = plan["num_qo_heads"] // plan["num_kv_heads"]
    scale = plan["sm_scale"] * (1.0 if k_scale is None else k_scale)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(len(last)):
        pages = indices[indptr[i] : indptr[i + 1]]
        assert len(pages) >= 1 and 1 <= last[i] <= ps, (
            f"request {i}: {len(pages)} pages, last {last[i]}"
        )
        assert int(pages.max()) < k_cache.shape[0], f"request {i} reads page {int(pages.max())}"
        kv_len = (len(pages) - 1) * ps + last[i]
        k = k_cache[pages].flatten(0, 1)[:kv_len].double().repeat_interleave(group, 1)
        v = v_cache[pages].flatten(0, 1)[:kv_len].double().repeat_interleave(group, 1)
        qi = q[qo[i] : qo[i + 1]].double()
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        pos = torch.arange(kv_len - qi.shape[0], kv_len)[:, None]
        key = torch.arange(kv_len)[None, :]
        keep = torch.ones(qi.shape[0], kv_len, dtype=torch.bool)
        if causal:
            keep &= key <= pos
        if wl >= 0:
            keep &= pos - key <= wl
        s = s.masked_fill(~keep, -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks.double().view(-1, 1, 1).expand(-1, s.shape[1], 1)], -1)
        p = torch.softmax(s, -1)[..., :kv_len]
        o = torch.einsum("hqk,khd->qhd", p, v)
        out[qo[i] : qo[i + 1]] = o * (1.0 if v_scale is None else v_scale)
    return out


class _Wrapper:
    calls: list  # every (wrapper kind, method, kwargs), for the tests to inspect
    graph = False

    def _fixed_buffers(self, indptr, indices, last_page_len, qo_indptr=None):
        """use_cuda_graph=True: the buffers every plan copies into and every run reads."""
        self.graph = True
        self.buffers = dict(indptr=indptr, indices=indices, last_page_len=last_page_len,
                            qo_indptr=qo_indptr)  # fmt: skip
        assert all(torch.is_tensor(b) for k, b in self.buffers.items() if k != "qo_indptr")
        assert all(b.dtype == torch.int32 for b in self.buffers.values() if b is not None)
        self.batch = len(last_page_len)
        assert len(indptr) == self.batch + 1
        self.max_rows = None

    def _into_buffers(self, args):
        """Graph mode: plan() copies into the fixed buffers; run() reads them."""
        if not self.graph:
            return args
        b = self.buffers
        assert len(args["last_page_len"]) == self.batch, "batch size is fixed in cudagraph mode"
        assert len(args["indices"]) <= len(b["indices"]), "indices exceed the buffer"
        rows = int(args["qo_indptr"][-1])
        self.max_rows = rows if self.max_rows is None else self.max_rows
        assert rows <= self.max_rows, "the first plan fixes the total rows in cudagraph mode"
        b["indptr"].copy_(args["indptr"])
        b["last_page_len"].copy_(args["last_page_len"])
        b["indices"][: len(args["indices"])].copy_(args["indices"])
        if b["qo_indptr"] is not None:
            b["qo_indptr"].copy_(args["qo_indptr"])
        return dict(args, indptr=b["indptr"], indices=b["indices"],
                    last_page_len=b["last_page_len"])  # fmt: skip

    def _check_run(self, q, kv_cache, out):
        assert self.plan_args is not None, "run() before plan()"
        assert q.dtype == self.plan_args["q_data_type"], "q dtype differs from plan()"
        assert kv_cache.dtype == self.plan_args["kv_data_type"], "kv dtype differs from plan()"
        assert q.shape[0] == self.plan_args["qo_indptr"][-1], "q rows differ from plan()"
        if out is not None:
            assert out.shape == q.shape and out.dtype == self.plan_args["o_data_type"]

    def _finish(self, result, out):
        result = result.to(self.plan_args["o_data_type"])
        if out is None:
            return result
        out.copy_(result)
        return out


class FakeDecode(_Wrapper):
    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        backend="auto",
        jit_args=None,
    ):
        self.layout, self.use_tensor_cores = kv_layout, use_tensor_cores
        if use_cuda_graph:
            self._fixed_buffers(
                paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer
            )
        self.plan_args = None
        self.calls.append(("decode", "init", {"use_cuda_graph": use_cuda_graph}))

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *,
        pos_encoding_mode="NONE",
        window_left=-1,
        window_right=0,
        logits_soft_cap=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        sm_scale=None,
        non_blocking=True,
    ):
        batch = len(last_page_len)
        self.plan_args = dict(
            indptr=indptr,
            indices=indices,
            last_page_len=last_page_len,
            qo_indptr=torch.arange(batch + 1),
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            page_size=page_size,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap or 0.0,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type or q_data_type,
            o_data_type=o_data_type or q_data_type,
            sm_scale=sm_scale or head_dim**-0.5,
        )
        self.calls.append(("decode", "plan", dict(self.plan_args, pos=pos_encoding_mode)))
        self.plan_args = self._into_buffers(self.plan_args)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None):
        assert not args, "the decode wrapper takes no extra run() arguments here"
        self._check_run(q, paged_kv_cache, out)
        result = _attend(
            q,
            paged_kv_cache,
            self.layout,
            self.plan_args,
            causal=False,
            k_scale=k_scale,
            v_scale=v_scale,
            sinks=None,
        )
        self.calls.append(("decode", "run", {"rows": q.shape[0], "out": out is not None}))
        return self._finish(result, out)


class FakePrefill(_Wrapper):
    kind = "prefill"

    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        paged_kv_indptr_buf=None,
        paged_kv_indices_buf=None,
        paged_kv_last_page_len_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend="auto",
        jit_args=None,
        jit_kwargs=None,
        variant_owns_mask=False,
    ):
        assert backend in ("auto", "fa2", "fa3")
        self.layout, self.plan_args = kv_layout, None
        if use_cuda_graph:
            self._fixed_buffers(
                paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf, qo_indptr_buf
            )
            assert torch.is_tensor(qo_indptr_buf), (
                "the prefill wrapper's graph mode needs qo_indptr_buf"
            )
        self.calls.append(
            (self.kind, "init", {"backend": backend, "use_cuda_graph": use_cuda_graph})
        )

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        head_dim_vo=None,
        custom_mask=None,
        packed_custom_mask=None,
        causal=False,
        pos_encoding_mode="NONE",
        use_fp16_qk_reduction=False,
        sm_scale=None,
        window_left=-1,
        logits_soft_cap=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking=True,
    ):
        self.causal = causal
        self.plan_args = dict(
            indptr=paged_kv_indptr,
            indices=paged_kv_indices,
            last_page_len=paged_kv_last_page_len,
            qo_indptr=qo_indptr,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            page_size=page_size,
            head_dim=head_dim_qk,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap or 0.0,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type or q_data_type,
            o_data_type=o_data_type or q_data_type,
            sm_scale=sm_scale or head_dim_qk**-0.5,
        )
        self.calls.append((self.kind, "plan", dict(self.plan_args, causal=causal)))
        self.plan_args = self._into_buffers(self.plan_args)

    def run(
        self,
        q,
        paged_kv_cache,
        *args,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        out=None,
        sinks=None,
    ):
        # the real fa2/fa3 paths drop run(sinks=...): nothing may pass it here
        assert sinks is None, "run(sinks=) is ignored by FlashInfer's fa2/fa3 kernels"
        self._check_run(q, paged_kv_cache, out)
        result = _attend(
            q,
            paged_kv_cache,
            self.layout,
            self.plan_args,
            causal=self.causal,
            k_scale=k_scale,
            v_scale=v_scale,
            sinks=self._sinks(args),
        )
        self.calls.append((self.kind, "run", {"rows": q.shape[0], "out": out is not None}))
        return self._finish(result, out)

    def _sinks(self, args):
        assert not args, "the plain prefill wrapper takes no extra run() arguments"


class FakeSink(FakePrefill):
    """The prefill wrapper made with ``jit_args`` naming FlashInfer's AttentionSink
    variant. FlashInfer keeps one compiled module per name (in the process, its JIT
    cache and its ahead-of-time builds): ``modules`` holds what each name was first
    compiled for, and a second wrapper asking the same name for another shape fails,
    as the real one would hand it the first shape's module."""

    kind = "sink"
    modules: dict  # module name -> what it was compiled for (reset per test)

    def __init__(self, float_workspace_buffer, kv_layout="NHD", *, backend, jit_args,
                 jit_kwargs, **buffers):  # fmt: skip
        # FlashInfer's sink wrapper resolves "auto" before it names the module
        assert backend in ("fa2", "fa3"), backend
        name, q, kv, o, idx, dqk, dvo, tensors, tensor_types, scalars, _, variant, decl = jit_args
        assert (variant, tensors, tensor_types, scalars) == (
            "AttentionSink",
            ["sink"],
            ["float"],
            ["sm_scale"],
        )
        assert decl == f"decl-{backend}" and o == q and idx == torch.int32
        swa = jit_kwargs["use_sliding_window"]
        compiled = dict(q=q, kv=kv, d=dqk, dvo=dvo, swa=swa, backend=backend)
        first = self.modules.setdefault(name, compiled)
        assert first == compiled, f"module {name} compiled for {first}, asked for {compiled}"
        super().__init__(float_workspace_buffer, kv_layout, backend=backend, **buffers)
        self.built = compiled

    def plan(self, *args, **kwargs):
        super().plan(*args, **kwargs)
        # the variant is compiled for one window, one dtype pair and one head size
        assert (self.plan_args["window_left"] >= 0) == self.built["swa"]
        assert self.plan_args["q_data_type"] == self.built["q"]
        assert self.plan_args["kv_data_type"] == self.built["kv"]
        assert self.plan_args["head_dim"] == self.built["d"]

    def _sinks(self, args):
        (sinks,) = args
        assert sinks.dtype == torch.float32 and sinks.shape == (self.plan_args["num_qo_heads"],)
        return sinks


def _prefill_wrapper(*args, jit_args=None, jit_kwargs=None, **kwargs):
    """FlashInfer's prefill wrapper: a custom variant where ``jit_args`` name one."""
    if jit_args is None:
        return FakePrefill(*args, **kwargs)
    return FakeSink(*args, jit_args=jit_args, jit_kwargs=jit_kwargs, **kwargs)


@pytest.fixture
def calls(monkeypatch):
    log: list = []
    monkeypatch.setattr(_Wrapper, "calls", log, raising=False)
    fake = SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=FakeDecode,
        BatchPrefillWithPagedKVCacheWrapper=_prefill_wrapper,
        # FlashInfer on a GPU below sm90a picks fa2
        utils=SimpleNamespace(determine_attention_backend=lambda *a, **k: "fa2"),
        jit=SimpleNamespace(
            attention=SimpleNamespace(
                variants=SimpleNamespace(attention_sink_decl={"fa2": "decl-fa2", "fa3": "decl-fa3"})
            )
        ),
    )
    monkeypatch.setattr(FakeSink, "modules", {}, raising=False)
    monkeypatch.setattr(fi_builder, "load_flashinfer", lambda: fake)
    monkeypatch.setattr(fi_builder, "WORKSPACE_BYTES", 1024)  # no 128 MiB on the test host
    return log


class CPUFlashInfer(FlashInferBackend):
    """The real backend, allowed on the CPU so its plumbing runs against the model."""

    capabilities = dataclasses.replace(
        FlashInferBackend.capabilities, devices=frozenset({"cpu", "cuda"})
    )


# -- end to end against the reference ----------------------------------------------

MIXED = dict(seq_lens=(1, 17, 33, 64, 40, 5), query_lens=(1, 17, 5, 1, 8, 0))
ORDERED = dict(seq_lens=(9, 32, 16, 40), query_lens=(1, 1, 16, 7))  # decodes first
SCENARIOS = [
    Scenario("mixed-padded", **MIXED, num_padding_tokens=3),
    Scenario("decode-first", **ORDERED),
    Scenario("pure-decode-exact-pages", seq_lens=(16, 32, 48), query_lens=(1, 1, 1)),
    Scenario("prefill-block5", seq_lens=(23, 9), query_lens=(23, 9), block_size=5),
    Scenario("gqa5-bf16-d128", **MIXED, num_heads=10, num_kv_heads=2, head_size=128,
             dtype=torch.bfloat16),
    Scenario("window-smaller-than-block", **MIXED, sliding_window=5),
    Scenario("window-softcap", **MIXED, sliding_window=20, logits_soft_cap=5.0),
    Scenario("sinks", **MIXED, use_sinks=True),
    Scenario("sinks-window", **MIXED, use_sinks=True, sliding_window=7),
    Scenario("non-causal", seq_lens=(30, 12, 7), query_lens=(30, 12, 1), causal=False),
    Scenario("fp8-e4m3", **MIXED, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0),
    Scenario("fp8-e5m2", **MIXED, kv_cache_dtype="fp8_e5m2", k_scale=0.25, v_scale=1.5),
]  # fmt: skip


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_plumbing_matches_reference(calls, scenario, layout):
    backend = CPUFlashInfer(kv_layout=layout)
    result = run_scenario(backend, scenario, "cpu", backend_label=repr(backend))
    assert result.passed, result.report()
    kinds = {c[0] for c in calls if c[1] == "run"}
    query_lens = scenario.query_lens
    if scenario.use_sinks:  # every row through the sink variant
        assert kinds == {"sink"}
    else:
        assert ("decode" in kinds) == (1 in query_lens)
        assert ("prefill" in kinds) == any(q > 1 for q in query_lens)


def test_sink_layers_of_other_shapes_get_their_own_modules(calls):
    """FlashInfer keeps one module per name (the fake fails a name asked for two shapes),
    so each sink layer's module is named for everything it is compiled for."""
    backend = CPUFlashInfer()
    for scenario in (
        Scenario("sinks-d64", **MIXED, use_sinks=True),
        Scenario("sinks-d128", **MIXED, use_sinks=True, head_size=128),
        Scenario("sinks-d128-bf16", **MIXED, use_sinks=True, head_size=128, dtype=torch.bfloat16),
        Scenario("sinks-d128-window", **MIXED, use_sinks=True, head_size=128, sliding_window=9),
    ):
        result = run_scenario(backend, scenario, "cpu", backend_label=repr(backend))
        assert result.passed, result.report()
    assert len(FakeSink.modules) == 4


def test_sink_module_names_name_every_compiled_parameter():
    base = SinkModule(torch.float16, torch.float16, 64, 64, False, "fa3")
    others = [
        dataclasses.replace(base, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16),
        dataclasses.replace(base, kv_dtype=torch.bfloat16),
        dataclasses.replace(base, head_dim_qk=128),
        dataclasses.replace(base, head_dim_vo=128),
        dataclasses.replace(base, use_sliding_window=True),
        dataclasses.replace(base, backend="fa2"),
    ]
    names = [m.name for m in [base, *others]]
    assert len(set(names)) == len(names)
    assert [SinkModule.parse(n) for n in names] == [base, *others]
    with pytest.raises(ValueError, match="not a pagedkv attention-sink module name"):
        SinkModule.parse("batch_prefill_attention_sink_f16_swa_False_fa3")


def test_plan_arguments(calls):
    spec = AttentionSpec(
        num_heads=8,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float16,
        block_size=16,
        sliding_window=20,
        logits_soft_cap=30.0,
        kv_cache_dtype="fp8_e4m3",
    )
    builder = CPUFlashInfer(prefill_backend="fa2").make_builder(spec, "cpu")
    common = CommonAttentionMetadata.from_requests(
        [17, 40], [1, 8], [[3, 4], [5, 6, 7]], block_size=16
    )
    builder.build(common)
    plans = {c[0]: c[2] for c in calls if c[1] == "plan"}
    inits = {c[0]: c[2] for c in calls if c[1] == "init"}
    assert inits["prefill"] == {"backend": "fa2", "use_cuda_graph": False}
    decode, prefill = plans["decode"], plans["prefill"]
    assert decode["window_left"] == prefill["window_left"] == 19  # inclusive bound: w - 1
    assert decode["logits_soft_cap"] == 30.0 and decode["sm_scale"] == 64**-0.5
    assert decode["kv_data_type"] == torch.float8_e4m3fn
    assert decode["q_data_type"] == decode["o_data_type"] == torch.float16
    assert decode["indptr"].tolist() == [0, 2] and decode["last_page_len"].tolist() == [1]
    assert decode["indices"].tolist() == [3, 4]
    assert prefill["qo_indptr"].tolist() == [0, 8] and prefill["causal"] is True
    assert prefill["indices"].tolist() == [5, 6, 7] and prefill["last_page_len"].tolist() == [8]


def test_wrappers_and_workspace_are_created_once(calls):
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float16, block_size=4
    )
    builder = CPUFlashInfer().make_builder(spec, "cpu")
    workspace = builder.workspace
    for step in range(3):
        builder.build(
            CommonAttentionMetadata.from_requests(
                [5 + step, 9], [1, 3], [[1, 2], [3, 4, 5]], block_size=4
            )
        )
    assert [c[0] for c in calls if c[1] == "init"] == ["decode", "prefill"]
    assert len([c for c in calls if c[1] == "plan"]) == 6
    assert builder.workspace is workspace


def _decode_setup():
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float16, block_size=4
    )
    backend = CPUFlashInfer()
    builder, impl = backend.make_builder(spec, "cpu"), backend.make_impl(spec)
    cache = backend.allocate_kv_cache(16, spec, "cpu")
    return builder, impl, cache


# -- CUDA graphs: padded pure-decode steps on fixed buffers ------------------------------

BOUNDS = GraphBounds(max_num_reqs=4, max_num_tokens=6, max_blocks_per_req=3)


def test_graph_steps_plan_one_fixed_buffer_wrapper_sized_from_the_bounds(calls):
    builder, impl, cache = _decode_setup()
    builder.reserve_cuda_graph(BOUNDS)
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    step_a = CommonAttentionMetadata.from_requests([5, 9, 2], [1, 1, 1], tables, block_size=4)
    # fewer requests, one of them without a query token this step
    step_b = CommonAttentionMetadata.from_requests([12, 7], [1, 0], tables[:2], block_size=4)
    md_a = builder.build(step_a)
    wrapper = md_a.launches[0].planned.wrapper
    md_b = builder.build(step_b)
    inits = [c for c in calls if c[1] == "init"]
    assert inits == [("decode", "init", {"use_cuda_graph": True})]  # one wrapper, re-planned
    # min(4 requests, 6 rows) = 4 FlashInfer requests, one per token row
    assert [len(b) for b in wrapper.buffers.values() if b is not None] == [5, 12, 4]
    assert md_b.cuda_graph and md_b.launches[0].rows == slice(0, 4)
    assert md_b.launches[0].planned.wrapper is wrapper
    plan_b = [c[2] for c in calls if c[1] == "plan"][-1]
    # row 0 reads request 0's pages; rows 1..3 are padding: the null block, one token
    assert plan_b["indptr"].tolist() == [0, 3, 4, 5, 6]
    assert plan_b["indices"].tolist() == [1, 2, 3, 0, 0, 0]
    assert plan_b["last_page_len"].tolist() == [4, 1, 1, 1]
    q = torch.randn(6, 4, 64).half()
    impl.forward(q, None, None, cache, md_b)
    with pytest.raises(UnsupportedError, match="stale FlashInfer plan"):
        impl.forward(q, None, None, cache, md_a)


def _graph_run(scenario, layout):
    """Reserve, build the scenario's step into the graph buffers, attend, compare."""
    problem = build_problem(scenario, "cpu")
    backend = CPUFlashInfer(kv_layout=layout)
    spec = problem.spec
    cache = backend.allocate_kv_cache(problem.num_blocks, spec, "cpu")
    builder, impl = backend.make_builder(spec, "cpu"), backend.make_impl(spec, sinks=problem.sinks)
    context = pagedkv.BackendMetadata(problem.context)  # the writer needs only its slots
    keys = [
        k[: s - q]
        for k, s, q in zip(problem.keys, scenario.seq_lens, scenario.query_lens, strict=True)
    ]
    values = [
        v[: s - q]
        for v, s, q in zip(problem.values, scenario.seq_lens, scenario.query_lens, strict=True)
    ]
    impl.write_kv(torch.cat(keys), torch.cat(values), cache, context)
    width = max(len(ids) for ids in problem.block_ids) + 1
    builder.reserve_cuda_graph(
        GraphBounds(max_num_reqs=len(scenario.seq_lens) + 2, max_num_tokens=problem.common.num_tokens + 3,
                    max_blocks_per_req=width)
    )  # fmt: skip
    md = builder.build(problem.common)
    rows = md.num_tokens
    pad = lambda t: torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])  # noqa: E731
    out = impl.forward(pad(problem.query), pad(problem.new_key), pad(problem.new_value), cache, md)
    n = problem.common.num_actual_tokens
    expected = reference_output(problem)
    tol = TOLERANCES[spec.dtype]
    err = (out[:n].double() - expected).abs()
    assert bool((err <= tol.atol + tol.rtol * expected.abs()).all()), float(err.max())
    return md


DECODES = dict(seq_lens=(1, 17, 33, 64, 40), query_lens=(1, 1, 1, 1, 1))
GRAPH_SCENARIOS = [
    Scenario("graph-decode", **DECODES, num_padding_tokens=1),
    Scenario("graph-decode-empty-request", seq_lens=(9, 30, 16), query_lens=(1, 0, 1)),
    Scenario("graph-gqa5-window-softcap", **DECODES, num_heads=10, sliding_window=20,
             logits_soft_cap=5.0),
    Scenario("graph-fp8-e4m3", **DECODES, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0),
    Scenario("graph-sinks", **DECODES, use_sinks=True),
]  # fmt: skip


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("scenario", GRAPH_SCENARIOS, ids=lambda s: s.name)
def test_graph_steps_match_the_reference(calls, scenario, layout):
    md = _graph_run(scenario, layout)
    (launch,) = md.launches
    kind = "sink" if scenario.use_sinks else "decode"
    # the sink variant's kernel family is resolved before its module is named
    init = {"use_cuda_graph": True} | ({"backend": "fa2"} if scenario.use_sinks else {})
    assert [c for c in calls if c[1] == "init"] == [(kind, "init", init)]
    assert launch.pass_sinks == scenario.use_sinks and launch.planned.wrapper.graph


def test_graph_reservations_are_pure_decode(calls):
    builder, _impl, _cache = _decode_setup()
    with pytest.raises(UnsupportedError, match="declares graph support pure_decode"):
        builder.reserve_cuda_graph(
            GraphBounds(max_num_reqs=2, max_num_tokens=8, max_blocks_per_req=2, max_query_len=4)
        )
    builder.reserve_cuda_graph(BOUNDS)
    mixed = CommonAttentionMetadata.from_requests([5, 9], [1, 3], [[1, 2], [3, 4, 5]], 4)
    with pytest.raises(MetadataError, match="max_query_len = 3 exceeds the CUDA-graph reservation"):
        builder.build(mixed)
    wide = CommonAttentionMetadata.from_requests([13], [1], [[1, 2, 3, 4]], 4)
    with pytest.raises(MetadataError, match="needs 4 blocks but the CUDA-graph reservation"):
        builder.build(wide)


def test_capture_refuses_metadata_built_without_a_reservation(calls, monkeypatch):
    builder, impl, cache = _decode_setup()
    md = builder.build(CommonAttentionMetadata.from_requests([5], [1], [[1, 2]], 4))
    monkeypatch.setattr(fi_impl, "_capturing", lambda: True)
    with pytest.raises(UnsupportedError, match="built without a reservation"):
        impl.forward(torch.randn(1, 4, 64).half(), None, None, cache, md)
    builder.reserve_cuda_graph(BOUNDS)
    graph_md = builder.build(CommonAttentionMetadata.from_requests([5], [1], [[1, 2]], 4))
    impl.forward(torch.randn(6, 4, 64).half(), None, None, cache, graph_md)


def test_forward_rejects_a_cache_of_the_other_layout(calls):
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float16, block_size=4
    )
    nhd, hnd = CPUFlashInfer(kv_layout="NHD"), CPUFlashInfer(kv_layout="HND")
    md = nhd.make_builder(spec, "cpu").build(
        CommonAttentionMetadata.from_requests([5], [1], [[1, 2]], 4)
    )
    wrong = hnd.allocate_kv_cache(4, spec, "cpu")
    with pytest.raises(UnsupportedError, match=r"kv_cache: expected the NHD layout"):
        nhd.make_impl(spec).forward(torch.randn(1, 4, 64).half(), None, None, wrong, md)
    fp8 = torch.zeros(nhd.get_kv_cache_shape(4, 4, 2, 64), dtype=torch.float8_e4m3fn)
    with pytest.raises(UnsupportedError, match="kv_cache: expected dtype torch.float16"):
        nhd.make_impl(spec).forward(torch.randn(1, 4, 64).half(), None, None, fp8, md)


def test_registered_under_its_entry_point():
    backend = pagedkv.get_backend("flashinfer", kv_layout="HND")
    assert isinstance(backend, FlashInferBackend) and backend.options["kv_layout"] == "HND"


@pytest.mark.parametrize("use_sinks", [False, True], ids=["plain", "sinks"])
def test_the_gpu_graph_check_runs_on_the_model(calls, use_sinks):
    """tests/test_flashinfer_gpu.py's graph steps, each "replay" an eager forward."""
    steps = [s.replace(use_sinks=use_sinks) for s in DECODE_STEPS]
    results = replay_errors(CPUFlashInfer(prefill_backend="fa2"), steps, DECODE_BOUNDS, "cpu")
    assert len(results) == len(steps) + 1 and all(ok for _, _, ok in results), results
