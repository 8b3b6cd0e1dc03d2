"""The Pallas ragged paged-attention kernel and its jitted wrapper.

One program attends one *query tile* (``block_q`` consecutive query rows of one
request, times the ``group`` query heads that share a KV head: GQA packed into the
tile's rows) against that request's keys, for one KV head and one KV split. Query
tiles of every request are listed by the metadata builder (``tile_req``/``tile_qstart``),
so prefill chunks and decode tokens of a mixed batch share one launch.

The cache is the whole ``[num_blocks, block_size, 2 * num_kv_heads, head_size]``
array in memory space ANY (K of KV head h at index 2h, V at 2h+1); keys are gathered
``block_n`` tokens at a time through the block table, so any block size works and
the kernel reads exactly the rows it needs. Scores are fp32; softmax is online
(running max and sum, base 2); a fully masked row or a masked-off key never
touches a value (loads are masked and replaced by zeros: the cache may hold NaN in
blocks a request does not own).

Targets: ``interpret`` (CPU, jax's HLO interpreter), ``triton`` (GPU, the Pallas
Triton lowering) and ``mosaic_gpu`` (only to report that this form does not lower
there: it uses masked gathers, which Mosaic GPU has no lowering for).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from pagedkv.backends.pallas import configs
from pagedkv.toolkit.numerics import LN2, LOG2E

TARGETS = ("interpret", "triton", "mosaic_gpu", "mosaic_tpu")


@dataclass(frozen=True)
class KernelConfig:
    """Everything static about one launch: the layer, the tiling and the target.

    Hashable: it is the jit cache key together with the array shapes.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int  # tokens per cache block
    scale: float
    causal: bool = True
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    use_alibi: bool = False
    use_sinks: bool = False
    k_scale: float = 1.0  # fp8 caches: stored = real / scale
    v_scale: float = 1.0
    block_q: int = 1  # query rows per tile (block_m = block_q * group_pad)
    block_n: int = 64  # keys per inner-loop step
    # programs per tile along the keys (flash-decoding); > 1 adds a combine pass. The
    # step's split count (<= split_slots) is an input: the programs past it attend an
    # empty key range, so one compiled variant serves every count up to it
    split_slots: int = 1
    target: str = "interpret"
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        for name in ("block_q", "block_n", "split_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two, got {self.block_n}")
        if self.block_m & (self.block_m - 1):
            raise ValueError(
                f"block_q * group_pad must be a power of two, got {self.block_q} * {self.group_pad}"
            )

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def group_pad(self) -> int:
        return configs.padded_group(self.group)

    @property
    def block_m(self) -> int:
        """Rows of one tile: block_q query tokens x group_pad heads."""
        return self.block_q * self.group_pad

    @property
    def head_pad(self) -> int:
        """head_size rounded up to a power of two, at least 16 (the dot's minimum)."""
        return configs.head_pad(self.head_size)

    @property
    def name(self) -> str:
        return (
            f"paged_attention_bm{self.block_m}_bn{self.block_n}_s{self.split_slots}"
            f"_d{self.head_size}_bs{self.block_size}"
        )


# -- kernel -----------------------------------------------------------------------------


def _paged_attention_kernel(
    # scalar-style inputs: whole arrays, read one element (or one gathered row) at a time
    tile_req_ref,  # [num_tiles] int32: request of each tile, -1 for an idle tile
    tile_qstart_ref,  # [num_tiles] int32: first query row of the tile within its request
    query_start_loc_ref,  # [num_reqs + 1] int32
    seq_lens_ref,  # [num_reqs] int32
    block_table_ref,  # [num_reqs, max_blocks] int32
    split_steps_ref,  # [1] int32: the most key steps (block_n keys) of a split's range
    slopes_ref,  # [num_heads] float32 (ALiBi; read only when cfg.use_alibi)
    sinks_ref,  # [num_heads] float32 (read only when cfg.use_sinks)
    q_ref,  # [T, num_heads, head_size]
    kv_ref,  # [num_blocks, block_size, 2 * num_kv_heads, head_size]
    # outputs
    o_ref,  # [T(+1), num_heads, head_size(_pad)], or [T(+1), splits, num_heads, head_pad] f32
    *lse_refs,  # [T(+1), splits, num_heads] f32 log-sum-exp (natural), only when splitting
    cfg: KernelConfig,
):
    tile, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    req = tile_req_ref[tile]

    @pl.when(req >= 0)
    def _():
        # the keys of the tile (computed once: the entry decides from them which slots
        # hold a range, and passes the program its own)
        step_lo, step_hi = _tile_steps(
            tile, req, tile_qstart_ref, query_start_loc_ref, seq_lens_ref, cfg
        )

        def attend(first, end):
            _attend_tile(
                tile,
                kv_head,
                split,
                req,
                first,
                end,
                tile_qstart_ref,
                query_start_loc_ref,
                seq_lens_ref,
                block_table_ref,
                slopes_ref,
                sinks_ref,
                q_ref,
                kv_ref,
                o_ref,
                lse_refs[0] if lse_refs else None,
                cfg,
            )

        if not lse_refs:
            attend(step_lo, step_hi)
            return
        # split s takes the s-th of the tile's ranges; a slot past them (a short request
        # beside a long one; a CUDA graph's launch keeps the slots of its capture) has no
        # keys: it only marks its rows empty, without loading the query tile
        ranges, per_split = _tile_ranges(step_hi - step_lo, split_steps_ref[0], cfg)
        busy = split < ranges
        first = jnp.minimum(step_lo + split * per_split, step_hi)
        pl.when(busy)(lambda: attend(first, jnp.minimum(first + per_split, step_hi)))

        @pl.when(jnp.logical_not(busy))
        def _():
            token, head, row_valid = _tile_rows(
                tile, kv_head, req, tile_qstart_ref, query_start_loc_ref, q_ref.shape[0], cfg
            )
            empty = jnp.full((cfg.block_m,), -jnp.inf, jnp.float32)
            pl_triton.store(lse_refs[0].at[token, split, head], empty, mask=row_valid)


def _tile_steps(tile, req, tile_qstart_ref, query_start_loc_ref, seq_lens_ref, cfg):
    """[first, end) key steps (``block_n`` keys each) a tile's rows can see: up to its
    last query row (causal), from its first one's window (sliding window)."""
    q_start = query_start_loc_ref[req]
    q_len = query_start_loc_ref[req + 1] - q_start
    seq_len = seq_lens_ref[req]
    context_len = seq_len - q_len
    tile_q0 = tile_qstart_ref[tile]
    first_q = context_len + tile_q0
    last_q = context_len + jnp.minimum(tile_q0 + cfg.block_q, q_len) - 1
    kv_hi = jnp.minimum(last_q + 1, seq_len) if cfg.causal else seq_len
    kv_lo = jnp.int32(0)
    if cfg.sliding_window is not None:
        kv_lo = jnp.maximum(first_q - (cfg.sliding_window - 1), 0)
        if not cfg.causal:
            kv_hi = jnp.minimum(last_q + cfg.sliding_window, seq_len)
    return kv_lo // cfg.block_n, (kv_hi + cfg.block_n - 1) // cfg.block_n


def _tile_ranges(steps, split_steps, cfg):
    """(ranges, key steps of each) of a tile of ``steps`` key steps: as many ranges as
    ranges of ``split_steps`` steps would take (a short tile beside a long one takes
    few programs and writes few partials), at most the launch's slots (the host's count
    of the longest tile's steps must not drop a key if short), the steps shared evenly
    among them (none longer than ``split_steps`` unless the slots cap the count)."""
    ranges = jnp.clip((steps + split_steps - 1) // split_steps, 1, cfg.split_slots)
    return ranges, (steps + ranges - 1) // ranges


def _tile_rows(tile, kv_head, req, tile_qstart_ref, query_start_loc_ref, num_tokens, cfg):
    """(token, query head, valid) of each row of a tile: query token x query head of
    this KV head; masked-off rows point at a row nobody else writes (interpret mode
    stores them)."""
    q_start = query_start_loc_ref[req]
    q_len = query_start_loc_ref[req + 1] - q_start
    tile_q0 = tile_qstart_ref[tile]
    rows = jnp.arange(cfg.block_m, dtype=jnp.int32)
    q_in_tile = rows // cfg.group_pad
    head_in_group = rows % cfg.group_pad
    row_valid = (tile_q0 + q_in_tile < q_len) & (head_in_group < cfg.group)
    trash_row = num_tokens if cfg.target == "interpret" else 0
    token = jnp.where(row_valid, q_start + tile_q0 + q_in_tile, trash_row)
    head = jnp.where(row_valid, kv_head * cfg.group + head_in_group, 0)
    return token, head, row_valid


def _attend_tile(
    tile,
    kv_head,
    split,
    req,
    step_lo,  # the program's key steps (``block_n`` keys each): [step_lo, step_hi)
    step_hi,
    tile_qstart_ref,
    query_start_loc_ref,
    seq_lens_ref,
    block_table_ref,
    slopes_ref,
    sinks_ref,
    q_ref,
    kv_ref,
    o_ref,
    lse_ref,
    cfg: KernelConfig,
):
    bm, bn, dp = cfg.block_m, cfg.block_n, cfg.head_pad
    num_tokens = q_ref.shape[0]
    num_blocks, max_blocks = kv_ref.shape[0], block_table_ref.shape[1]
    q_start = query_start_loc_ref[req]
    q_len = query_start_loc_ref[req + 1] - q_start
    seq_len = seq_lens_ref[req]
    context_len = seq_len - q_len
    tile_q0 = tile_qstart_ref[tile]

    # -- rows of the tile: query token x query head of this KV head ----------------
    token, head, row_valid = _tile_rows(
        tile, kv_head, req, tile_qstart_ref, query_start_loc_ref, num_tokens, cfg
    )
    q_in_tile = jnp.arange(bm, dtype=jnp.int32) // cfg.group_pad
    q_pos = context_len + tile_q0 + q_in_tile  # [bm] absolute position of each row

    dims = jnp.arange(dp, dtype=jnp.int32)
    if cfg.head_size == dp:
        # no padded columns: plain ranges keep the loads provably contiguous (vectorised)
        dim_valid, dim_idx = None, dims
    else:
        dim_valid = dims < cfg.head_size
        dim_idx = jnp.where(dim_valid, dims, 0)

    def tile_mask(valid: jax.Array) -> jax.Array:  # [n] -> [n, dp]
        mask = jnp.broadcast_to(valid[:, None], (valid.shape[0], dp))
        return mask if dim_valid is None else mask & dim_valid[None, :]

    row_mask = tile_mask(row_valid)
    q = pl_triton.load(
        q_ref.at[
            _bcast(jnp.minimum(token, num_tokens - 1)[:, None], (bm, dp)),
            _bcast(head[:, None], (bm, dp)),
            _bcast(dim_idx[None, :], (bm, dp)),
        ],
        mask=row_mask,
        other=0,
    )  # [bm, dp]

    # -- running softmax state (base 2); the sink joins split 0's denominator --------
    neg_inf = jnp.float32(-jnp.inf)
    m_i = jnp.full((bm,), neg_inf, jnp.float32)
    l_i = jnp.zeros((bm,), jnp.float32)
    if cfg.use_sinks:
        sink = pl_triton.load(sinks_ref.at[head]) * LOG2E
        m_i = jnp.where(split == 0, sink, m_i) if cfg.split_slots > 1 else sink
        l_i = jnp.where(split == 0, 1.0, l_i) if cfg.split_slots > 1 else jnp.ones_like(l_i)
    slope = pl_triton.load(slopes_ref.at[head]) if cfg.use_alibi else None
    acc = jnp.zeros((bm, dp), jnp.float32)

    def body(step, carry):
        acc, m_i, l_i = carry
        pos = step * bn + jnp.arange(bn, dtype=jnp.int32)  # [bn] key positions
        kv_valid = pos < seq_len
        # clamped so that metadata past its bounds cannot make the kernel read outside
        # the table or the pool (CommonAttentionMetadata.validate reports such input)
        logical = jnp.clip(jnp.where(kv_valid, pos // cfg.block_size, 0), 0, max_blocks - 1)
        page = pl_triton.load(block_table_ref.at[req, logical])
        page = jnp.where(kv_valid, jnp.clip(page, 0, num_blocks - 1), 0)
        slot = pos % cfg.block_size
        idx = (
            _bcast(page[:, None], (bn, dp)),
            _bcast(slot[:, None], (bn, dp)),
        )
        kv_mask = tile_mask(kv_valid)
        dim_b = _bcast(dim_idx[None, :], (bn, dp))
        k = _load_kv(kv_ref.at[(*idx, 2 * kv_head, dim_b)], kv_mask, q.dtype)
        v = _load_kv(kv_ref.at[(*idx, 2 * kv_head + 1, dim_b)], kv_mask, q.dtype)

        # -- scores: scale, softcap, mask, ALiBi (the contract's order) -------------
        s = _dot(q, k, trans_b=True) * (cfg.scale * cfg.k_scale)  # [bm, bn] f32
        if cfg.logits_soft_cap is not None:
            s = jnp.tanh(s / cfg.logits_soft_cap) * cfg.logits_soft_cap
        visible = kv_valid[None, :]
        if cfg.causal:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        if cfg.sliding_window is not None:
            visible = visible & (q_pos[:, None] - pos[None, :] < cfg.sliding_window)
            if not cfg.causal:
                visible = visible & (pos[None, :] - q_pos[:, None] < cfg.sliding_window)
        if slope is not None:
            s = s + slope[:, None] * (pos[None, :] - q_pos[:, None]).astype(jnp.float32)
        s = jnp.where(visible, s * LOG2E, neg_inf)

        # -- online softmax ---------------------------------------------------------
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == neg_inf, 0.0, m_new)  # a row with nothing seen yet
        alpha = jnp.exp2(m_i - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, l_i

    acc, m_i, l_i = lax.fori_loop(step_lo, step_hi, body, (acc, m_i, l_i))

    has_mass = l_i > 0
    out = acc / jnp.where(has_mass, l_i, 1.0)[:, None]
    # interpret mode stores masked lanes too, so there every lane gets its own column
    store_dims = dims if cfg.target == "interpret" else dim_idx
    idx = (
        _bcast(token[:, None], (bm, dp)),
        _bcast(head[:, None], (bm, dp)),
        _bcast(store_dims[None, :], (bm, dp)),
    )
    out = out * cfg.v_scale
    if lse_ref is None:
        pl_triton.store(o_ref.at[idx], out.astype(o_ref.dtype), mask=row_mask)
    else:
        # token-major partials, natural log: the layout and base of the toolkit's merge
        # (``merge_by_lse``: a row's partials are consecutive rows), which the direct
        # launch uses. A row without keys leaves its partial unwritten: the merges skip
        # a partial whose log-sum-exp is -inf
        kept = row_mask & has_mass[:, None]
        pl_triton.store(o_ref.at[(idx[0], split, *idx[1:])], out, mask=kept)
        lse2 = jnp.where(has_mass, m_i + jnp.log2(jnp.where(has_mass, l_i, 1.0)), neg_inf)
        pl_triton.store(lse_ref.at[token, split, head], lse2 * LN2, mask=row_valid)


def _load_kv(ref, mask: jax.Array, dtype) -> jax.Array:
    """Masked K or V tile in the model dtype; masked lanes are 0 (the cache may hold NaN
    there). fp8 caches widen after loading: the Triton lowering has no fp8 `other`."""
    if jnp.dtype(ref.dtype).itemsize == 1:
        return jnp.where(mask, pl_triton.load(ref, mask=mask).astype(dtype), 0)
    return pl_triton.load(ref, mask=mask, other=0).astype(dtype)


def _bcast(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jnp.broadcast_to(x, shape)


def _dot(a: jax.Array, b: jax.Array, trans_b: bool = False) -> jax.Array:
    """fp32-accumulating dot; fp32 inputs stay IEEE fp32 (no TF32 rounding)."""
    exact = a.dtype == jnp.float32 or b.dtype == jnp.float32
    return pl_triton.dot(a, b, trans_b=trans_b, allow_tf32=False if exact else None)


# -- wrapper ------------------------------------------------------------------------------


class StepArrays(NamedTuple):
    """One step's metadata as int32 device arrays, made once per step by the builder."""

    tile_req: jax.Array  # [num_tiles]: request of each query tile, -1 for an idle tile
    tile_qstart: jax.Array  # [num_tiles]: first query row of the tile within its request
    query_start_loc: jax.Array  # [num_reqs + 1]
    seq_lens: jax.Array  # [num_reqs]
    block_table: jax.Array  # [num_reqs, max_blocks]
    # [1]: the most key steps (block_n keys) of a split's range; a tile's ranges (at
    # most cfg.split_slots) cover its keys
    split_steps: jax.Array


def paged_attention(
    q: jax.Array,  # [T, num_heads, head_size]
    kv_cache: jax.Array,  # [num_blocks, block_size, 2 * num_kv_heads, head_size]
    step: StepArrays,
    slopes: jax.Array,  # [num_heads] float32
    sinks: jax.Array,  # [num_heads] float32
    *,
    cfg: KernelConfig,
) -> jax.Array:
    """Attention of every scheduled query row; returns [T, num_heads, head_size] in q's
    dtype. Rows no tile covers (padding) are unspecified. Checks the shapes, then calls
    ``jitted(cfg.target)`` (jitted per ``cfg`` and input shapes), which the backend's
    impl calls directly: the contract has checked its inputs.
    """
    _check_shapes(q, kv_cache, step, cfg)
    return jitted(cfg.target)(q, kv_cache, step, slopes, sinks, cfg=cfg)


# Interpret mode runs in milliseconds and compiles in seconds: compile it cheaply.
_COMPILER_OPTIONS = {
    "interpret": {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
}


@functools.cache
def jitted(target: str):
    """The jitted kernel call for ``target``: ``(q, kv_cache, step, slopes, sinks, *,
    cfg)``; its cache holds one entry per config and input shapes
    (``jitted(target)._cache_size()``)."""
    return jax.jit(
        _paged_attention_call,
        static_argnames=("cfg",),
        compiler_options=_COMPILER_OPTIONS.get(target),
    )


def _paged_attention_call(q, kv_cache, step: StepArrays, slopes, sinks, *, cfg: KernelConfig):
    num_tokens, _, head_size = q.shape
    outs = kernel_call(q, kv_cache, step, slopes, sinks, cfg=cfg)
    if cfg.split_slots == 1:
        return outs[0][:num_tokens, :, :head_size]
    return _combine_splits(outs[0][:num_tokens, :, :, :head_size], outs[1][:num_tokens]).astype(
        q.dtype
    )


def output_shapes(num_tokens: int, dtype, cfg: KernelConfig) -> list[jax.ShapeDtypeStruct]:
    """The kernel's outputs: the attention [T, num_heads, head_size] in ``dtype``, or
    with splits the fp32 partials [T, slots, num_heads, head_pad] and their log-sum-exps
    [T, slots, num_heads]. Interpret mode stores masked-off lanes too: they land in one
    extra row and in the padding columns, where no real lane writes."""
    interpret = cfg.target == "interpret"
    rows = num_tokens + (1 if interpret else 0)
    heads, slots = cfg.num_heads, cfg.split_slots
    if slots == 1:
        width = cfg.head_pad if interpret else cfg.head_size
        return [jax.ShapeDtypeStruct((rows, heads, width), dtype)]
    return [
        jax.ShapeDtypeStruct((rows, slots, heads, cfg.head_pad), jnp.float32),
        jax.ShapeDtypeStruct((rows, slots, heads), jnp.float32),
    ]


def kernel_call(q, kv_cache, step: StepArrays, slopes, sinks, *, cfg: KernelConfig) -> list:
    """The kernel's launch alone (``output_shapes``); its parameters, in order: the
    step's arrays, slopes, sinks, q, kv_cache, then the outputs (``pallas_direct``
    launches the same kernel from torch in that order)."""
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out_shape = output_shapes(q.shape[0], q.dtype, cfg)
    inputs = (*step, slopes, sinks, q, kv_cache)
    return pl.pallas_call(
        functools.partial(_paged_attention_kernel, cfg=cfg),
        grid=(step.tile_req.shape[0], cfg.num_kv_heads, cfg.split_slots),
        in_specs=[any_spec] * len(inputs),
        out_specs=[any_spec] * len(out_shape),
        out_shape=out_shape,
        interpret=cfg.target == "interpret",
        compiler_params=_compiler_params(cfg),
        name=cfg.name,
    )(*inputs)


def _combine_splits(partial: jax.Array, lse: jax.Array) -> jax.Array:
    """Merge per-split normalised outputs [T, S, H, D] by their log-sum-exp [T, S, H]
    (as the toolkit's ``merge_by_lse``; the kernel has applied the value scale)."""
    lse_max = jnp.max(lse, axis=1)
    lse_max = jnp.where(jnp.isneginf(lse_max), 0.0, lse_max)
    weight = jnp.exp(lse - lse_max[:, None])  # [T, S, H]; 0 for an empty split
    # an empty split's partial is never read: its weight is 0 and where() drops it
    weighted = jnp.where(weight[..., None] > 0, partial * weight[..., None], 0.0)
    total = jnp.sum(weight, axis=1)
    return jnp.sum(weighted, axis=1) / jnp.where(total > 0, total, 1.0)[..., None]


def _compiler_params(cfg: KernelConfig):
    if cfg.target == "triton":
        return pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.target == "mosaic_gpu":
        from jax.experimental.pallas import mosaic_gpu as pl_mgpu

        return pl_mgpu.CompilerParams()
    if cfg.target == "mosaic_tpu":
        from jax.experimental.pallas import tpu as pl_tpu

        return pl_tpu.CompilerParams()
    return None


def _check_shapes(q, kv_cache, step: StepArrays, cfg: KernelConfig) -> None:
    num_reqs = step.seq_lens.shape[0]
    want = {
        "q": (q.shape, (q.shape[0], cfg.num_heads, cfg.head_size)),
        "kv_cache": (
            kv_cache.shape,
            (kv_cache.shape[0], cfg.block_size, 2 * cfg.num_kv_heads, cfg.head_size),
        ),
        "tile_qstart": (step.tile_qstart.shape, step.tile_req.shape),
        "query_start_loc": (step.query_start_loc.shape, (num_reqs + 1,)),
        "block_table": (step.block_table.shape[:1], (num_reqs,)),
        "split_steps": (step.split_steps.shape, (1,)),
    }
    for name, (got, expected) in want.items():
        if tuple(got) != tuple(expected):
            raise ValueError(f"{name}: expected shape {list(expected)}, got {list(got)}")
    for name, arr in step._asdict().items():
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name}: expected int32, got {arr.dtype}")
