"""convert_kv_cache: zero-copy for identical bytes, chunked otherwise, only the blocks asked."""

from __future__ import annotations

import pytest
import torch
from pagedkv import AttentionSpec, UnsupportedError, convert_kv_cache
from pagedkv.backends.torch import TorchBackend
from pagedkv.layout import BLOCK_HND, INTERLEAVED_HEADS, KV_FIRST, LATENT

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, dtype=torch.float16, block_size=4)


def _backend(layout):
    return type(
        f"T_{layout.name}", (TorchBackend,), {"name": f"t_{layout.name}", "kv_layout": layout}
    )()


def _filled(backend, num_blocks=6, spec=SPEC):
    cache = backend.allocate_kv_cache(num_blocks, spec, "cpu")
    cache.copy_(torch.randn(cache.shape).to(cache.dtype))
    return cache


def test_identical_bytes_are_not_copied():
    src = _filled(_backend(KV_FIRST))
    assert convert_kv_cache(_backend(KV_FIRST), src, TorchBackend(), SPEC) is src


@pytest.mark.parametrize("chunk", [1, 4, None])
def test_chunked_conversion_equals_the_source_views(chunk):
    a, b = _backend(INTERLEAVED_HEADS), _backend(BLOCK_HND)
    src = _filled(a)
    out = convert_kv_cache(a, src, b, SPEC, chunk_blocks=chunk)
    for x, y in zip(
        a.kv_cache_to_logical(src, SPEC), b.kv_cache_to_logical(out, SPEC), strict=True
    ):
        assert torch.equal(x, y)


def test_only_the_blocks_asked_for_and_into_out():
    a, b = _backend(KV_FIRST), _backend(BLOCK_HND)
    src = _filled(a)
    out = b.allocate_kv_cache(6, SPEC, "cpu")
    assert convert_kv_cache(a, src, b, SPEC, blocks=[1, 4], out=out) is out
    (ka, _), (kb, _) = a.kv_cache_to_logical(src, SPEC), b.kv_cache_to_logical(out, SPEC)
    assert torch.equal(kb[[1, 4]], ka[[1, 4]]) and kb[[0, 2, 3, 5]].eq(0).all()


def test_refusals_name_the_problem():
    a, b = _backend(KV_FIRST), _backend(BLOCK_HND)
    src = _filled(a)
    with pytest.raises(UnsupportedError, match=r"block ids must be in \[0, 6\)"):
        convert_kv_cache(a, src, b, SPEC, blocks=[7])
    with pytest.raises(UnsupportedError, match="out holds 5 blocks, the source 6"):
        convert_kv_cache(a, src, b, SPEC, out=b.allocate_kv_cache(5, SPEC, "cpu"))
    mla = AttentionSpec(num_heads=4, num_kv_heads=1, head_size=24, dtype=torch.float16,
                        block_size=4, scale=0.1, kv_lora_rank=16, qk_rope_head_dim=8)  # fmt: skip
    latent = _backend(LATENT)
    with pytest.raises(UnsupportedError, match="MLA latent caches convert only to latent caches"):
        convert_kv_cache(latent, latent.allocate_kv_cache(2, mla, "cpu"), b, mla)
