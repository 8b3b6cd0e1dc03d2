"""Live KV-cache conversion between any two backends' layouts.

Every backend shows its cache as logical K/V views, so a cache written by one backend
can be handed to another without recomputing the prefix: block b's K and V move
from the source layout's views to the destination's, bit for bit (fp8 caches move
their raw bytes: the stored values and the spec's scales stay valid).

- Same bytes (e.g. the ``(2, N, B, H, D)`` caches of torch, triton and flash_attn):
  no copy, the source tensor is returned.
- Otherwise blocks move in chunks of ``chunk_blocks``. The whole cache moves as ranges
  of blocks copied from the source views straight into the destination's (no buffer).
  ``blocks=`` converts only the blocks in use (the rest of the destination stays
  zero): each chunk of ids is gathered into a temporary of ``chunk_blocks`` blocks (K
  and V: ``chunk_blocks * block_bytes`` bytes, ``spec.kv_bytes_per_token() *
  block_size`` per block) and scattered, so the extra memory is bounded by the chunk,
  never a second full logical copy. The destination cache itself is new (or ``out=``).

MLA latent caches convert only to latent caches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.errors import UnsupportedError
from pagedkv.layout import KVLayout
from pagedkv.spec import AttentionSpec

# Default chunk: 64 MiB of K+V per gather (whole blocks, at least one).
DEFAULT_CHUNK_BYTES = 64 << 20


def convert_kv_cache(
    src_backend: AttentionBackend,
    src_cache: torch.Tensor,
    dst_backend: AttentionBackend,
    spec: AttentionSpec,
    *,
    blocks: Sequence[int] | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    chunk_blocks: int | None = None,
) -> torch.Tensor:
    """``src_cache`` (``src_backend``'s layout) as a cache in ``dst_backend``'s layout.

    blocks: the block ids to convert (default: all); out: the destination cache
    (default: a new zero-filled one, unless the layouts share their bytes, in which
    case ``src_cache`` itself is returned and nothing is copied); chunk_blocks: blocks
    per gather (default: ~64 MiB). Raises UnsupportedError when the caches cannot
    hold the same data (MLA vs standard layers, shapes, dtypes).
    """
    src_layout, dst_layout = src_backend.get_kv_layout(), dst_backend.get_kv_layout()
    src_layout.check(src_cache, spec)
    latent = [isinstance(x, KVLayout) and x.is_latent for x in (src_layout, dst_layout)]
    if spec.is_mla != latent[0] or spec.is_mla != latent[1]:
        raise UnsupportedError(
            f"convert_kv_cache: {src_backend.name} ({src_layout.describe()}) -> "
            f"{dst_backend.name} ({dst_layout.describe()}): MLA latent caches convert only to "
            "latent caches, standard caches only to standard ones"
        )
    num_blocks = src_cache.shape[src_layout.block_axis]
    if out is None and isinstance(src_layout, KVLayout) and src_layout.same_bytes(dst_layout):
        return src_cache
    if out is None:
        out = dst_backend.allocate_kv_cache(num_blocks, spec, src_cache.device)
    else:
        dst_layout.check(out, spec, src_cache.device)
        if out.shape[dst_layout.block_axis] != num_blocks:
            raise UnsupportedError(
                f"convert_kv_cache: out holds {out.shape[dst_layout.block_axis]} blocks, the "
                f"source {num_blocks}"
            )
    src_k, src_v = src_layout.logical(src_cache, spec)
    dst_k, dst_v = dst_layout.logical(out, spec)
    views = [(src_k, dst_k)] if spec.is_mla else [(src_k, dst_k), (src_v, dst_v)]
    if src_cache.element_size() == 1:  # fp8: move the bytes (index ops need no fp8 kernels)
        views = [(s.view(torch.uint8), d.view(torch.uint8)) for s, d in views]
    step = chunk_blocks or max(1, DEFAULT_CHUNK_BYTES // _block_bytes(spec))
    if blocks is None:
        # every block: ranges of blocks copied view to view, one strided copy each,
        # through no buffer (each byte read and written once)
        for start in range(0, num_blocks, step):
            for src, dst in views:
                dst[start : start + step].copy_(src[start : start + step])
        return out
    ids = _block_ids(blocks, num_blocks, src_cache.device)
    for start in range(0, ids.numel(), step):
        chunk = ids[start : start + step]
        for src, dst in views:
            dst.index_copy_(0, chunk, src.index_select(0, chunk))
    return out


def _block_bytes(spec: AttentionSpec) -> int:
    return spec.kv_bytes_per_token() * spec.block_size


def _block_ids(
    blocks: Sequence[int] | torch.Tensor | None, num_blocks: int, device: torch.device
) -> torch.Tensor:
    if blocks is None:
        return torch.arange(num_blocks, device=device)
    ids = torch.as_tensor(blocks, dtype=torch.int64).to(device)
    if ids.dim() != 1:
        raise UnsupportedError(f"convert_kv_cache: blocks must be 1-D, got shape {list(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise UnsupportedError(
            f"convert_kv_cache: block ids must be in [0, {num_blocks}), got "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )
    return ids
