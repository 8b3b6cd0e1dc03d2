"""KVLayout: every standard layout's shape, block axis and logical views, derived from
its axes, equal the hand-written views each backend used before (bit for bit,
writable), and the cache check names what is wrong."""

from __future__ import annotations

import pytest
import torch
from pagedkv import AttentionSpec, UnsupportedError
from pagedkv.layout import (
    BLOCK_HND,
    BLOCK_NHD,
    BLOCKS,
    DIM,
    HEADS,
    INTERLEAVED_HEADS,
    KV,
    KV_FIRST,
    LATENT,
    TOKENS,
    KVLayout,
)

SPEC = AttentionSpec(num_heads=6, num_kv_heads=3, head_size=8, dtype=torch.float32, block_size=4)
MLA = AttentionSpec(
    num_heads=4, num_kv_heads=1, head_size=24, dtype=torch.float32, block_size=4, scale=0.1,
    kv_lora_rank=16, qk_rope_head_dim=8,
)  # fmt: skip

# layout -> (physical shape of 5 blocks, the views as the backends wrote them by hand)
HAND_WRITTEN = {
    KV_FIRST: ((2, 5, 4, 3, 8), lambda c: (c[0], c[1])),
    BLOCK_NHD: ((5, 2, 4, 3, 8), lambda c: (c[:, 0], c[:, 1])),
    BLOCK_HND: ((5, 2, 3, 4, 8), lambda c: (c[:, 0].transpose(1, 2), c[:, 1].transpose(1, 2))),
    INTERLEAVED_HEADS: ((5, 4, 6, 8), lambda c: (c[:, :, 0::2], c[:, :, 1::2])),
}


@pytest.mark.parametrize("layout", list(HAND_WRITTEN), ids=lambda x: x.name)
def test_views_equal_the_hand_written_ones(layout):
    shape, hand = HAND_WRITTEN[layout]
    assert layout.shape(5, SPEC) == shape
    cache = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    k, v = layout.logical(cache, SPEC)
    hk, hv = hand(cache)
    assert k.shape == v.shape == (5, 4, 3, 8)
    assert torch.equal(k, hk) and torch.equal(v, hv)
    assert k.stride() == hk.stride() and v.stride() == hv.stride()
    # views, not copies: a write lands in the cache
    k[2, 1, 0, 3] = -1.0
    assert hk[2, 1, 0, 3] == -1.0 and (cache == -1.0).sum() == 1


def test_block_axis_and_symbols_follow_the_axes():
    assert [x.block_axis for x in (KV_FIRST, BLOCK_NHD, BLOCK_HND, INTERLEAVED_HEADS, LATENT)] == [
        1, 0, 0, 0, 0,
    ]  # fmt: skip
    assert KV_FIRST.describe() == "(2, num_blocks, block_size, num_kv_heads, head_size)"
    assert INTERLEAVED_HEADS.describe() == "(num_blocks, block_size, num_kv_heads * 2, head_size)"
    assert LATENT.describe() == "(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)"


def test_latent_layout_v_is_the_prefix_of_k():
    cache = torch.randn(LATENT.shape(3, MLA))
    assert cache.shape == (3, 4, 24)
    k, v = LATENT.logical(cache, MLA)
    assert k.shape == (3, 4, 1, 24) and v.shape == (3, 4, 1, 16)
    assert torch.equal(k[:, :, 0], cache) and torch.equal(v[:, :, 0], cache[..., :16])
    assert v.data_ptr() == cache.data_ptr()


def test_a_plugin_layout_with_kv_inside_each_head():
    layout = KVLayout("mine", (BLOCKS, TOKENS, HEADS, KV, DIM))
    cache = torch.randn(layout.shape(5, SPEC))
    assert cache.shape == (5, 4, 3, 2, 8) and layout.block_axis == 0
    k, v = layout.logical(cache, SPEC)
    assert torch.equal(k, cache[:, :, :, 0]) and torch.equal(v, cache[:, :, :, 1])


def test_same_bytes():
    assert KV_FIRST.same_bytes(KVLayout("other_name", KV_FIRST.axes))
    assert not KV_FIRST.same_bytes(BLOCK_NHD)


@pytest.mark.parametrize(
    "axes, message",
    [
        ((KV, TOKENS, HEADS, DIM), "BLOCKS must be an axis"),
        ((KV, BLOCKS, TOKENS, HEADS, HEADS, DIM), "appears twice"),
        ((BLOCKS, TOKENS, HEADS, DIM), "latent layout"),
        (((BLOCKS, TOKENS), KV, HEADS, DIM), "BLOCKS must be an axis of its own"),
    ],
)
def test_malformed_layouts_are_refused(axes, message):
    with pytest.raises(ValueError, match=message):
        KVLayout("bad", axes)


@pytest.mark.parametrize(
    "cache, message",
    [
        ("not a tensor", "expected a tensor in the kv_first layout \\[2, num_blocks, 4, 3, 8\\]"),
        (
            torch.zeros(2, 5, 4, 3, 16),
            "expected the kv_first layout \\[2, num_blocks, 4, 3, 8\\] = \\(2, ",
        ),
        (torch.zeros(5, 2, 4, 3, 8), "got shape \\[5, 2, 4, 3, 8\\]"),
        (torch.zeros(2, 5, 4, 3, 8, dtype=torch.float16), "expected dtype torch.float32"),
        (torch.zeros(2, 5, 4, 8, 3).transpose(-1, -2), "expected a contiguous tensor"),
    ],
)
def test_the_cache_check_names_what_is_wrong(cache, message):
    with pytest.raises(UnsupportedError, match=message):
        KV_FIRST.check(cache, SPEC)


def test_fp8_cache_dtype_is_checked():
    fp8 = SPEC.replace(kv_cache_dtype="fp8_e4m3")
    KV_FIRST.check(torch.zeros(KV_FIRST.shape(2, fp8), dtype=torch.float8_e4m3fn), fp8)
    with pytest.raises(UnsupportedError, match="float8_e4m3fn.*'fp8_e4m3'"):
        KV_FIRST.check(torch.zeros(KV_FIRST.shape(2, fp8)), fp8)
