"""Triton kernels of the MLA backend and their launchers.

Three kernels over the latent cache ``[num_blocks, block_size, L + R]``:

- ``_write_latent``: one program per token, ``cache[slot] = concat(kv_c, k_pe)``
  (quantised for fp8 caches); negative slots are skipped.
- ``_mla_attention``: the absorbed attention. One program takes ``BLOCK_M`` query
  rows of one request, a row being a (query token, head) pair laid out token-major,
  so a decode tile is ``BLOCK_M`` heads of one token and a prefill tile holds a few
  tokens times all heads. Every row shares one latent stream, which is why the heads
  sit in the M dimension of ``tl.dot``: K = the whole latent row, V = its first L
  values, read once per tile for all its rows. Axis 1 of the grid splits the KV range
  (split-KV); with one split the program writes the final output directly.
- ``_mla_reduce``: combines the splits of each row by their log-sum-exp.

All scores live in the log2 domain (``exp2``), the scale folded into one multiply.
Offsets that can pass 2**31 (cache rows, token rows, partial rows) are int64.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from pagedkv.backends.mla.configs import KernelConfig
from pagedkv.intmath import cdiv, next_power_of_2
from pagedkv.toolkit.triton_helpers import fix_interpreter_loop_bounds, fp32_to_fp8_bits
from triton.tools.tensor_descriptor import TensorDescriptor

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
LOG2E = 1.4426950408889634


if INTERPRETED:
    fix_interpreter_loop_bounds()  # runtime loop bounds under numpy >= 2.4

_FP8_TYPES = {torch.float8_e4m3fn, torch.float8_e5m2}

# (kernel, grid, positional args, keyword args): what ``kernel[grid](*args, **kwargs)``
# runs; planned separately so that CI can compile exactly these launches for sm_90.
Launch = tuple[Any, tuple[int, ...], tuple[Any, ...], dict[str, Any]]


def pad_dim(n: int) -> int:
    """Power of two >= n and >= 16 (tl.arange needs powers of two, tl.dot K >= 16)."""
    return max(16, next_power_of_2(n))


# -- latent write ------------------------------------------------------------------------


@triton.jit
def _stored(x, inv_k_scale, FP8_MAX: tl.constexpr, FP8_MANTISSA: tl.constexpr):
    """What the cache holds for x: itself, or (FP8_MANTISSA > 0) the fp8 bits of
    x * (1 / k_scale) saturated, exactly like pagedkv.toolkit.kv_write.quantize_for_cache."""
    if FP8_MANTISSA > 0:
        y = x.to(tl.float32) * inv_k_scale
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        out = fp32_to_fp8_bits(y, 7 - FP8_MANTISSA, FP8_MANTISSA).to(tl.uint8)
    else:
        out = x
    return out


@triton.jit
def _write_latent(
    KVC,  # [T, L] new compressed KV rows
    KPE,  # [T, R] new rope key rows
    Cache,  # [num_blocks, BLOCK_SIZE, L + R]; fp8 caches as uint8 (their bits)
    SlotMapping,  # [T] int64, < 0 = skip
    stride_kvc_t,
    stride_kpe_t,
    stride_cache_block,
    stride_cache_slot,
    inv_k_scale,  # fp8 caches store x * (1 / k_scale)
    L: tl.constexpr,
    R: tl.constexpr,
    L_PAD: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,  # the fp8 format's largest finite value (fp8 caches)
    FP8_MANTISSA: tl.constexpr,  # its mantissa bits; 0: not an fp8 cache
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(SlotMapping + token)
    if slot >= 0:
        row = (
            Cache
            + (slot // BLOCK_SIZE) * stride_cache_block
            + (slot % BLOCK_SIZE) * stride_cache_slot
        )
        offs_l = tl.arange(0, L_PAD)
        x = tl.load(KVC + token * stride_kvc_t + offs_l, mask=offs_l < L)
        x = _stored(x, inv_k_scale, FP8_MAX, FP8_MANTISSA)
        tl.store(row + offs_l, x.to(Cache.dtype.element_ty), mask=offs_l < L)
        if R > 0:
            offs_r = tl.arange(0, R_PAD)
            y = tl.load(KPE + token * stride_kpe_t + offs_r, mask=offs_r < R)
            y = _stored(y, inv_k_scale, FP8_MAX, FP8_MANTISSA)
            tl.store(row + L + offs_r, y.to(Cache.dtype.element_ty), mask=offs_r < R)


def plan_write_latent(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
) -> list[Launch]:
    """The launch writing ``cache[slot // B, slot % B] = concat(kv_c[t], k_pe[t])`` for
    every t with slot >= 0 (none for an empty step).

    kv_c: [T', L], k_pe: [T', R] (last dims contiguous, T' >= len(slot_mapping));
    cache: [num_blocks, B, L + R]; slot_mapping: [T] int64.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return []
    lora, rope = kv_c.shape[1], k_pe.shape[1]
    fp8 = cache.dtype in _FP8_TYPES
    args = (
        kv_c,
        k_pe,
        cache.view(torch.uint8) if fp8 else cache,
        slot_mapping,
        kv_c.stride(0),
        k_pe.stride(0),
        cache.stride(0),
        cache.stride(1),
        1.0 / float(k_scale),
    )
    kwargs = dict(
        L=lora,
        R=rope,
        L_PAD=pad_dim(lora),
        R_PAD=pad_dim(rope),
        BLOCK_SIZE=cache.shape[1],
        FP8_MAX=float(torch.finfo(cache.dtype).max) if fp8 else 0.0,
        FP8_MANTISSA=(2 if cache.dtype == torch.float8_e5m2 else 3) if fp8 else 0,
        num_warps=4,
    )
    return [(_write_latent, (num_tokens,), args, kwargs)]


def launch(launches: list[Launch]) -> object:
    """Run planned launches in order; returns the first one's compiled handle (or None)."""
    first = None
    for i, (kernel, grid, args, kwargs) in enumerate(launches):
        handle = kernel[grid](*args, **kwargs)
        if i == 0:
            first = handle
    return first


# -- attention ---------------------------------------------------------------------------


@triton.jit
def _mla_attention(
    QN,  # [T, H, L] absorbed q_nope
    QP,  # [T, H, R] q_pe
    Cache,  # [num_blocks, BLOCK_SIZE, L + R]
    KVDesc,  # USE_TMA: descriptor of Cache as [num_blocks * BLOCK_SIZE, L + R], box [BLOCK_N, L]
    PEDesc,  # USE_TMA: the same view, box [BLOCK_N, R]
    BlockTable,  # [num_reqs, max_blocks] int32
    SeqLens,  # [num_reqs] int32
    QueryStartLoc,  # [num_reqs + 1] int32
    TileReq,  # [num_tiles] int32: the request of each tile
    TileRow0,  # [num_tiles] int32: its first row (token-in-request * H + head)
    Out,  # [T, H, L] (ONE_SPLIT)
    MidO,  # [T, H, num_splits, L] float32 (not ONE_SPLIT)
    MidLse,  # [T, H, num_splits] float32, log2 domain (not ONE_SPLIT)
    stride_qn_t,
    stride_qn_h,
    stride_qp_t,
    stride_qp_h,
    stride_cache_block,
    stride_cache_slot,
    stride_bt,
    stride_o_t,
    stride_o_h,
    qk_scale,  # softmax scale * log2(e) (* k_scale for fp8)
    out_scale,  # k_scale for fp8 (V is the stored latent), else 1
    kv_per_split,  # KV positions per split, a multiple of BLOCK_N
    num_splits,  # programs along grid axis 1
    NUM_HEADS: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    L_PAD: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_SPLIT: tl.constexpr,  # num_splits == 1: write the final output directly
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    req = tl.load(TileReq + tile)
    row0 = tl.load(TileRow0 + tile)
    q_start = tl.load(QueryStartLoc + req)
    q_len = tl.load(QueryStartLoc + req + 1) - q_start
    seq_len = tl.load(SeqLens + req)
    context_len = seq_len - q_len

    # -- rows of this tile: (query token, head) ------------------------------------------
    rows = row0 + tl.arange(0, BLOCK_M)
    tok = rows // NUM_HEADS
    head = rows % NUM_HEADS
    row_valid = tok < q_len
    q_pos = context_len + tok  # absolute position of each row's token
    tok_global = (q_start + tok).to(tl.int64)
    last_tok = tl.minimum(row0 + BLOCK_M - 1, q_len * NUM_HEADS - 1) // NUM_HEADS
    kv_len = context_len + last_tok + 1 if CAUSAL else seq_len
    kv_lo = split * kv_per_split
    kv_hi = tl.minimum(kv_len, kv_lo + kv_per_split)

    offs_l = tl.arange(0, L_PAD)
    offs_r = tl.arange(0, R_PAD)
    qn = tl.load(
        QN + tok_global[:, None] * stride_qn_t + head[:, None] * stride_qn_h + offs_l[None, :],
        mask=row_valid[:, None] & (offs_l[None, :] < L),
        other=0.0,
    )
    if R > 0:
        qp = tl.load(
            QP + tok_global[:, None] * stride_qp_t + head[:, None] * stride_qp_h + offs_r[None, :],
            mask=row_valid[:, None] & (offs_r[None, :] < R),
            other=0.0,
        )

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, L_PAD], dtype=tl.float32)
    table_row = BlockTable + req.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        # -- BLOCK_N latent rows through the block table ----------------------------------
        pos = start + tl.arange(0, BLOCK_N)
        pos_valid = pos < kv_hi
        if USE_TMA:
            # whole tile inside one block: two TMA boxes of the [num_blocks * B, L + R] view
            # (rows past kv_hi inside the block are finite by the cache contract, masked below)
            block = tl.load(table_row + start // BLOCK_SIZE)
            cache_row = block * BLOCK_SIZE + start % BLOCK_SIZE
            kv = KVDesc.load([cache_row, 0]).to(QN.dtype.element_ty)
            if R > 0:
                kpe = PEDesc.load([cache_row, L]).to(QN.dtype.element_ty)
        else:
            if BLOCK_SIZE % BLOCK_N == 0:
                # the tile lies inside one block (tiles and splits start at multiples of BLOCK_N)
                block = tl.load(table_row + start // BLOCK_SIZE).to(tl.int64)
            else:
                block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
            kv_row = Cache + block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot
            # fp8 caches: upcast here; k_scale is folded into qk_scale and out_scale
            kv = tl.load(
                kv_row[:, None] + offs_l[None, :],
                mask=pos_valid[:, None] & (offs_l[None, :] < L),
                other=0.0,
            ).to(QN.dtype.element_ty)
            if R > 0:
                kpe = tl.load(
                    kv_row[:, None] + L + offs_r[None, :],
                    mask=pos_valid[:, None] & (offs_r[None, :] < R),
                    other=0.0,
                ).to(QN.dtype.element_ty)
        # -- scores: q_nope . kv_c + q_pe . k_pe (log2 domain) ----------------------------
        s = tl.dot(qn, tl.trans(kv), input_precision=DOT_PRECISION)
        if R > 0:
            s = tl.dot(qp, tl.trans(kpe), s, input_precision=DOT_PRECISION)
        s = s * qk_scale
        visible = pos_valid[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        # -- online softmax ---------------------------------------------------------------
        m_tile = tl.max(s, 1)
        if LAZY_RESCALE:
            # Move the running max only when some row's max grew by more than 2**8; p
            # stays <= 256 meanwhile (harmless in fp32/bf16/fp16) and most iterations
            # skip the [BLOCK_M, L] accumulator rescale (FlashAttention-4's trick).
            grow = tl.max(m_tile - m_i, 0) > 8.0
            m_new = tl.where(grow, tl.maximum(m_i, m_tile), m_i)
        else:
            m_new = tl.maximum(m_i, m_tile)
        alpha = tl.exp2(m_i - m_new)  # 1 for rows whose max stays
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        p = p.to(kv.dtype)
        if LAZY_RESCALE:
            if grow:
                acc = acc * alpha[:, None]
        else:
            acc = acc * alpha[:, None]
        acc = tl.dot(p, kv, acc, input_precision=DOT_PRECISION)

    if ONE_SPLIT:
        out = acc * (out_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
        tl.store(
            Out + tok_global[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_l[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_valid[:, None] & (offs_l[None, :] < L),
        )
    else:
        # partial output normalised by its own denominator, plus its log2-sum-exp
        # (-inf for a split with no visible key: the reduction gives it weight 0)
        part = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.maximum(l_i, 1e-30)))
        mid_row = (tok_global * NUM_HEADS + head) * num_splits + split
        tl.store(
            MidO + mid_row[:, None] * L + offs_l[None, :],
            part,
            mask=row_valid[:, None] & (offs_l[None, :] < L),
        )
        tl.store(MidLse + mid_row, lse, mask=row_valid)


@triton.jit
def _mla_reduce(
    MidO,  # [T, H, num_splits, L] float32
    MidLse,  # [T, H, num_splits] float32, log2 domain
    Out,  # [T, H, L]
    stride_o_t,
    stride_o_h,
    out_scale,
    num_splits,
    NUM_HEADS: tl.constexpr,
    L: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # power of two >= num_splits
    BLOCK_L: tl.constexpr,  # latent columns per program
):
    # one program per (row, column chunk), every split at once: the loads of all the
    # splits' parts are independent, so a long split list costs bandwidth, not latency
    row = tl.program_id(0).to(tl.int64)  # token * NUM_HEADS + head
    token = row // NUM_HEADS
    head = row % NUM_HEADS
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    lse = tl.load(MidLse + row * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)  # 0 for padding and for splits that saw no key
    part = tl.load(
        MidO + (row * num_splits + offs_s)[:, None] * L + offs_l[None, :],
        mask=(offs_s[:, None] < num_splits) & (offs_l[None, :] < L),
        other=0.0,
    )
    denom = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) * (out_scale / tl.where(denom == 0.0, 1.0, denom))
    tl.store(
        Out + token * stride_o_t + head * stride_o_h + offs_l,
        out.to(Out.dtype.element_ty),
        mask=offs_l < L,
    )


def device_has_tma(device: torch.device) -> bool:
    """Hopper or newer (the interpreter runs descriptor loads too)."""
    if INTERPRETED:
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def tma_layout_ok(cache: torch.Tensor, lora: int, rope: int, block_n: int) -> bool:
    """Whether the latent tiles can come through TMA boxes: power-of-two L and R, whole
    tiles inside one block, and a cache viewable as 16-byte aligned rows of L + R."""
    width = lora + rope
    return (
        lora == pad_dim(lora)
        and (rope == 0 or rope == pad_dim(rope))
        and cache.shape[1] % block_n == 0
        and cache.stride(2) == 1
        and cache.stride(1) == width
        and cache.stride(0) == cache.shape[1] * width
        and (width * cache.element_size()) % 16 == 0
        and cache.data_ptr() % 16 == 0
    )


def plan_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tiles: torch.Tensor,
    out: torch.Tensor,
    *,
    num_tokens: int,
    scale: float,
    k_scale: float,
    causal: bool,
    config: KernelConfig,
    num_splits: int,
    kv_per_split: int,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    allow_tma: bool | None = None,
    allow_gluon: bool | None = None,
) -> list[Launch]:
    """The launches of absorbed MLA over the paged latent cache into ``out`` [T, H, L]:
    the attention kernel, then the split reduction when num_splits > 1.

    q_nope: [T, H, L]; q_pe: [T, H, R]; cache: [N, B, L + R] (last dims contiguous);
    tiles: [2, num_tiles] int32 (request, first row of each tile) from the builder;
    num_tokens: the scheduled rows. mid_o [T, H, S, L] and mid_lse [T, H, S] float32
    are required when num_splits > 1. allow_tma / allow_gluon: None asks the cache's
    device; the Gluon sm_90 kernel (gluon_kernels.py) runs where it applies.
    """
    num_tiles = tiles.shape[1]
    if num_tiles == 0:
        return []
    num_heads, lora = q_nope.shape[1], q_nope.shape[2]
    rope = q_pe.shape[2]
    fp8 = cache.dtype in _FP8_TYPES
    if num_splits == 1:
        mid_o = mid_lse = out  # unused pointer arguments of the one-split variant
    if gluon_applies(q_nope, q_pe, cache, config, kv_per_split, allow_gluon):
        from pagedkv.backends.mla import gluon_kernels

        launches: list[Launch] = [
            gluon_kernels.plan(
                q_nope, q_pe, cache, block_table, seq_lens, query_start_loc, tiles, out,
                mid_o, mid_lse, scale=scale, causal=causal, num_splits=num_splits,
                kv_per_split=kv_per_split,
            )
        ]  # fmt: skip
        return launches + _plan_reduce(mid_o, mid_lse, out, num_splits, num_tokens, 1.0)
    if allow_tma is None:
        allow_tma = device_has_tma(cache.device)
    # fp8 latents through TMA gave NaN on the H200 (docs/mla.md): pointer loads there
    use_tma = (
        config.use_tma
        and allow_tma
        and not fp8
        and tma_layout_ok(cache, lora, rope, config.block_n)
    )
    kv_desc = pe_desc = None
    if use_tma:
        rows = cache.view(cache.shape[0] * cache.shape[1], lora + rope)
        kv_desc = TensorDescriptor.from_tensor(rows, [config.block_n, lora])
        if rope:
            pe_desc = TensorDescriptor.from_tensor(rows, [config.block_n, rope])
    out_scale = k_scale if fp8 else 1.0  # V is the stored latent: fp8 stores it / k_scale
    args = (
        q_nope,
        q_pe,
        cache,
        kv_desc,
        pe_desc,
        block_table,
        seq_lens,
        query_start_loc,
        tiles[0],
        tiles[1],
        out,
        mid_o,
        mid_lse,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        scale * LOG2E * out_scale,
        out_scale,
        kv_per_split,
        num_splits,
    )
    kwargs = dict(
        NUM_HEADS=num_heads,
        L=lora,
        R=rope,
        L_PAD=pad_dim(lora),
        R_PAD=pad_dim(rope),
        BLOCK_SIZE=cache.shape[1],
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        ONE_SPLIT=num_splits == 1,
        CAUSAL=causal,
        DOT_PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32",
        LAZY_RESCALE=config.lazy_rescale,
        USE_TMA=use_tma,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    launches = [(_mla_attention, (num_tiles, num_splits), args, kwargs)]
    return launches + _plan_reduce(mid_o, mid_lse, out, num_splits, num_tokens, out_scale)


def _plan_reduce(
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
    num_tokens: int,
    out_scale: float,
) -> list[Launch]:
    """The split reduction's launch (none for one split or no rows)."""
    if num_splits == 1 or not num_tokens:
        return []
    num_heads, lora = out.shape[1], out.shape[2]
    splits_pad = next_power_of_2(num_splits)
    # at most 4096 partial values per program (32 float32 registers a thread)
    block_l = max(16, min(pad_dim(lora), 4096 // splits_pad))
    args = (mid_o, mid_lse, out, out.stride(0), out.stride(1), out_scale, num_splits)
    kwargs = dict(NUM_HEADS=num_heads, L=lora, SPLITS_PAD=splits_pad, BLOCK_L=block_l, num_warps=4)
    grid = (num_tokens * num_heads, cdiv(lora, block_l))
    return [(_mla_reduce, grid, args, kwargs)]


def gluon_applies(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    config: KernelConfig,
    kv_per_split: int,
    allow_gluon: bool | None = None,
) -> bool:
    """Whether the Gluon sm_90 kernel runs this launch: enabled in the config, on an
    sm_90 device (or allow_gluon=True, for the compile check), and its shape rules
    (gluon_kernels.applies) hold for the data and for the builder's tiles."""
    if not config.use_gluon:
        return False
    if allow_gluon is None:
        allow_gluon = not INTERPRETED and cache.device.type == "cuda"
        capability = torch.cuda.get_device_capability(cache.device) if allow_gluon else None
    else:
        capability = (9, 0) if allow_gluon else None
    if capability is None:
        return False
    from pagedkv.backends.mla import gluon_kernels

    if config.block_m != gluon_kernels.BLOCK_M or kv_per_split % gluon_kernels.BLOCK_N:
        return False
    return gluon_kernels.applies(q_nope, q_pe, cache, capability) is None
