"""When the MLA backend plans its Gluon sm_90 kernel, and the host side of that kernel
(TMA descriptors), without a GPU. The kernel itself compiles in test_mla_compile.py
and runs against the reference in test_mla_gpu.py and the conformance suite on an
H100/H200."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pagedkv import AttentionSpec
from pagedkv.backends.mla import MLABackend
from pagedkv.backends.mla.builder import MLAMetadataBuilder
from pagedkv.backends.mla.configs import choose_config, gluon_piece_width
from pagedkv.conformance import Scenario

pytest.importorskip("triton.experimental.gluon")
from pagedkv.backends.mla.plan import (
    GLUON,
    cache_problem,
    gluon_problem,
    layer_args,
    query_descriptor,
)

HOPPER = (9, 0)
SM90 = choose_config("sm90", 2, 512, 64)


def _spec(lora=512, rope=64, heads=128, block_size=64, dtype=torch.bfloat16, cache=None):
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=1,
        head_size=lora + rope,
        dtype=dtype,
        block_size=block_size,
        scale=0.1,
        kv_lora_rank=lora,
        qk_rope_head_dim=rope,
        kv_cache_dtype=cache or "auto",
    )


def test_applies_to_the_deepseek_shape_on_sm90_in_16_bit():
    for dtype in (torch.bfloat16, torch.float16):
        assert gluon_problem(_spec(dtype=dtype), SM90, HOPPER) is None
    for lora, block_size in ((256, 64), (128, 128), (512, 256)):
        assert gluon_problem(_spec(lora=lora, block_size=block_size), SM90, HOPPER) is None


@pytest.mark.parametrize(
    ("spec", "capability", "reason"),
    [
        (_spec(), (8, 0), "sm_90"),
        (_spec(), (10, 0), "sm_90"),
        (_spec(), None, "no GPU"),
        (_spec(dtype=torch.float32), HOPPER, "16-bit"),
        (_spec(cache="fp8_e4m3"), HOPPER, "16-bit"),
        (_spec(lora=48), HOPPER, "kv_lora_rank"),
        (_spec(lora=64), HOPPER, "kv_lora_rank"),  # a half of 32 columns: too narrow
        (_spec(lora=1024), HOPPER, "kv_lora_rank"),
        (_spec(rope=32), HOPPER, "rope 64"),
        (_spec(block_size=16), HOPPER, "multiple of 64"),
        (_spec(block_size=96), HOPPER, "multiple of 64"),
        (_spec(heads=48), HOPPER, "48 heads neither divide 64"),
        (_spec(heads=96), HOPPER, "96 heads neither divide 64"),
    ],
)
def test_gluon_problem_names_why_not(spec, capability, reason):
    why = gluon_problem(spec, SM90, capability)
    assert why is not None and reason in why


def test_a_misaligned_cache_is_not_handed_to_tma():
    storage = torch.zeros(8 * 64 * 576 + 1, dtype=torch.bfloat16)
    misaligned = storage[1:].view(8, 64, 576)
    assert cache_problem(misaligned, GLUON) == "the cache is not 16-byte aligned (TMA)"
    assert cache_problem(storage[:-1].view(8, 64, 576), GLUON) is None


def test_pieces_are_whole_64_column_units_of_a_half():
    for lora in (128, 256, 512):
        width = gluon_piece_width(lora)
        assert width % 64 == 0 and (lora // 2) % width == 0
        assert 2 * (lora // 2 // width) * 2 <= 16  # barriers: 2 slots x 2 halves x pieces


def test_descriptors_cover_the_cache_rows():
    spec = _spec()
    cache = torch.zeros(8, 64, 576, dtype=torch.bfloat16)
    args = layer_args(GLUON, cache, spec, 64).attention
    kv, pe = args["half_desc"], args["rope_desc"]
    assert kv.base.data_ptr() == cache.data_ptr() == pe.base.data_ptr()
    assert list(kv.shape) == [8 * 64, 576] and list(kv.strides) == [576, 1]
    assert list(kv.block_shape) == [64, gluon_piece_width(512)]
    assert list(pe.block_shape) == [64, 64]
    assert args["oob_row"] == 8 * 64


def test_head_counts_that_divide_64_or_are_its_multiples_apply():
    for heads in (1, 2, 8, 16, 32, 64, 128, 256):
        assert gluon_problem(_spec(heads=heads), SM90, HOPPER) is None


@pytest.mark.parametrize(
    ("heads", "box"), [(128, [1, 64, 64]), (64, [1, 64, 64]), (16, [4, 16, 64])]
)
def test_a_query_box_is_one_tiles_rows_token_major(heads, box):
    # the absorbed query as absorb_query returns it: [H, T, L] seen as [T, H, L]
    q_nope = torch.zeros(heads, 10, 512, dtype=torch.bfloat16).transpose(0, 1)
    desc = query_descriptor(q_nope)
    assert desc.base.data_ptr() == q_nope.data_ptr()  # no copy
    assert list(desc.shape) == [10, heads, 512] and list(desc.strides) == [512, 10 * 512, 1]
    assert list(desc.block_shape) == box
    # q_pe as a slice of the concatenated query: its rows 576 apart, 64 wide
    q_pe = torch.zeros(10, heads, 576, dtype=torch.bfloat16)[..., 512:]
    pe = query_descriptor(q_pe)
    assert pe.base.data_ptr() == q_pe.data_ptr() and list(pe.strides) == [heads * 576, 576, 1]
    assert list(pe.block_shape) == box


def test_a_query_tma_cannot_read_is_copied_first():
    storage = torch.zeros(10 * 128 * 512 + 1, dtype=torch.bfloat16)
    misaligned = storage[1:].view(10, 128, 512)
    desc = query_descriptor(misaligned)
    assert desc.base.data_ptr() % 16 == 0 and list(desc.strides) == [128 * 512, 512, 1]
    assert torch.equal(desc.base, misaligned)
    odd_rows = torch.zeros(10, 128, 516, dtype=torch.bfloat16)[..., :512]  # 1032-byte rows
    desc = query_descriptor(odd_rows)
    assert desc.base.is_contiguous() and torch.equal(desc.base, odd_rows)


def test_a_query_descriptor_equals_one_gluon_builds_and_checks_it_once_a_shape(monkeypatch):
    from triton.experimental.gluon.nvidia import hopper

    q_nope = torch.zeros(128, 10, 512, dtype=torch.bfloat16).transpose(0, 1)
    first = query_descriptor(q_nope)
    built = hopper.TensorDescriptor(
        q_nope, list(q_nope.shape), list(q_nope.stride()), first.block_shape, first.layout
    )
    assert first == built  # every field, the base tensor's identity included
    other = torch.zeros(128, 10, 512, dtype=torch.bfloat16).transpose(0, 1)
    expected = dataclasses.replace(first, base=other)
    checked = []
    monkeypatch.setattr(hopper.TensorDescriptor, "__post_init__", lambda d: checked.append(d))
    again = query_descriptor(other)
    assert again.base is other and again == expected
    assert checked == []  # the same dtype, shape and strides: checked before
    query_descriptor(torch.zeros(128, 11, 512, dtype=torch.bfloat16).transpose(0, 1))
    assert len(checked) == 1  # a new shape: Gluon's checks run


def _metadata(capability=HOPPER, **options):
    scenario = Scenario("x", (300, 40), (1, 1), kv_lora_rank=512, qk_rope_head_dim=64,
                        num_heads=128, block_size=64, dtype=torch.bfloat16)  # fmt: skip
    spec = scenario.spec()
    backend = MLABackend(**options)
    builder = MLAMetadataBuilder(spec, "cpu", **backend.options)  # planning only
    # plan as on an H200, keeping what the config string asked for
    builder.config = dataclasses.replace(SM90, use_gluon=builder.config.use_gluon)
    builder.capability = capability
    from pagedkv.conformance.problem import build_problem

    problem = build_problem(scenario, "cpu")
    return builder.build(problem.common)


def test_the_builder_plans_the_gluon_kernel_unless_a_triton_tile_is_named():
    assert _metadata().plan.kind == GLUON
    assert _metadata(capability=None).plan.kind != GLUON
    for options in ({"use_gluon": False}, {"num_stages": 1}, {"block_n": 32}):
        md = _metadata(**options)
        assert not md.config.use_gluon and md.plan.kind != GLUON, options
    md = _metadata(num_stages=1, use_gluon=True)
    assert md.config.use_gluon and md.plan.kind == GLUON


def test_tiles_other_than_64_rows_stay_on_the_triton_kernel():
    spec = _spec()
    config = dataclasses.replace(SM90, block_m=32)
    assert "tiles of 64 rows" in gluon_problem(spec, config, HOPPER)
    # ranges of whole 32-key steps: not whole 64-row tiles
    half = dataclasses.replace(SM90, block_n=32)
    assert "tiles of 64 rows" in gluon_problem(spec, half, HOPPER)


def test_the_backend_declares_the_option():
    assert "use_gluon" in MLABackend.option_specs
