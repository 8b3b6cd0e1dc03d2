"""Host planning of the MLA attention launches, in two stages.

- ``plan_step`` (the builder, once per step): which attention kernel runs (the Gluon
  sm_90 kernel, or the Triton kernel with TMA or pointer loads), its grid, and every
  launch argument that depends only on the step, the spec and the configuration; the
  split reduction's likewise.
- ``StepPlan.run`` (every layer's forward): completes each launch's step arguments with
  the layer's group (``layer_args``: the cache's arguments and the layer's scales,
  which a layer computes once per cache) and the forward's own (query parts, output),
  and launches it through ``pagedkv.toolkit.dispatch``; ``StepPlan.launches`` returns
  the same launches as ``KernelLaunch``es (the compile check, the graph tests).

The kernel choice assumes a cache as ``allocate_kv_cache`` makes it (contiguous, which
the cache check enforces, and 16-byte aligned); a cache that is not aligned, or too
large for 32-bit TMA coordinates, gets the Triton kernel with pointer loads, planned
on the spot (``StepPlan.fallback``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from pagedkv.backends.mla.configs import (
    GLUON_BLOCK_M,
    GLUON_BLOCK_N,
    GLUON_NUM_WARPS,
    GLUON_WORKER_REGS,
    REDUCE_PROGRAMS_PER_SM,
    REDUCE_UNITS_PER_SM,
    KernelConfig,
    gluon_piece_width,
    pad_dim,
)
from pagedkv.backends.mla.kernels import _mla_attention, _mla_reduce
from pagedkv.graph import GraphBounds
from pagedkv.intmath import cdiv, next_power_of_2
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.dispatch import CallArgs, LaunchArgs, layer_groups, shared_group
from pagedkv.toolkit.interpreter import interpreting
from pagedkv.toolkit.launch import KernelLaunch, programmatic_capability
from pagedkv.toolkit.triton_helpers import LOG2E

# how the attention kernel reads the latent cache
GLUON, TMA, POINTER = "gluon", "tma", "pointer"
# a forward's output arguments, the attention's and the merge's alike
OUTPUT = ("Out", "stride_o_t", "stride_o_h")
_FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# TMA coordinates are 32-bit: the Gluon kernel's out-of-range row must stay below 2**31
_MAX_TMA_ROWS = 2**31 - GLUON_BLOCK_N


# -- tiles -------------------------------------------------------------------------------


def tile_table(query_lens: np.ndarray, num_heads: int, block_m: int) -> np.ndarray:
    """[2, num_tiles] int32: the request and first row of each tile. A tile is ``block_m``
    consecutive rows of one request, row ``j * H + h`` being head ``h`` of the request's
    query token ``j``; tiles of one request are adjacent (the programs reading the same
    latent rows run together: L2 reuse)."""
    tiles_per_req = -(-(query_lens.astype(np.int64) * num_heads) // block_m)
    num_tiles = int(tiles_per_req.sum())
    first_tile = np.cumsum(tiles_per_req) - tiles_per_req
    tiles = np.empty((2, num_tiles), dtype=np.int32)
    tiles[0] = np.repeat(np.arange(len(query_lens)), tiles_per_req)
    tiles[1] = (np.arange(num_tiles) - np.repeat(first_tile, tiles_per_req)) * block_m
    return tiles


def max_tiles(bounds: GraphBounds, num_heads: int, block_m: int) -> int:
    """The most tiles any step within ``bounds`` has. ``cdiv(q * H, block_m)`` is
    subadditive, so a token costs at most ``cdiv(H, block_m)`` tiles, and a request's
    tiles waste at most ``block_m - 1`` rows."""
    tokens = min(bounds.max_num_tokens, bounds.max_num_reqs * bounds.max_query_len)
    requests = min(bounds.max_num_reqs, tokens)
    by_tokens = tokens * cdiv(num_heads, block_m)
    by_rows = (tokens * num_heads + requests * (block_m - 1)) // block_m
    return min(by_tokens, by_rows)


# -- kernel choice -------------------------------------------------------------------------


def gluon_problem(
    spec: AttentionSpec, config: KernelConfig, capability: tuple[int, int] | None
) -> str | None:
    """None when the Gluon sm_90 kernel can run this layer's steps, else why not (the
    Triton kernel does). The cache's own conditions are ``cache_problem``'s."""
    lora, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
    if not config.use_gluon:
        return "the configuration asks for the Triton kernel (use_gluon=false or a Triton tile)"
    if capability != (9, 0):
        where = "no GPU" if capability is None else f"sm_{capability[0]}{capability[1]}"
        return f"wgmma needs sm_90 ({where} here)"
    if spec.dtype not in (torch.bfloat16, torch.float16) or spec.cache_dtype != spec.dtype:
        return f"16-bit query and cache only (query {spec.dtype}, cache {spec.cache_dtype})"
    if lora not in (128, 256, 512) or rope != 64:
        return f"kv_lora_rank 128, 256 or 512 and rope 64 only (got {lora}, {rope})"
    if spec.block_size % GLUON_BLOCK_N:
        return f"block_size {spec.block_size} is not a multiple of {GLUON_BLOCK_N}"
    # (key ranges are whole config.block_n steps: work.choose_ranges' granule)
    if config.block_m != GLUON_BLOCK_M or config.block_n % GLUON_BLOCK_N:
        return f"tiles of {GLUON_BLOCK_M} rows and splits of whole {GLUON_BLOCK_N}-row tiles only"
    return query_problem(spec.num_heads)


def has_tma(capability: tuple[int, int] | None) -> bool:
    """Hopper or newer; the interpreter runs descriptor loads too."""
    return interpreting() if capability is None else capability[0] >= 9


def tma_problem(spec: AttentionSpec, config: KernelConfig) -> str | None:
    """None when the Triton kernel's latent tiles can come through TMA boxes: power-of-two
    L and R, whole tiles inside one block, 16-byte rows, a 16-bit cache (fp8 latents
    through TMA gave NaN on the H200, docs/mla.md)."""
    lora, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
    if lora != pad_dim(lora) or (rope and rope != pad_dim(rope)):
        return "L and R must be powers of two (>= 16)"
    if spec.block_size % config.block_n:
        return f"a {config.block_n}-row tile spans blocks of {spec.block_size}"
    if spec.cache_dtype in _FP8_TYPES:
        return "fp8 caches load through pointers"
    if (lora + rope) * spec.cache_dtype.itemsize % 16:
        return "latent rows are not a multiple of 16 bytes"
    return None


def cache_problem(cache: torch.Tensor, kind: str) -> str | None:
    """What keeps this cache tensor from the plan's ``kind`` (it is contiguous: checked)."""
    if kind == POINTER:
        return None
    if cache.data_ptr() % 16:
        return "the cache is not 16-byte aligned (TMA)"
    if kind == GLUON and cache.shape[0] * cache.shape[1] >= _MAX_TMA_ROWS:
        return "more than 2**31 latent rows (TMA coordinates are 32-bit)"
    return None


# -- the step's plan ---------------------------------------------------------------------


@dataclass(frozen=True)
class StepPlan:
    """A step's attention launches, but for the layer's tensors and scales: each launch's
    step arguments as a template, run with a layer's groups and a forward's own
    arguments (``pagedkv.toolkit.dispatch``: Triton's per-call dispatch only on a
    specialisation's first call)."""

    kind: str  # GLUON, TMA or POINTER
    attention: KernelLaunch  # the attention kernel, its grid and its step arguments
    reduce: KernelLaunch | None  # the reduction's (None: one split, or nothing to merge)
    multi_token: bool  # some request has several query tokens (causal limits per row)
    # the same step planned for the pointer-load Triton kernel (for an unusual cache)
    fallback: Callable[[], StepPlan] | None = None

    def run(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, out: torch.Tensor, layer: LayerArgs
    ) -> None:
        """The launches into ``out`` (``launches``' arguments), each template completed
        by the layer's group and the forward's own arguments."""
        for template, groups, call in self._parts(q_nope, q_pe, out, layer):
            template.run_with(*groups, call=call)

    def launches(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, out: torch.Tensor, layer: LayerArgs
    ) -> list[KernelLaunch]:
        """q_nope [T, H, L], q_pe [T, H, R], out [T, H, L], each with a unit last stride;
        layer: ``layer_args(self.kind, ...)`` of the layer. The launches ``run`` makes,
        each with all its arguments (the compile check, the CUDA-graph tests)."""
        launches = []
        for template, groups, call in self._parts(q_nope, q_pe, out, layer):
            kwargs = dict(template.kwargs)
            for group in groups:
                kwargs.update(group.values)
            launches.append(
                KernelLaunch(template.kernel, template.grid, {**kwargs, **call.mapping})
            )
        return launches

    def _parts(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, out: torch.Tensor, layer: LayerArgs
    ) -> list[tuple[KernelLaunch, tuple[LaunchArgs, ...], CallArgs]]:
        """Each launch: its step template, the layer's groups, the forward's arguments."""
        if self.attention.grid[0] == 0:
            return []
        o = out.stride()
        call: dict[str, Any] = dict(zip(OUTPUT, (out, o[0], o[1]), strict=True))
        if self.kind == GLUON:
            call.update(qn_desc=query_descriptor(q_nope), qp_desc=query_descriptor(q_pe))
        else:
            qn, qp = q_nope.stride(), q_pe.stride()
            call.update(QN=q_nope, QP=q_pe, stride_qn_t=qn[0], stride_qn_h=qn[1],
                        stride_qp_t=qp[0], stride_qp_h=qp[1])  # fmt: skip
        if self.reduce is None:
            # the one-split variant never touches its partial-output pointers
            call.update(MidO=out, MidLse=out)
        # one query token per request: its causal limit is the sequence's end
        causal = layer.causal and self.multi_token
        group, own = layer.attention_group(causal)
        attention_call = CallArgs(call)
        parts = [(self.attention, (group,), attention_call.extended(own))]
        if self.reduce is not None:
            # the merge's output arguments, found with the attention's
            parts.append((self.reduce, (layer.reduce_group(),), attention_call.subset(OUTPUT)))
        return parts


def plan_step(
    spec: AttentionSpec,
    config: KernelConfig,
    common: CommonAttentionMetadata,
    items: torch.Tensor,
    token_ranges: torch.Tensor,
    merges: torch.Tensor,
    num_splits: int,
    mid_o: torch.Tensor | None,
    mid_lse: torch.Tensor | None,
    *,
    merge_entries: int,
    num_sms: int,
    capability: tuple[int, int] | None,
    kind: str | None = None,
) -> StepPlan:
    """The step's plan. items: [4, n] int32 on the device (``work.work_list``: one
    program each); token_ranges: [2, T] int32 on the device (each token's ranges and
    first partial slot); merges: [1 + 3 * merge_entries] int32 on the device
    (``work.merge_list``: the tokens the reduction merges); num_splits: the most ranges
    of a request (1: the kernels write every output directly); mid_o [partials, H, L]
    and mid_lse [partials, H] float32 when num_splits > 1; num_sms: the device's;
    capability: the device's (None: no GPU); kind: None chooses. The layer's scales and
    causality come with each layer (``layer_args``)."""
    if kind is None:
        if gluon_problem(spec, config, capability) is None:
            kind = GLUON
        elif config.use_tma and has_tma(capability) and tma_problem(spec, config) is None:
            kind = TMA
        else:
            kind = POINTER
    lora, rope, heads = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.num_heads
    one_split = num_splits == 1
    reduces = not one_split and merge_entries > 0
    # the reduction launched as the attention's programmatic dependent (sm_90+): its
    # launch overlaps the attention's last wave, and its programs without a token (a
    # CUDA graph's grid holds every step's) end before the attention does
    programmatic = reduces and programmatic_capability(capability)
    args: dict[str, Any] = dict(
        BlockTable=common.block_table,
        SeqLens=common.seq_lens,
        QueryStartLoc=common.query_start_loc,
        TileReq=items[0],
        TileRow0=items[1],
        TileSplit=items[2],
        TileKeys=items[3],
        TokenRanges=token_ranges[0],
        TokenPartial=token_ranges[1],
        stride_bt=common.block_table.stride(0),
        NUM_HEADS=heads,
        L=lora,
        R=rope,
        BLOCK_SIZE=spec.block_size,
        ONE_SPLIT=one_split,
        LAUNCH_DEPENDENTS=programmatic,
    )
    if kind == GLUON:
        from pagedkv.backends.mla.gluon_kernels import _mla_attention_sm90 as kernel

        args.update(
            TILE_M=GLUON_BLOCK_M,
            TILE_N=GLUON_BLOCK_N,
            WORKER_REGS=GLUON_WORKER_REGS,
            num_warps=GLUON_NUM_WARPS,
        )
    else:
        kernel = _mla_attention
        args.update(
            L_PAD=pad_dim(lora),
            R_PAD=pad_dim(rope),
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            DOT_PRECISION="ieee" if spec.dtype == torch.float32 else "tf32",
            LAZY_RESCALE=config.lazy_rescale,
            USE_TMA=kind == TMA,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    reduce = None
    if reduces:
        # the partials: the reduction's, and the attention kernel's (a one-split kernel
        # never touches them: each forward passes its output there)
        args.update(MidO=mid_o, MidLse=mid_lse)
        reduce_grid, shape = reduce_shape(merge_entries, heads, lora, num_splits, num_sms)
        reduce_args = dict(
            MidO=mid_o, MidLse=mid_lse, Merges=merges, NUM_HEADS=heads, L=lora, **shape,
            WAIT_FOR_PRIMARY=programmatic, num_warps=4,
            # Triton's interpreter takes no launch_pdl
            **({"launch_pdl": True} if programmatic else {}),
        )  # fmt: skip
        reduce = KernelLaunch(_mla_reduce, reduce_grid, reduce_args)
    fallback = None
    if kind != POINTER:
        fallback = functools.partial(
            plan_step, spec, config, common, items, token_ranges, merges, num_splits, mid_o,
            mid_lse, merge_entries=merge_entries, num_sms=num_sms, capability=capability,
            kind=POINTER,
        )  # fmt: skip
    multi_token = common.max_query_len > 1
    attention = KernelLaunch(kernel, (items.shape[1],), args)
    return StepPlan(kind, attention, reduce, multi_token, fallback)


def reduce_shape(
    entries: int, heads: int, lora: int, num_splits: int, num_sms: int
) -> tuple[tuple[int], dict[str, int]]:
    """The reduction's grid and tile for ``entries`` merged tokens of up to ``num_splits``
    ranges: units of (token, head, column block), the columns cut while the units stay
    within ``REDUCE_UNITS_PER_SM`` an SM (a few tokens: every SM busy), down to 64
    columns; at most 4096 partial values a loop step (32 float32 registers a thread);
    at most ``REDUCE_PROGRAMS_PER_SM`` programs an SM."""
    most = REDUCE_PROGRAMS_PER_SM * num_sms
    l_pad, units, cols = pad_dim(lora), entries * heads, 1
    while cols * 2 <= l_pad // 64 and units * cols * 2 <= REDUCE_UNITS_PER_SM * num_sms:
        cols *= 2
    block_l = l_pad // cols
    col_blocks = cdiv(lora, block_l)
    chunk = max(1, min(next_power_of_2(num_splits), 4096 // block_l))
    grid = (max(1, min(units * col_blocks, most)),)
    return grid, dict(SPLITS_CHUNK=chunk, BLOCK_L=block_l, COL_BLOCKS=col_blocks)


# -- a layer's arguments ------------------------------------------------------------------


# a layer's own attention arguments (its cache, or descriptors of it): passed with each
# forward's, so that the rest is a group every layer of equal values shares
_LAYER_OWN = ("Cache", "KVDesc", "PEDesc", "half_desc", "rope_desc")


@dataclass(frozen=True)
class LayerArgs:
    """A layer's launch arguments: its cache (the tensor and its strides, or TMA
    descriptors of its latent rows) and its spec's scales and causality."""

    attention: dict[str, Any]
    out_scale: float  # k_scale for an fp8 cache (V is the stored latent), else 1
    causal: bool
    # the launch groups made of them (``attention_group``, ``reduce_group``)
    _groups: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def attention_group(self, causal: bool) -> tuple[LaunchArgs, CallArgs]:
        """The attention kernel's layer arguments, with ``CAUSAL`` (the layer's causality
        where the step has multi-token requests): the group shared by every layer of
        equal scalars and strides, and the layer's cache or descriptors as fixed call
        arguments (``dispatch.layer_groups``), found once."""
        found = self._groups.get(causal)
        if found is None:
            found = self._groups[causal] = layer_groups(
                {**self.attention, "CAUSAL": causal}, own=_LAYER_OWN
            )
        return found

    def reduce_group(self) -> LaunchArgs:
        """The reduction's layer argument (the output's scale), one group for every layer
        of that scale."""
        group = self._groups.get("reduce")
        if group is None:
            group = self._groups["reduce"] = shared_group({"out_scale": self.out_scale})
        return group


def layer_args(kind: str, cache: torch.Tensor, spec: AttentionSpec, block_n: int) -> LayerArgs:
    """The arguments for a plan of ``kind`` over this cache [N, B, L + R] (contiguous,
    and without a ``cache_problem`` for ``kind``)."""
    lora, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
    rows, width = cache.shape[0] * cache.shape[1], lora + rope
    # V is the stored latent: an fp8 cache stores it / k_scale
    out_scale = spec.k_scale if spec.cache_dtype in _FP8_TYPES else 1.0
    if kind == GLUON:  # 16-bit caches only
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        layout = _gluon_shared_layout(cache.dtype)
        box = [GLUON_BLOCK_N, gluon_piece_width(lora)]
        attention = dict(
            half_desc=TensorDescriptor(cache, [rows, width], [width, 1], box, layout),
            rope_desc=TensorDescriptor(cache, [rows, width], [width, 1], [GLUON_BLOCK_N, rope], layout),
            oob_row=rows,  # a row past the last one: TMA reads zeros there
            qk_scale=spec.scale * LOG2E,
        )  # fmt: skip
        return LayerArgs(attention, 1.0, spec.causal)
    attention = dict(
        Cache=cache,
        KVDesc=None,
        PEDesc=None,
        stride_cache_block=cache.stride(0),
        stride_cache_slot=cache.stride(1),
        # fp8: k_scale folds into the scores' scale and the output's
        qk_scale=spec.scale * LOG2E * out_scale,
        out_scale=out_scale,
    )
    if kind == TMA:
        from triton.tools.tensor_descriptor import TensorDescriptor as TritonDescriptor

        latent_rows = cache.view(rows, width)
        attention["KVDesc"] = TritonDescriptor.from_tensor(latent_rows, [block_n, lora])
        if rope:
            attention["PEDesc"] = TritonDescriptor.from_tensor(latent_rows, [block_n, rope])
    return LayerArgs(attention, out_scale, spec.causal)


# the box and layout of a query descriptor, by (dtype, shape, strides): the descriptor's
# own checks (rank, box, strides, layout) depend on nothing else, so they run once a key
# (~10 us of Python a descriptor, two a forward) and each forward's descriptor is made
# without them (bounded: cleared when full)
_QUERY_BOXES: dict[tuple, tuple[list[int], Any]] = {}
_QUERY_BOXES_MAX = 256


def query_descriptor(query: torch.Tensor) -> Any:
    """The Gluon kernel's TMA descriptor of a query part [T, H, D] (its strides, any
    order: the absorbed q_nope is often a transposed [H, T, L]): a box of one tile's
    rows, token-major as the tile counts them, 64 columns wide (the shared layout's
    swizzle): 64 heads of one token, or every head of 64 / H tokens. TMA reads 16-byte
    aligned strides only: a query with others is copied first."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    size = query.element_size()
    strides = list(query.stride())
    if query.data_ptr() % 16 or any(st * size % 16 for st in strides[:2]):
        query = query.clone(memory_format=torch.contiguous_format)
        strides = list(query.stride())
    shape = list(query.shape)
    key = (query.dtype, *shape, *strides)
    found = _QUERY_BOXES.get(key)
    if found is None:
        heads, width = shape[1], shape[2]
        box = [max(1, GLUON_BLOCK_M // heads), min(heads, GLUON_BLOCK_M), min(width, 64)]
        layout = _gluon_shared_layout(query.dtype, len(box))
        TensorDescriptor(query, shape, strides, box, layout)  # its checks, once a key
        if len(_QUERY_BOXES) >= _QUERY_BOXES_MAX:
            _QUERY_BOXES.clear()
        found = _QUERY_BOXES[key] = (box, layout)
    descriptor = object.__new__(TensorDescriptor)
    vars(descriptor).update(
        base=query, shape=shape, strides=strides, block_shape=found[0], layout=found[1],
        padding="zero",
    )  # fmt: skip
    return descriptor


def query_problem(num_heads: int) -> str | None:
    """None when a tile's query rows are one TMA box (``query_descriptor``), else why not."""
    if num_heads % GLUON_BLOCK_M and GLUON_BLOCK_M % num_heads:
        return f"{num_heads} heads neither divide {GLUON_BLOCK_M} nor are a multiple of it"
    return None


@functools.cache
def _gluon_shared_layout(dtype: torch.dtype, rank: int = 2) -> Any:
    # the 128-byte swizzle of a [64, 64] 16-bit tile; wider tiles of 64-column multiples
    # get the same one, so every shared buffer of the kernel uses it
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for([1] * (rank - 2) + [GLUON_BLOCK_N, 64], gl_dtype)
