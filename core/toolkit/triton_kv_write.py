"""The Triton KV write: new key/value rows into any strided logical cache view, by slot.

One launch writes K and V (or only K, for MLA's latent cache). Token ``t`` goes to
block ``slot // block_size``, offset ``slot % block_size`` of each view; negative
slots (padding) and slots past the pool are skipped, so the kernel never writes
out of bounds and never syncs the host (``CommonAttentionMetadata.validate`` is
where bad slots are reported). fp8 caches store ``x / scale`` saturated to the
format's finite range and rounded to nearest-even, bit for bit what
``pagedkv.toolkit.kv_write.quantize_for_cache`` stores. Offsets are 64-bit.

Importing this module imports triton; ``pagedkv`` itself never does.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from pagedkv.intmath import cdiv, next_power_of_2
from pagedkv.toolkit import dispatch
from pagedkv.toolkit.dispatch import CallArgs, LaunchArgs
from pagedkv.toolkit.launch import KernelLaunch
from pagedkv.toolkit.triton_helpers import fp32_to_fp8_bits

# fp8 cache formats and their mantissa bits (exponent bits: 7 - mantissa bits)
_FP8_MANTISSA_BITS: dict[torch.dtype, int] = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
# elements of one program's [BLOCK_R, HEAD_PAD] tile
_TILE_ELEMENTS = 4096


@triton.jit
def _cache_values(x, inv_scale, FP8: tl.constexpr, FP8_MAX: tl.constexpr, MAN_BITS: tl.constexpr):
    """What the cache stores for ``x``: itself, or the fp8 bits of x * (1 / scale) saturated
    (the product, not a division: see pagedkv.toolkit.kv_write.quantize_for_cache)."""
    if FP8:
        y = x.to(tl.float32) * inv_scale
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        exp_bits: tl.constexpr = 7 - MAN_BITS
        out = fp32_to_fp8_bits(y, exp_bits, MAN_BITS).to(tl.uint8)
    else:
        out = x
    return out


@triton.jit(do_not_specialize=["num_rows", "num_slots"])
def write_kv_kernel(
    Key,  # [T, H, D]
    Value,  # [T, H, Dv] (unused unless HAS_VALUE)
    KCache,  # [num_blocks, BLOCK_SIZE, H, D] view (uint8 when fp8)
    VCache,  # [num_blocks, BLOCK_SIZE, H, Dv] view
    SlotMapping,  # [T'] int64, T' <= T
    k_scale,
    v_scale,
    num_rows,  # T' * H
    num_slots,  # num_blocks * BLOCK_SIZE
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEAD_PAD_V: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_VALUE: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MAN_BITS: tl.constexpr,
):
    # rows are (token, head) pairs; each program moves BLOCK_R of them
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    token = rows // NUM_HEADS
    head = rows % NUM_HEADS
    slot = tl.load(SlotMapping + token, mask=rows < num_rows, other=-1).to(tl.int64)
    row_ok = (slot >= 0) & (slot < num_slots)
    slot = tl.where(row_ok, slot, 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    dims = tl.arange(0, HEAD_PAD)
    mask = row_ok[:, None] & (dims < HEAD_SIZE)[None, :]
    src = Key + (token * stride_kt + head * stride_kh)[:, None] + dims[None, :] * stride_kd
    dst = KCache + (block * stride_kcb + offset * stride_kcs + head * stride_kch)[:, None]
    x = tl.load(src, mask=mask)
    tl.store(
        dst + dims[None, :] * stride_kcd,
        _cache_values(x, k_scale, FP8, FP8_MAX, MAN_BITS),
        mask=mask,
    )
    if HAS_VALUE:
        dims_v = tl.arange(0, HEAD_PAD_V)
        mask_v = row_ok[:, None] & (dims_v < HEAD_SIZE_V)[None, :]
        src_v = (
            Value + (token * stride_vt + head * stride_vh)[:, None] + dims_v[None, :] * stride_vd
        )
        dst_v = VCache + (block * stride_vcb + offset * stride_vcs + head * stride_vch)[:, None]
        xv = tl.load(src_v, mask=mask_v)
        tl.store(
            dst_v + dims_v[None, :] * stride_vcd,
            _cache_values(xv, v_scale, FP8, FP8_MAX, MAN_BITS),
            mask=mask_v,
        )


def plan_write_kv(
    key: torch.Tensor,
    value: torch.Tensor | None,
    k_view: torch.Tensor,
    v_view: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> KernelLaunch:
    """Check the arguments and return the planned launch.

    key: [T, H, D]; value: [T, H, Dv] or None (MLA: K only);
    k_view / v_view: [num_blocks, block_size, H, D(v)], any strides;
    slot_mapping: [T'] int64 (or int32), T' <= T.
    """
    writer = CacheWriter(k_view, v_view, k_scale, v_scale)
    grid, groups, call = writer.launch_args(key, value, slot_mapping)
    return KernelLaunch(
        write_kv_kernel,
        grid,
        {**call.mapping, **{k: v for g in groups for k, v in g.values.items()}},
    )


class CacheWriter:
    """The Triton KV write into one pair of cache views: what depends only on the views
    (their checks, fp8 byte views, the kernel's constants for their row shape, their
    geometry and scales, their addresses) found once, so that each write checks and
    specialises only its rows and slots. An impl keeps one per cache
    (``AttentionImpl.cache_writer``): every layer of an eager step writes, and finding
    those again took a third of the write's host time."""

    __slots__ = ("_groups", "_row_dims", "_shapes", "_views", "block_rows", "device")

    def __init__(
        self,
        k_view: torch.Tensor,
        v_view: torch.Tensor | None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        _check_view("k_view", k_view)
        if v_view is not None:
            _check_view("v_view", v_view)
            if v_view.shape[:3] != k_view.shape[:3] or v_view.dtype != k_view.dtype:
                raise ValueError(
                    f"v_view: expected blocks and heads {tuple(k_view.shape[:3])} and dtype "
                    f"{k_view.dtype} like k_view, got {tuple(v_view.shape[:3])} and {v_view.dtype}"
                )
            if v_view.device != k_view.device:
                raise ValueError(
                    f"v_view: expected on {k_view.device} like k_view, got {v_view.device}"
                )
        fp8 = k_view.dtype in _FP8_MANTISSA_BITS
        if k_view.dtype.itemsize == 1 and not fp8:
            raise ValueError(
                f"k_view: cache dtype {k_view.dtype} is not supported "
                f"(fp8 caches: {', '.join(str(d) for d in _FP8_MANTISSA_BITS)})"
            )
        # fp8 bits are computed in the kernel and stored as bytes
        k_store = k_view.view(torch.uint8) if fp8 else k_view
        v_store = k_store if v_view is None else (v_view.view(torch.uint8) if fp8 else v_view)
        num_heads, head_size = k_view.shape[2], k_view.shape[3]
        head_size_v = v_view.shape[3] if v_view is not None else head_size
        # the rows' [H, D] (and [H, Dv]) each write must have, and the views' shapes
        self._row_dims = (k_view.shape[2:], None if v_view is None else v_view.shape[2:])
        self._shapes = (k_view.shape, None if v_view is None else v_view.shape)
        self.device = k_view.device
        constants = _constants(
            k_view.dtype, num_heads, head_size, head_size_v, k_view.shape[1], v_view is not None
        )
        self.block_rows: int = constants.values["BLOCK_R"]
        num_slots = k_view.shape[0] * k_view.shape[1]
        geometry = _cache_geometry(
            k_store.stride(), v_store.stride(), num_slots, float(k_scale), float(v_scale)
        )
        self._groups = (constants, geometry)
        # the views' addresses, passed with each write's own arguments
        self._views = CallArgs({"KCache": k_store, "VCache": v_store})

    def launch_args(
        self, key: torch.Tensor, value: torch.Tensor | None, slot_mapping: torch.Tensor
    ) -> tuple[tuple[int], tuple[LaunchArgs, ...], CallArgs]:
        """The checked launch of one write: (grid, the shared groups (the constants of
        the views' row shape, their geometry and scales, the rows' strides), the call's
        own arguments: the rows and the slots, with the views')."""
        k_dims, v_dims = self._row_dims
        device = self.device
        if not (key.dim() == 3 and key.shape[1:] == k_dims and key.device == device):
            _check_rows("key", key, "k_view", self._shapes[0], device)
        if (value is None) != (v_dims is None):
            raise ValueError("value and v_view must be given together (or both None)")
        if value is not None and not (
            value.dim() == 3 and value.shape[1:] == v_dims and value.device == device
        ):
            _check_rows("value", value, "v_view", self._shapes[1], device)
        if not (
            slot_mapping.dim() == 1
            and slot_mapping.dtype in (torch.int64, torch.int32)
            and slot_mapping.device == device
        ):
            raise ValueError(
                f"slot_mapping: expected a 1-D int64 tensor on {device}, got {slot_mapping.dtype} "
                f"of shape {tuple(slot_mapping.shape)} on {slot_mapping.device}"
            )
        if slot_mapping.shape[0] > key.shape[0]:
            raise ValueError(
                f"slot_mapping has {slot_mapping.shape[0]} slots but key only {key.shape[0]} rows"
            )
        # the kernel reads slots with unit stride: a strided view would write wrong slots
        slot_mapping = slot_mapping.contiguous()
        val = key if value is None else value
        num_rows = slot_mapping.shape[0] * key.shape[1]
        call = CallArgs(
            dict(Key=key, Value=val, SlotMapping=slot_mapping, num_rows=num_rows)
        ).extended(self._views)
        # the rows' strides: a model's are the same at every layer and step
        groups = (*self._groups, _row_strides(key.stride(), val.stride()))
        return (cdiv(num_rows, self.block_rows),), groups, call

    def __call__(
        self, key: torch.Tensor, value: torch.Tensor | None, slot_mapping: torch.Tensor
    ) -> None:
        """Launch the write of ``key`` (and ``value``) at ``slot_mapping``. Asynchronous
        on CUDA."""
        if slot_mapping.shape[0] == 0:
            return
        grid, groups, call = self.launch_args(key, value, slot_mapping)
        dispatch.launch(write_kv_kernel, grid, groups, call)


@functools.lru_cache(maxsize=256)
def _constants(
    cache_dtype: torch.dtype,
    num_heads: int,
    head_size: int,
    head_size_v: int,
    block_size: int,
    has_value: bool,
) -> LaunchArgs:
    """The write's constexprs and launch options for one layer shape, one group kept
    for all its writes (``dispatch.LaunchArgs``: specialised once)."""
    fp8 = cache_dtype in _FP8_MANTISSA_BITS
    head_pad, head_pad_v = next_power_of_2(head_size), next_power_of_2(head_size_v)
    return LaunchArgs(
        dict(
            NUM_HEADS=num_heads,
            HEAD_SIZE=head_size,
            HEAD_SIZE_V=head_size_v,
            HEAD_PAD=head_pad,
            HEAD_PAD_V=head_pad_v,
            BLOCK_SIZE=block_size,
            # fixed per head size (not per batch), so batch sizes never trigger a recompile
            BLOCK_R=max(1, _TILE_ELEMENTS // max(head_pad, head_pad_v)),
            HAS_VALUE=has_value,
            FP8=fp8,
            FP8_MAX=float(torch.finfo(cache_dtype).max) if fp8 else 0.0,
            MAN_BITS=_FP8_MANTISSA_BITS.get(cache_dtype, 0),
            num_warps=4,
        )
    )


@functools.lru_cache(maxsize=256)
def _cache_geometry(
    k_strides: tuple[int, ...],
    v_strides: tuple[int, ...],
    num_slots: int,
    k_scale: float,
    v_scale: float,
) -> LaunchArgs:
    """The cache views' strides, slot count and scales as one group (a model's layers
    share theirs), so that a write specialises only its rows, slots and views."""
    return LaunchArgs(
        dict(
            k_scale=1.0 / k_scale,  # the kernel multiplies by the reciprocal, like torch
            v_scale=1.0 / v_scale,
            num_slots=num_slots,
            stride_kcb=k_strides[0],
            stride_kcs=k_strides[1],
            stride_kch=k_strides[2],
            stride_kcd=k_strides[3],
            stride_vcb=v_strides[0],
            stride_vcs=v_strides[1],
            stride_vch=v_strides[2],
            stride_vcd=v_strides[3],
        )
    )


@functools.lru_cache(maxsize=256)
def _row_strides(key_strides: tuple[int, ...], value_strides: tuple[int, ...]) -> LaunchArgs:
    """The rows' strides as one group (``[T, H, D]`` views of a projection's output:
    the same few from one write to the next)."""
    names = ("stride_kt", "stride_kh", "stride_kd", "stride_vt", "stride_vh", "stride_vd")
    return LaunchArgs(dict(zip(names, (*key_strides, *value_strides), strict=True)))


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor | None,
    k_view: torch.Tensor,
    v_view: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Launch the write (see ``plan_write_kv`` for shapes). Asynchronous on CUDA. The
    launch skips Triton's per-call dispatch once its variant is known
    (``pagedkv.toolkit.dispatch``): every layer of an eager step writes, and that
    dispatch took longer than the write's kernel. A caller that writes into the same
    views again keeps their ``CacheWriter``."""
    CacheWriter(k_view, v_view, k_scale, v_scale)(key, value, slot_mapping)


def _check_view(name: str, view: torch.Tensor) -> None:
    if view.dim() != 4:
        raise ValueError(
            f"{name}: expected [num_blocks, block_size, H, D], got shape {tuple(view.shape)}"
        )


def _check_rows(
    name: str, rows: torch.Tensor, view_name: str, view_shape: torch.Size, device: torch.device
) -> None:
    if rows.dim() != 3:
        raise ValueError(f"{name}: expected [T, H, D], got shape {tuple(rows.shape)}")
    if rows.shape[1:] != view_shape[2:]:
        raise ValueError(
            f"{view_name}: expected [num_blocks, block_size, {rows.shape[1]}, {rows.shape[2]}] "
            f"to match {name}, got {tuple(view_shape)}"
        )
    raise ValueError(f"{name}: expected on {device} like {view_name}, got {rows.device}")
