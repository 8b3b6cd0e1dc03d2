"""The Triton backend's Gluon sm_90 prefill kernel: every variant its planner can choose
compiles for sm_90 without a GPU, without register spills and without ptxas
serialising its wgmmas; and the planner's refusals, on the host.

The launches are planned as on an H200 (capability (9, 0)) from conformance problems
on the CPU, argument for argument (TMA descriptors over the problem's cache views),
then compiled by ``triton_compile`` in subprocesses, in a fresh Triton cache so that
ptxas runs and reports registers and spills. The kernel runs against the reference
in test_triton_gluon_prefill_gpu.py on an H100/H200.
"""

from __future__ import annotations

import dataclasses

import pagedkv
import pytest
import torch
from pagedkv import AttentionSpec
from pagedkv.conformance import Scenario
from pagedkv.conformance.problem import build_problem
from pagedkv.errors import UnsupportedError
from pagedkv.toolkit.launch import KernelLaunch
from pagedkv.toolkit.triton_helpers import LOG2E

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
from triton.backends.nvidia.compiler import get_ptxas

try:
    _PTXAS = get_ptxas(90).path
except Exception as exc:  # RuntimeError when Triton ships no ptxas and none is on PATH
    _PTXAS = None
    _PTXAS_WHY = f"no ptxas for sm_90: {exc}"
pytestmark = pytest.mark.skipif(_PTXAS is None, reason=_PTXAS_WHY if _PTXAS is None else "")

from pagedkv.backends.triton.gluon_plan import (  # noqa: E402
    TILES,
    gluon_cache_args,
    gluon_cache_problem,
    gluon_layer_args,
    gluon_prefill_problem,
    gluon_step_problem,
    plan_gluon_prefill,
)
from triton_compile import compile_launches  # noqa: E402

HOPPER = (9, 0)
# a chunk after context, a whole prefill, a decode row and a ragged tail
STEP = dict(seq_lens=(300, 130, 17), query_lens=(100, 130, 1))
NUM_KV_HEADS = 2


@dataclasses.dataclass(frozen=True)
class Variant:
    head_size: int
    block_size: int
    group: int
    dtype: torch.dtype
    causal: bool = True

    @property
    def label(self) -> str:
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]
        causal = "" if self.causal else "-non-causal"
        return f"d{self.head_size}-b{self.block_size}-g{self.group}-{dtype}{causal}"

    def scenario(self) -> Scenario:
        return Scenario(
            self.label,
            **STEP,
            num_heads=NUM_KV_HEADS * self.group,
            num_kv_heads=NUM_KV_HEADS,
            head_size=self.head_size,
            block_size=self.block_size,
            dtype=self.dtype,
            causal=self.causal,
        )


def _variants() -> list[Variant]:
    out = [
        Variant(d, b, g, dtype)
        for d in (64, 128)
        for b in (16, 32, 64)
        for g in (1, 4, 8)
        for dtype in (torch.bfloat16, torch.float16)
    ]
    # 256-wide heads (64-key tiles: one box per 64-row page, two boxes per 128-row one)
    out += [Variant(256, b, g, torch.bfloat16) for b, g in ((16, 4), (64, 1), (128, 8))]
    out.append(Variant(128, 128, 4, torch.bfloat16))  # one page per key tile
    out += [Variant(d, 16, 4, torch.bfloat16, causal=False) for d in (64, 128)]
    return out


VARIANTS = _variants()


def _launch(variant: Variant) -> KernelLaunch:
    problem = build_problem(variant.scenario(), "cpu")
    spec = problem.spec
    assert gluon_prefill_problem(spec, "cpu", capability=HOPPER) is None
    assert gluon_step_problem(problem.common, spec, num_splits=1) is None
    backend = pagedkv.get_backend("triton")
    cache = backend.allocate_kv_cache(problem.num_blocks, spec, "cpu")
    k_view, v_view = backend.kv_cache_to_logical(cache, spec)
    step = plan_gluon_prefill(spec, problem.common)
    out = torch.empty_like(problem.query)
    return step.launch(
        problem.query, out, gluon_layer_args(spec), gluon_cache_args(spec, k_view, v_view)
    )


def test_every_planned_variant_compiles_for_sm90_without_spills(tmp_path, monkeypatch):
    # a fresh cache: ptxas runs for every variant, so its register report is checked
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    launches = [_launch(v) for v in VARIANTS]
    results = compile_launches(launches, labels=[v.label for v in VARIANTS])
    failed = [str(r) for r in results if not r.ok]
    assert not failed, "\n\n".join(failed)
    unreported = [r.label for r in results if r.spill_bytes is None]
    assert not unreported, f"ptxas did not run for {unreported}"
    spilled = [str(r) for r in results if r.spill_bytes]
    assert not spilled, "register spills:\n" + "\n".join(spilled)
    serialized = [str(r) for r in results if r.wgmma_serialized]
    assert not serialized, "wgmma serialized (C7514):\n" + "\n".join(serialized)


def test_the_variants_cover_the_planner():
    """Every head size, block size, group and dtype the brief of the kernel names."""
    seen = {(v.head_size, v.block_size, v.group, v.dtype) for v in VARIANTS}
    for d in (64, 128):
        for b in (16, 32, 64):
            for g in (1, 4, 8):
                for dtype in (torch.bfloat16, torch.float16):
                    assert (d, b, g, dtype) in seen
    assert {v.head_size for v in VARIANTS} == set(TILES)


# -- the planner ---------------------------------------------------------------------------


def _spec(**changes) -> AttentionSpec:
    fields = dict(num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=16)
    fields.update(changes)
    return AttentionSpec(**fields)


def test_applies_to_16_bit_prefill_layers_on_sm90():
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128, 256):
            for b in (16, 32, 64, 128):
                for heads in (8, 32, 64):
                    spec = _spec(dtype=dtype, head_size=d, block_size=b, num_heads=heads)
                    assert gluon_prefill_problem(spec, "cpu", capability=HOPPER) is None
    assert gluon_prefill_problem(_spec(causal=False), "cpu", capability=HOPPER) is None


@pytest.mark.parametrize(
    ("changes", "capability", "reason"),
    [
        ({}, (8, 0), "sm_90"),
        ({}, (10, 0), "sm_90"),
        ({"dtype": torch.float32}, HOPPER, "16-bit"),
        ({"kv_cache_dtype": "fp8_e4m3"}, HOPPER, "fp8 cache"),
        ({"kv_cache_dtype": "fp8_e5m2"}, HOPPER, "fp8 cache"),
        ({"head_size": 96}, HOPPER, "head size 96"),
        ({"head_size": 80}, HOPPER, "head size 80"),
        ({"block_size": 48}, HOPPER, "block size 48"),
        ({"block_size": 8}, HOPPER, "block size 8"),
        ({"block_size": 256}, HOPPER, "block size 256"),
        ({"sliding_window": 128}, HOPPER, "sliding window"),
        ({"logits_soft_cap": 30.0}, HOPPER, "soft cap"),
        ({"alibi_slopes": tuple([0.5] * 32)}, HOPPER, "ALiBi"),
        ({"use_sinks": True}, HOPPER, "sinks"),
        ({"num_heads": 256, "num_kv_heads": 1}, HOPPER, "GQA group 256/1"),
    ],
)
def test_the_planner_names_why_not(changes, capability, reason):
    why = gluon_prefill_problem(_spec(**changes), "cpu", capability=capability)
    assert why is not None and reason in why, why


def test_no_gpu_or_the_interpreter_is_refused():
    why = gluon_prefill_problem(_spec(), "cpu")
    # this process runs Triton's interpreter on a machine without a GPU
    assert why is not None and ("interpreter" in why or "CUDA device" in why)


def test_split_and_decode_steps_go_to_the_portable_kernel():
    spec = _spec()  # GQA 4: a 128-row tile is 32 tokens
    blocks = [list(range(1 + 16 * i, 17 + 16 * i)) for i in range(2)]
    chunk = pagedkv.CommonAttentionMetadata.from_requests([256, 100], [32, 1], blocks, 16)
    decode = pagedkv.CommonAttentionMetadata.from_requests([256, 100], [31, 1], blocks, 16)
    assert gluon_step_problem(chunk, spec, num_splits=1) is None
    assert "split-KV" in gluon_step_problem(chunk, spec, num_splits=4)
    assert "fills a 128-row tile" in gluon_step_problem(decode, spec, num_splits=1)


def test_the_step_plan_packs_whole_gqa_groups_and_bounds_the_grid():
    blocks = [list(range(1 + 16 * i, 17 + 16 * i)) for i in range(3)]
    common = pagedkv.CommonAttentionMetadata.from_requests(
        [256, 100, 33], [200, 100, 1], blocks, 16, num_tokens=305
    )
    for group, block_q in ((1, 128), (4, 32), (8, 16), (6, 21)):
        step = plan_gluon_prefill(_spec(num_heads=8 * group), common)
        assert step.kwargs["GROUP"] == group and step.kwargs["BLOCK_Q"] == block_q
        # request i's query blocks start at query_start_loc[i] // BLOCK_Q + i (padded T)
        assert step.grid == (305 // block_q + 3, 8)
    step = plan_gluon_prefill(_spec(head_size=256), common)
    assert (step.kwargs["TILE_N"], step.kwargs["STAGES"]) == TILES[256]
    assert step.kwargs["maxnreg"] * 3 * 128 <= 65536  # three warpgroups' registers fit an SM


def _views(spec: AttentionSpec, num_blocks: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    backend = pagedkv.get_backend("triton")
    cache = backend.allocate_kv_cache(num_blocks, spec, "cpu")
    return backend.kv_cache_to_logical(cache, spec)


def test_descriptors_box_one_page_of_one_head():
    for d, b in ((128, 16), (64, 64), (256, 128)):
        spec = _spec(head_size=d, block_size=b)
        k, v = _views(spec)
        args = gluon_cache_args(spec, k, v)
        box = min(b, TILES[d][0])
        for desc, view in ((args["KCache"], k), (args["VCache"], v)):
            assert list(desc.shape) == [5 * b, 8 * d] and list(desc.block_shape) == [box, d]
            assert desc.base.data_ptr() == view.data_ptr()
        assert args["oob_row"] == 5 * b  # the first row past the cache: TMA reads zeros


def test_a_cache_tma_cannot_read_is_refused():
    spec = _spec()
    k, v = _views(spec)
    assert gluon_cache_problem(k, v) is None
    # heads not adjacent in a row: not a dense [rows, Hkv * D] matrix
    strided = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert "dense rows" in gluon_cache_problem(strided, v)
    storage = torch.zeros(k.numel() + 1, dtype=k.dtype)
    misaligned = storage[1:].view(k.shape)
    assert "16-byte aligned" in gluon_cache_problem(k, misaligned)
    with pytest.raises(UnsupportedError, match="kv_cache: the K view's strides"):
        gluon_cache_args(spec, strided, v)


def test_16_bit_caches_hold_k_and_v_unscaled():
    # docs/contract.md: only fp8 caches store x / scale
    spec = _spec(scale=0.25, k_scale=2.0, v_scale=0.5)
    assert gluon_layer_args(spec) == dict(qk_scale=0.25 * LOG2E, v_scale=1.0, CAUSAL=True)
    assert gluon_layer_args(_spec(causal=False))["CAUSAL"] is False


def test_the_launch_completes_the_step_with_the_layers_tensors():
    spec = _spec()
    blocks = [list(range(1, 17))]
    common = pagedkv.CommonAttentionMetadata.from_requests([256], [200], blocks, 16)
    k, v = _views(spec, 17)
    q = torch.zeros(200, 32, 128, dtype=torch.bfloat16)
    out = torch.zeros(200, 40, 128, dtype=torch.bfloat16)[:, :32]
    step = plan_gluon_prefill(spec, common)
    launch = step.launch(q, out, gluon_layer_args(spec), gluon_cache_args(spec, k, v))
    assert launch.kernel.fn.__name__ == "gluon_prefill_kernel" and launch.grid == step.grid
    assert launch.kwargs["Q"] is q and launch.kwargs["Out"] is out
    assert (launch.kwargs["stride_qt"], launch.kwargs["stride_qh"]) == (32 * 128, 128)
    assert (launch.kwargs["stride_ot"], launch.kwargs["stride_oh"]) == (40 * 128, 128)
    assert launch.kwargs["KCache"].base is k and launch.kwargs["BlockTable"] is common.block_table
    with pytest.raises(UnsupportedError, match="query: the head dimension"):
        step.launch(q.transpose(1, 2), q, gluon_layer_args(spec), gluon_cache_args(spec, k, v))
