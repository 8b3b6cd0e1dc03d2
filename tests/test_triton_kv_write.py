"""The Triton KV write against the torch path: same bits in every layout and cache dtype.

On a CPU the kernel runs in Triton's interpreter (enabled below, before the kernel
module is first imported); on a GPU it runs compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from pagedkv.toolkit.kv_write import cache_writer, quantize_for_cache, write_kv_by_slot

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _both_paths(make_views, key, value, slots, k_scale=1.0, v_scale=1.0):
    """Run the kernel and the torch path on fresh caches; return both caches."""
    results = []
    for use_triton in (True, False):
        cache, k_view, v_view = make_views()
        write_kv_by_slot(key, value, k_view, v_view, slots, k_scale, v_scale, use_triton=use_triton)
        results.append(cache)
    return results


LAYOUTS = {
    # (2, N, B, H, D): the torch/triton/flash_attn layout
    "kv-first": lambda n, b, h, d, dt: (lambda c: (c, c[0], c[1]))(
        torch.full((2, n, b, h, d), 3.0, device=DEVICE).to(dt)
    ),
    # (N, 2, B, H, D): flashinfer's NHD layout
    "blocks-first": lambda n, b, h, d, dt: (lambda c: (c, c[:, 0], c[:, 1]))(
        torch.full((n, 2, b, h, d), 3.0, device=DEVICE).to(dt)
    ),
    # (N, 2, H, B, D) read as [N, B, H, D]: an HND layout, non-monotone strides
    "hnd": lambda n, b, h, d, dt: (lambda c: (c, c[:, 0].transpose(1, 2), c[:, 1].transpose(1, 2)))(
        torch.full((n, 2, h, b, d), 3.0, device=DEVICE).to(dt)
    ),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(
    "cache_dtype", [torch.float16, torch.float32, *FP8], ids=lambda d: str(d)[6:]
)
def test_writes_the_same_bits_as_the_torch_path(layout, cache_dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block, heads, dim = 7, 16, 3, 80
    rows = 29
    key = (torch.randn(rows, heads, dim, generator=gen) * 4).half().to(DEVICE)
    value = (torch.randn(rows, heads, dim, generator=gen) * 0.01).half().to(DEVICE)
    slots = torch.randperm(num_blocks * block, generator=gen)[: rows - 4]
    slots[[2, 9]] = -1  # padding inside the batch
    slots = slots.to(DEVICE)
    scales = (0.37, 0.011) if cache_dtype in FP8 else (1.0, 1.0)
    triton_cache, torch_cache = _both_paths(
        lambda: LAYOUTS[layout](num_blocks, block, heads, dim, cache_dtype),
        key,
        value,
        slots,
        *scales,
    )
    assert torch.equal(_bits(triton_cache), _bits(torch_cache))


@pytest.mark.parametrize("cache_dtype", FP8, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_fp8_rounding_matches_quantize_for_cache(cache_dtype, scale):
    """Every fp8 value, the midpoints between neighbours (ties go to even), one fp32
    ulp either side of them, subnormals, zeros and values past the range."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(cache_dtype).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    nudged = torch.cat([torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    limit = torch.finfo(cache_dtype).max
    extra = torch.tensor([0.0, -0.0, limit * 1.01, -limit * 3, 1e-30, -1e-30, 1e30])
    values = torch.cat([finite, mids, nudged, extra]) * scale
    rows = values.numel() // 8 * 8
    key = values[:rows].reshape(-1, 1, 8).to(DEVICE)
    cache = torch.zeros(key.shape[0], 1, 1, 8, device=DEVICE).to(cache_dtype)
    slots = torch.arange(key.shape[0], device=DEVICE)
    write_kv_by_slot(key, None, cache, None, slots, scale, use_triton=True)
    want = quantize_for_cache(key, cache_dtype, scale)
    mismatch = (_bits(cache[:, 0]) != _bits(want)).any(-1).any(-1)
    assert not mismatch.any(), (
        f"{int(mismatch.sum())} values round differently, e.g. {key[mismatch][:4].flatten().tolist()}"
    )


def test_latent_cache_without_value():
    """MLA: value None writes K only (V is a view of K's storage)."""
    gen = torch.Generator().manual_seed(2)
    latent = torch.randn(9, 1, 576, generator=gen).half().to(DEVICE)
    slots = torch.tensor([5, 6, 7, 8, 40, 41, -1, 63, 0], device=DEVICE)
    caches = []
    for use_triton in (True, False):
        cache = torch.zeros(4, 16, 1, 576, device=DEVICE).half()
        write_kv_by_slot(latent, None, cache, None, slots, use_triton=use_triton)
        caches.append(cache)
    assert torch.equal(*caches)


def test_skips_negative_and_out_of_range_slots_and_extra_rows():
    key = torch.ones(6, 2, 32, device=DEVICE).half()
    cache = torch.zeros(2, 3, 16, 2, 32, device=DEVICE).half()
    # 3 * 16 = 48 slots; 48 and 1000 are past the pool; rows 4-5 have no slot
    slots = torch.tensor([0, 48, -1, 1000], device=DEVICE)
    write_kv_by_slot(key, key, cache[0], cache[1], slots, use_triton=True)
    written = cache.flatten(1, 2).abs().sum(dim=(-1, -2)) > 0
    assert written[:, 0].all() and int(written.sum()) == 2


def test_argument_errors_name_the_field():
    key = torch.zeros(4, 2, 32, device=DEVICE).half()
    cache = torch.zeros(2, 3, 16, 2, 32, device=DEVICE).half()
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match=r"k_view: expected \[num_blocks, block_size, 2, 32\]"):
        write_kv_by_slot(key, key, cache[0, ..., :16], cache[1], slots, use_triton=True)
    with pytest.raises(ValueError, match="slot_mapping has 5 slots but key only 4 rows"):
        write_kv_by_slot(
            key, key, cache[0], cache[1], torch.arange(5, device=DEVICE), use_triton=True
        )
    with pytest.raises(ValueError, match="slot_mapping: expected a 1-D int64 tensor"):
        write_kv_by_slot(key, key, cache[0], cache[1], slots.float(), use_triton=True)
    for use_triton in (True, False):  # the torch path as the kernel's
        with pytest.raises(ValueError, match="value and v_view must be given together"):
            write_kv_by_slot(key, key, cache[0], None, slots, use_triton=use_triton)
        with pytest.raises(ValueError, match="value and v_view must be given together"):
            write_kv_by_slot(key, None, cache[0], cache[1], slots, use_triton=use_triton)
    with pytest.raises(ValueError, match=r"v_view: expected blocks and heads \(3, 16, 2\)"):
        write_kv_by_slot(key, key[:, :1], cache[0], cache[1, :, :, :1], slots, use_triton=True)


def test_a_kept_writer_checks_each_writes_rows_and_slots():
    """A writer kept for a cache's views (``cache_writer``) writes each call's rows as a
    one-call write does, and names the argument that does not fit its views."""
    cache = torch.zeros(2, 3, 16, 2, 32, device=DEVICE).half()
    want = cache.clone()
    writer = cache_writer(cache[0], cache[1], use_triton=True)
    for seed in range(2):
        key = torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(seed)).half()
        slots = torch.tensor([seed, 20 + seed, -1, 47], device=DEVICE)
        writer(key.to(DEVICE), key.to(DEVICE), slots)
        write_kv_by_slot(key.to(DEVICE), key.to(DEVICE), want[0], want[1], slots, use_triton=False)
    assert torch.equal(cache, want)
    key = torch.zeros(4, 2, 32, device=DEVICE).half()
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match=r"k_view: expected \[num_blocks, block_size, 2, 16\]"):
        writer(key[..., :16], key, slots)
    with pytest.raises(ValueError, match="key: expected \\[T, H, D\\]"):
        writer(key[0], key, slots)
    with pytest.raises(ValueError, match="value and v_view must be given together"):
        writer(key, None, slots)
    with pytest.raises(ValueError, match="slot_mapping: expected a 1-D int64 tensor"):
        writer(key, key, slots[None])


def test_importing_pagedkv_does_not_import_triton():
    code = (
        "import sys, pagedkv, pagedkv.toolkit.kv_write, pagedkv.backends.triton; "
        "pagedkv.get_backend('triton').validate(pagedkv.AttentionSpec("
        "num_heads=4, num_kv_heads=1, head_size=64, dtype=__import__('torch').float16, "
        "block_size=16)); "
        "assert 'triton' not in sys.modules, 'triton was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (4 GiB cache)")
def test_offsets_past_2_31_elements():
    """A cache view of more than 2**31 elements: the last block must be reachable."""
    block, heads, dim = 16, 8, 128
    num_blocks = (1 << 31) // (block * heads * dim) + 8
    cache = torch.zeros(2, num_blocks, block, heads, dim, dtype=torch.float8_e4m3fn, device="cuda")
    key = torch.randn(3, heads, dim, device="cuda").half()
    last = num_blocks * block - 1
    slots = torch.tensor([last, last - block, 5], device="cuda")
    write_kv_by_slot(key, key, cache[0], cache[1], slots, 0.5, 0.5, use_triton=True)
    want = quantize_for_cache(key, torch.float8_e4m3fn, 0.5)
    for view in (cache[0], cache[1]):
        flat = view.view(-1, heads, dim)
        assert torch.equal(_bits(flat[last]), _bits(want[0]))
        assert torch.equal(_bits(flat[last - block]), _bits(want[1]))
        assert torch.equal(_bits(flat[5]), _bits(want[2]))
