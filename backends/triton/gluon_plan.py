"""Host planning of the Gluon sm_90 prefill kernel (gluon_prefill.py), in three parts.

The contract, for the builder and the impl:

- ``gluon_prefill_problem(spec, device)`` (builder, once): None when the kernel can run
  this layer's steps on ``device``, else why not, as a sentence; the portable
  ``unified_attention_kernel`` runs those layers (fp8 or fp32, head sizes other than
  64/128/256, sliding window, soft cap, ALiBi, sinks, MLA, other GPUs, the CPU and
  Triton's interpreter). ``gluon_step_problem(common, spec, num_splits)`` says the same
  of one step (split-KV steps and steps whose longest query fills no 128-row tile go
  to the portable kernel).
- ``plan_gluon_prefill(spec, common, requests=None)`` (builder, once per step or part
  of a step): a ``GluonPrefillStep``
  holding the grid ``(T // BLOCK_Q + num_reqs, Hkv)`` (from the padded token count, as
  the portable kernel's, so a CUDA-graph step keeps its grid; a part's from its own
  tokens and requests) and the step's kwargs:
  ``BlockTable``, ``SeqLens``, ``QueryStartLoc``, ``num_seqs``, ``stride_bt``, the
  tile constants and the launch options. No device sync, no allocation.
- ``gluon_cache_args(spec, k_view, v_view)`` (impl, once per layer and cache tensor;
  keep it with the memoised cache views): the TMA descriptors ``KCache``/``VCache``
  over the logical K/V views ``[num_blocks, block_size, Hkv, D]`` (head dim contiguous,
  each view a dense ``[num_blocks * block_size, Hkv * D]`` matrix, 16-byte aligned) and
  ``oob_row``; ``gluon_cache_problem`` says why a cache cannot be read that way (the
  impl then plans the portable kernel). Building descriptors costs Python time: do it
  once per cache, not per forward.
- ``gluon_layer_args(spec)`` (impl, once per layer): ``qk_scale`` (softmax scale *
  log2 e), ``v_scale`` and ``CAUSAL``, the names the portable kernel uses. A 16-bit
  cache stores K and V as they are (docs/contract.md: only fp8 caches store
  ``x / scale``), so ``k_scale`` and ``v_scale`` do not apply here.
- ``GluonPrefillStep.template`` (impl, every forward): the step's ``KernelLaunch``, run
  with one group of the layer's arguments (cache and layer args, ``LaunchArgs``) and
  ``call_args(query, output)``: the query and output ``[T, Hq, D]`` (the layer's 16-bit
  dtype, head dim contiguous) and their strides. ``GluonPrefillStep.launch`` makes the
  whole launch at once (tests, tuning).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pagedkv.backends.triton.parts import StagedPart, part_views
from pagedkv.errors import UnsupportedError
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.interpreter import interpreting
from pagedkv.toolkit.launch import KernelLaunch
from pagedkv.toolkit.numerics import LOG2E

# -- the kernel's fixed geometry ---------------------------------------------------------
BLOCK_M = 128  # query rows per program: two consumer warpgroups of 64 (one m64 wgmma each)
NUM_WARPS = 4  # the first consumer warpgroup (the default partition)
CONSUMER_REGS = 240  # registers per thread of each consumer warpgroup (setmaxnreg)
PRODUCER_REGS = 24  # ... of the loading warp: scalar work only
# The kernel's launch register count: 3 warpgroups (consumer, consumer, the producer's
# warp rounded up to a warpgroup) x 128 threads x 168 <= 65536 registers of an SM; the
# default partition then takes 3 * 168 - 240 - 24 = 240.
MAX_NREG = 168
# keys per tile and K/V ring slots, per head size: S (64 x TILE_N) and O (64 x D) fp32
# accumulators of a consumer fit its 240 registers; Q + STAGES x (K + V) fit 227 KiB
TILES = {64: (128, 4), 128: (128, 2), 256: (64, 2)}
HEAD_SIZES = tuple(TILES)
BLOCK_SIZES = (16, 32, 64, 128)  # a TMA box is one page, or a tile's part of one
_16_BIT = (torch.float16, torch.bfloat16)
# TMA coordinates are 32-bit: the out-of-range row (num_blocks * block_size) must fit
_MAX_TMA_ROWS = 2**31 - 1


def _hopper_gluon_missing() -> str | None:
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError as exc:
        return f"this Triton has no Gluon Hopper API ({exc})"
    return None


def gluon_prefill_problem(
    spec: AttentionSpec,
    device: torch.device | str,
    *,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """None when the Gluon sm_90 prefill kernel can run this layer on ``device``, else
    why not. ``capability`` overrides the device's (planning for an H200 elsewhere)."""
    device = torch.device(device)
    if capability is None:
        if interpreting():
            return "Triton's interpreter runs no Gluon kernel"
        if device.type != "cuda":
            return f"a CUDA device is needed ({device.type} here)"
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) != (9, 0):
        return f"wgmma, TMA and setmaxnreg need sm_90 (sm_{capability[0]}{capability[1]} here)"
    if spec.is_mla:
        return "MLA layers have their own backend"
    if spec.dtype not in _16_BIT:
        return f"16-bit queries only ({spec.dtype} here)"
    if spec.is_fp8_kv:
        return f"fp8 cache ({spec.kv_cache_dtype}): the portable kernel dequantises it"
    if spec.cache_dtype != spec.dtype:
        return f"the cache dtype ({spec.cache_dtype}) must be the query's ({spec.dtype})"
    if spec.head_size not in HEAD_SIZES or spec.head_size_v != spec.head_size:
        return f"head size {spec.head_size} (V {spec.head_size_v}): 64, 128 or 256 only"
    if spec.block_size not in BLOCK_SIZES:
        return f"block size {spec.block_size}: {', '.join(map(str, BLOCK_SIZES))} only"
    if spec.sliding_window is not None:
        return "sliding window"
    if spec.logits_soft_cap is not None:
        return "logits soft cap"
    if spec.alibi_slopes is not None:
        return "ALiBi"
    if spec.use_sinks:
        return "attention sinks"
    if spec.num_heads % spec.num_kv_heads or spec.num_heads // spec.num_kv_heads > BLOCK_M:
        return f"GQA group {spec.num_heads}/{spec.num_kv_heads}: a whole group per program"
    return _hopper_gluon_missing()


def gluon_step_problem(
    common: CommonAttentionMetadata,
    spec: AttentionSpec,
    num_splits: int,
    *,
    max_query_len: int | None = None,
) -> str | None:
    """None when this step should run the Gluon kernel (its layer allowed by
    ``gluon_prefill_problem``), else why the portable kernel should. Host values only.
    ``max_query_len`` overrides the step's (a CUDA-graph plan decides from its bounds)."""
    if num_splits > 1:
        return f"split-KV step ({num_splits} splits)"
    group = spec.num_queries_per_kv
    longest = common.max_query_len if max_query_len is None else max_query_len
    if longest * group < BLOCK_M:
        return (
            f"no request fills a {BLOCK_M}-row tile (longest query {longest} "
            f"tokens x {group} heads)"
        )
    return None


# One program's rate on its SM over a long context (H200, bf16): a chunk of 64 queries
# at 32k beside 16 decodes took 418-420 us on the Gluon kernel unsplit (fourteenth and
# fifteenth sessions, benchmarks/mixed_chunk_sweep.py), its one program per (head, KV
# head) 128 rows over 32832 keys, 2.15 GFLOP: 5.1 TFLOP/s. All but the last key block
# are unmasked: the whole GPU's causal-prefill rate (441 TFLOP/s over 132 SMs, 3.3 per
# SM, its half-masked diagonal blocks and its last wave included) undercounts such a
# program by half.
GLUON_SM_TFLOPS = 5.1


def gluon_program_us(head_size: int, keys: int) -> float:
    """The model's time for one program (``BLOCK_M`` rows over ``keys`` keys) on one SM."""
    flops = BLOCK_M * keys * 4 * head_size  # QK^T and PV
    return flops / (GLUON_SM_TFLOPS * 1e6)


def gluon_programs(spec: AttentionSpec, query_lens: np.ndarray) -> int:
    """The programs that hold an SM in a launch over requests of ``query_lens`` queries:
    one per ``BLOCK_M`` rows of a request (whole GQA groups) and KV head (the grid's
    other query blocks, its upper bound, exit at once)."""
    block_q = BLOCK_M // spec.num_queries_per_kv
    return int((-(-query_lens // block_q)).sum()) * spec.num_kv_heads


def tiles_for(head_size: int) -> tuple[int, int]:
    """(keys per tile, ring slots) for a head size of ``HEAD_SIZES``."""
    return TILES[head_size]


def gluon_layer_args(spec: AttentionSpec) -> dict[str, Any]:
    """The layer's scalars: scores scaled into the log2 domain, no cache scales (16-bit)."""
    return dict(qk_scale=spec.scale * LOG2E, v_scale=1.0, CAUSAL=spec.causal)


# -- the step ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GluonPrefillStep:
    """One step's Gluon prefill launch, but for the layer's tensors and scales."""

    grid: tuple[int, int]  # (query blocks, upper bound; KV heads)
    kwargs: dict[str, Any]  # the step's arguments, constants and launch options

    @functools.cached_property
    def template(self) -> KernelLaunch:
        """The step's launch, for ``KernelLaunch.run_with``: the impl adds one group of
        the layer's arguments (``gluon_cache_args`` and ``gluon_layer_args``, once per
        cache) and the forward's ``call_args``."""
        from pagedkv.backends.triton.gluon_prefill import gluon_prefill_kernel

        return KernelLaunch(gluon_prefill_kernel, self.grid, self.kwargs)

    def launch(
        self,
        query: torch.Tensor,
        output: torch.Tensor,
        layer_args: Mapping[str, Any],
        cache_args: Mapping[str, Any],
    ) -> KernelLaunch:
        """One whole launch (tests, tuning). query, output: [T, Hq, D] with a contiguous
        head dim; layer_args: ``gluon_layer_args``'s; cache_args: ``gluon_cache_args``'s."""
        kwargs = dict(self.kwargs, **cache_args, **layer_args, **call_args(query, output))
        return KernelLaunch(self.template.kernel, self.grid, kwargs)


def call_args(query: torch.Tensor, output: torch.Tensor) -> dict[str, Any]:
    """A forward's arguments: query and output [T, Hq, D] (head dim contiguous) and their
    strides; the names the portable kernel uses too."""
    qs, os_ = query.stride(), output.stride()
    if qs[2] != 1 or os_[2] != 1:
        name = "query" if qs[2] != 1 else "output"
        raise UnsupportedError(f"{name}: the head dimension must be contiguous (stride 1)")
    return {
        "Q": query, "Out": output, "stride_qt": qs[0], "stride_qh": qs[1],
        "stride_ot": os_[0], "stride_oh": os_[1],
    }  # fmt: skip


def plan_gluon_prefill(
    spec: AttentionSpec,
    common: CommonAttentionMetadata,
    *,
    requests: tuple[int, int] | None = None,
    staged: StagedPart | None = None,
    tile_n: int | None = None,
    stages: int | None = None,
) -> GluonPrefillStep:
    """The step's part of the launch (a layer allowed by ``gluon_prefill_problem``), over
    ``requests`` ``[first, end)`` of the step (default: all of them, padding included;
    a part gets views from its first request on, and writes only its own rows).
    ``staged``: a CUDA-graph step's part, already copied into these persistent buffers.
    ``tile_n`` / ``stages`` override the head size's tiles (tuning)."""
    default_n, default_stages = tiles_for(spec.head_size)
    group = spec.num_queries_per_kv
    block_q = BLOCK_M // group
    views = staged.views(block_q) if staged else part_views(common, requests, block_q)
    kwargs: dict[str, Any] = dict(
        BlockTable=views.block_table,
        SeqLens=views.seq_lens,
        QueryStartLoc=views.query_start_loc,
        num_seqs=views.num_reqs,
        stride_bt=views.block_table.stride(0),
        HEAD_SIZE=spec.head_size,
        BLOCK_SIZE=spec.block_size,
        GROUP=group,
        BLOCK_Q=block_q,
        TILE_N=tile_n or default_n,
        STAGES=stages or default_stages,
        CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS,
        num_warps=NUM_WARPS,
        maxnreg=MAX_NREG,
    )
    return GluonPrefillStep((views.query_blocks, spec.num_kv_heads), kwargs)


# -- the layer's cache ------------------------------------------------------------------------


def gluon_cache_problem(k_view: torch.Tensor, v_view: torch.Tensor) -> str | None:
    """Why these logical K/V views [num_blocks, block_size, Hkv, D] cannot be read as
    dense ``[num_blocks * block_size, Hkv * D]`` matrices through TMA, or None."""
    for name, view in (("K", k_view), ("V", v_view)):
        nb, bs, heads, dim = view.shape
        strides = view.stride()
        dense = strides[1:] == (heads * dim, dim, 1) and (nb == 1 or strides[0] == bs * heads * dim)
        if not dense:
            return f"the {name} view's strides {strides} are not dense rows of Hkv * D"
        if view.data_ptr() % 16 or heads * dim * view.element_size() % 16:
            return f"the {name} view is not 16-byte aligned (TMA)"
        if nb * bs > _MAX_TMA_ROWS:
            return f"{nb * bs} cache rows: TMA coordinates are 32-bit"
    return None


def gluon_cache_args(
    spec: AttentionSpec, k_view: torch.Tensor, v_view: torch.Tensor, *, tile_n: int | None = None
) -> dict[str, Any]:
    """``KCache``/``VCache`` TMA descriptors over the views and ``oob_row``, a row past
    the cache where TMA reads zeros. Raises UnsupportedError for a ``gluon_cache_problem``."""
    why = gluon_cache_problem(k_view, v_view)
    if why is not None:
        raise UnsupportedError(f"kv_cache: {why}")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    nb, bs, heads, dim = k_view.shape
    rows, width = nb * bs, heads * dim
    box = [min(bs, tile_n or tiles_for(dim)[0]), dim]
    layout = _shared_layout(k_view.dtype, box[0], dim)
    k_desc, v_desc = (
        TensorDescriptor(view, [rows, width], [width, 1], box, layout) for view in (k_view, v_view)
    )
    return dict(KCache=k_desc, VCache=v_desc, oob_row=rows)


@functools.cache
def _shared_layout(dtype: torch.dtype, box_rows: int, head_size: int) -> Any:
    # the widest swizzle of a box; the query and the ring use the same layout (rows of
    # the same width), which is also what wgmma reads
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for([box_rows, head_size], gl_dtype)
