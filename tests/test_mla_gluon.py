"""When the MLA backend hands a launch to its Gluon sm_90 kernel, and the host side of
that kernel (TMA descriptors), without a GPU. The kernel itself compiles in
test_mla_compile.py and runs against the reference in test_mla_gpu.py and the
conformance suite on an H100/H200."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pagedkv.backends.mla import MLABackend
from pagedkv.backends.mla.configs import choose_config
from pagedkv.backends.mla.impl import MLAMetadataBuilder
from pagedkv.conformance import Scenario

pytest.importorskip("triton.experimental.gluon")
from pagedkv.backends.mla import gluon_kernels
from pagedkv.backends.mla.kernels import gluon_applies

HOPPER = (9, 0)


def _tensors(lora=512, rope=64, heads=128, block_size=64, dtype=torch.bfloat16, cache_dtype=None):
    q_nope = torch.zeros(2, heads, lora, dtype=dtype)
    q_pe = torch.zeros(2, heads, rope, dtype=dtype)
    cache = torch.zeros(8, block_size, lora + rope, dtype=cache_dtype or dtype)
    return q_nope, q_pe, cache


def test_applies_to_the_deepseek_shape_on_sm90_in_16_bit():
    for dtype in (torch.bfloat16, torch.float16):
        assert gluon_kernels.applies(*_tensors(dtype=dtype), HOPPER) is None
    for lora, block_size in ((256, 64), (128, 128), (512, 256)):
        assert gluon_kernels.applies(*_tensors(lora=lora, block_size=block_size), HOPPER) is None


@pytest.mark.parametrize(
    ("tensors", "capability", "reason"),
    [
        (_tensors(), (8, 0), "sm_90"),
        (_tensors(), (10, 0), "sm_90"),
        (_tensors(dtype=torch.float32), HOPPER, "16-bit"),
        (_tensors(cache_dtype=torch.float8_e4m3fn), HOPPER, "16-bit"),
        (_tensors(lora=48), HOPPER, "kv_lora_rank"),
        (_tensors(lora=64), HOPPER, "kv_lora_rank"),  # a half of 32 columns: too narrow
        (_tensors(lora=1024), HOPPER, "kv_lora_rank"),
        (_tensors(rope=32), HOPPER, "rope 64"),
        (_tensors(block_size=16), HOPPER, "multiple of 64"),
        (_tensors(block_size=96), HOPPER, "multiple of 64"),
    ],
)
def test_applies_names_why_not(tensors, capability, reason):
    why = gluon_kernels.applies(*tensors, capability)
    assert why is not None and reason in why


def test_a_non_contiguous_cache_is_not_handed_to_tma():
    q_nope, q_pe, _ = _tensors()
    wider = torch.zeros(8, 64, 640, dtype=torch.bfloat16)[..., :576]
    assert "contiguous" in gluon_kernels.applies(q_nope, q_pe, wider, HOPPER)


def test_pieces_are_whole_64_column_units_of_a_half():
    for lora in (128, 256, 512):
        width = gluon_kernels.piece_width(lora)
        assert width % 64 == 0 and (lora // 2) % width == 0
        assert 2 * (lora // 2 // width) * 2 <= 16  # barriers: 2 slots x 2 halves x pieces


def test_descriptors_cover_the_cache_rows_and_are_reused():
    _, _, cache = _tensors()
    kv, pe = gluon_kernels.descriptors(cache, 512, 64)
    assert kv.base.data_ptr() == cache.data_ptr() == pe.base.data_ptr()
    assert list(kv.shape) == [8 * 64, 576] and list(kv.strides) == [576, 1]
    assert list(kv.block_shape) == [64, gluon_kernels.piece_width(512)]
    assert list(pe.block_shape) == [64, 64]
    assert gluon_kernels.descriptors(cache, 512, 64) == (kv, pe)
    # another cache (address or shape) gets its own
    other = torch.zeros(16, 64, 576, dtype=torch.bfloat16)
    kv2, _ = gluon_kernels.descriptors(other, 512, 64)
    assert kv2.base.data_ptr() == other.data_ptr() and list(kv2.shape) == [16 * 64, 576]


def _metadata(**options):
    scenario = Scenario("x", (300, 40), (1, 1), kv_lora_rank=512, qk_rope_head_dim=64,
                        num_heads=128, block_size=64, dtype=torch.bfloat16)  # fmt: skip
    spec = scenario.spec()
    backend = MLABackend(**options)
    builder = MLAMetadataBuilder(spec, "cpu", **backend.options)  # planning only
    # plan as on an H200, keeping what the config string asked for
    builder.config = dataclasses.replace(
        choose_config("sm90", 2, 512, 64), use_gluon=builder.config.use_gluon
    )
    from pagedkv.conformance.problem import build_problem

    problem = build_problem(scenario, "cpu")
    return builder.build(problem.common)


def test_the_builder_keeps_the_gluon_kernel_unless_a_triton_tile_is_named():
    q_nope, q_pe, cache = _tensors()
    md = _metadata()
    assert gluon_applies(q_nope, q_pe, cache, md.config, md.kv_per_split, allow_gluon=True)
    assert not gluon_applies(q_nope, q_pe, cache, md.config, md.kv_per_split, allow_gluon=False)
    # a CPU cache asks its device: no GPU here, so the Triton kernel
    assert not gluon_applies(q_nope, q_pe, cache, md.config, md.kv_per_split)
    for options in ({"use_gluon": False}, {"num_stages": 1}, {"block_n": 32}):
        md = _metadata(**options)
        assert not md.config.use_gluon, options
        assert not gluon_applies(q_nope, q_pe, cache, md.config, md.kv_per_split, True)
    md = _metadata(num_stages=1, use_gluon=True)
    assert md.config.use_gluon


def test_tiles_other_than_64_rows_stay_on_the_triton_kernel():
    q_nope, q_pe, cache = _tensors()
    config = dataclasses.replace(choose_config("sm90", 2, 512, 64), block_m=32)
    assert not gluon_applies(q_nope, q_pe, cache, config, 4096, allow_gluon=True)
    config = choose_config("sm90", 2, 512, 64)
    assert not gluon_applies(q_nope, q_pe, cache, config, 4096 + 32, allow_gluon=True)


def test_the_backend_declares_the_option():
    assert "use_gluon" in MLABackend.option_specs
