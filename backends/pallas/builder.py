"""The Pallas backend's metadata and its builder: query tiles and the split count of a
step, decided on the host from the CPU copies of the metadata (no device sync), and
the step's arrays handed to JAX once for every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import torch
from pagedkv.backend import AttentionMetadataBuilder, BackendMetadata
from pagedkv.backends.pallas import configs, interop
from pagedkv.backends.pallas.kernel import StepArrays
from pagedkv.errors import ConfigError, UnsupportedError
from pagedkv.intmath import cdiv
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.launch import KernelLaunch
from pagedkv.toolkit.split_kv import num_sms
from pagedkv.transfer import to_device


@dataclass(frozen=True)
class PallasMetadata(BackendMetadata):
    """One step for the kernel: ``common`` (the step) plus its arrays and tiling."""

    # int32: JAX arrays on ``jax_device`` (the JAX launcher: DLPack views of the torch
    # tensors), or torch tensors on the step's device aligned for the direct launcher
    arrays: StepArrays
    jax_device: jax.Device | None  # the JAX launcher's device
    block_q: int  # query tokens per tile
    block_n: int  # keys per inner-loop step
    num_splits: int  # key ranges of the longest tile (the policy's choice)
    split_slots: int  # programs per tile along the keys: num_splits rounded up
    split_steps: int  # the most key steps (block_n keys) of a range
    target: str  # "interpret" (CPU) or "triton" (CUDA)
    launcher: str = "jax"  # "jax", or "direct" (module direct: on torch's stream)
    # the direct launcher with splits: the merge of the partials into a forward's output
    merge: SplitMerge | None = None


@dataclass(frozen=True)
class SplitMerge:
    """The direct launcher's partial results of a split step (one per row and slot, a
    row's slots consecutive: the toolkit merge's layout) and their merge."""

    partial: torch.Tensor  # [T, slots, num_heads, head_pad] float32
    lse: torch.Tensor  # [T, slots, num_heads] float32
    launch: KernelLaunch  # merge_by_lse without its output (triton_lse_merge.output_args)


# Byte alignment of the step's arrays: the direct launcher's kernel declares its pointers
# 32-byte aligned (direct.DEFAULT_ALIGNMENT); DLPack views on a CPU need 64
PACKED_ALIGNMENT = 64


def num_tiles_bound(num_tokens: int, num_reqs: int, block_q: int) -> int:
    """Most query tiles a batch of ``num_tokens`` rows over ``num_reqs`` requests needs.

    Each request adds at most one partial tile, and every tile holds a token, so the
    launch size depends on shapes only.
    """
    return max(1, min(num_tokens, cdiv(num_tokens, block_q) + num_reqs))


def plan_tiles(
    query_lens: np.ndarray, num_tokens: int, block_q: int
) -> tuple[np.ndarray, np.ndarray]:
    """Query tiles of ``block_q`` tokens over requests with ``query_lens`` ([B] ints),
    ``num_tiles_bound`` of them: (tile_req, tile_qstart), int32. ``tile_req[i]`` is the
    request of tile i (-1: idle), ``tile_qstart[i]`` its first query row in the request."""
    num_reqs = query_lens.shape[0]
    tiles_per_req = -(-query_lens // block_q)
    num_real = int(tiles_per_req.sum())
    num_tiles = num_tiles_bound(num_tokens, num_reqs, block_q)
    tile_req = np.full(num_tiles, -1, dtype=np.int32)
    tile_qstart = np.zeros(num_tiles, dtype=np.int32)
    tile_req[:num_real] = np.repeat(np.arange(num_reqs, dtype=np.int32), tiles_per_req)
    first_tile = np.repeat(np.cumsum(tiles_per_req) - tiles_per_req, tiles_per_req)
    tile_qstart[:num_real] = (np.arange(num_real) - first_tile) * block_q
    return tile_req, tile_qstart


class PallasMetadataBuilder(AttentionMetadataBuilder[PallasMetadata]):
    """Cuts each request's query rows into tiles of ``block_q`` tokens and chooses the
    split count (``configs.choose_splits``: the toolkit's makespan rule). Options:
    ``block_m``, ``block_n``, ``num_splits`` (0 = chosen per step) and ``launcher``.

    Under a CUDA-graph reservation the launch's shape must not change
    from step to step: the tile height comes from the bounds' longest query and the
    split slots from the bounds (``configs.graph_split_slots``); each step's split count
    (at most the slots) is an input the kernel reads."""

    def __init__(self, spec: AttentionSpec, device: torch.device | str, **options: Any) -> None:
        super().__init__(spec, device, **options)
        interop.configure_jax()  # before this builder's first JAX computation
        self.target = "interpret" if self.device.type == "cpu" else "triton"
        from pagedkv.backends.pallas.direct import resolve_launcher

        self.launcher = resolve_launcher(str(options.get("launcher") or "auto"), self.device)
        self.group_pad = configs.padded_group(spec.num_queries_per_kv)
        self.block_m = int(options.get("block_m") or 0)
        self.block_n = int(
            options.get("block_n")
            or configs.default_block_n(spec.head_size, spec.cache_dtype.itemsize)
        )
        self.forced_splits = configs.check_num_splits(
            int(options.get("num_splits") or 0), "option num_splits"
        )
        self.num_sms = num_sms(self.device)

    def build_metadata(
        self, common: CommonAttentionMetadata, *, num_splits: int | None = None, **overrides: Any
    ) -> PallasMetadata:
        """``num_splits`` forces this step's split count (tuning), as the option does."""
        if overrides:
            raise ConfigError(
                f"build: unknown override(s) {', '.join(sorted(overrides))} (accepted: num_splits)"
            )
        if common.device.type != self.device.type:
            raise UnsupportedError(
                f"metadata is on {common.device}, this builder was made for {self.device}"
            )
        bounds = self.graph_bounds
        query_lens = np.diff(common.query_start_loc_cpu.numpy())
        max_query_len = int(query_lens.max(initial=0))
        # a graph's launch keeps the tile height of the bounds' longest query
        tiled_query_len = bounds.max_query_len if bounds is not None else max_query_len
        block_q = configs.block_q(tiled_query_len, self.group_pad, self.block_m)
        tile_req, tile_qstart = plan_tiles(query_lens, common.num_tokens, block_q)
        spec = self.spec
        keys = configs.tile_keys(
            query_lens, common.seq_lens_cpu.numpy(), tile_req, tile_qstart, block_q,
            causal=spec.causal, window=spec.sliding_window, block_n=self.block_n,
        )  # fmt: skip
        slots = None
        if bounds is not None:
            slots = configs.graph_split_slots(
                bounds,
                num_heads=spec.num_heads,
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
                num_tiles=tile_req.shape[0],
                num_sms=self.num_sms,
            )
        choice = configs.choose_splits(
            keys,
            max_query_len,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            cache_bytes=spec.cache_dtype.itemsize,
            num_tokens=common.num_tokens,
            block_n=self.block_n,
            num_sms=self.num_sms,
            forced=configs.check_num_splits(num_splits or 0, "build(num_splits)")
            or self.forced_splits,
        )
        if slots is None:
            slots = configs.split_slots(choice.num_splits)
        longest = int(keys.max(initial=0))
        steps, splits = configs.split_steps(choice, longest, self.block_n, slots)
        plan = dict(
            common=common,
            block_q=block_q,
            block_n=self.block_n,
            num_splits=splits,
            split_slots=slots,
            split_steps=steps,
            target=self.target,
        )
        if self.launcher == "direct":
            return self._direct_metadata(common, tile_req, tile_qstart, plan)
        if self.graph_bounds is not None:
            # views of the persistent buffers, so a replay reads the step built last
            # (the CPU's emulated replay of the contract's graph path)
            names = ("tile_req", "tile_qstart", "split_steps")
            tiles = self._packed_tiles(tile_req, tile_qstart, steps)
            viewed = {n: interop.to_jax(t, n) for n, t in zip(names, tiles)}
            arrays = StepArrays(
                query_start_loc=interop.to_jax(common.query_start_loc, "query_start_loc"),
                seq_lens=interop.to_jax(common.seq_lens, "seq_lens"),
                block_table=interop.to_jax(common.block_table, "block_table"),
                **viewed,
            )
            device = next(iter(arrays.block_table.devices()))
            return PallasMetadata(arrays=arrays, jax_device=device, **plan)
        block_table = interop.to_jax(common.block_table, "block_table", allow_copy=True)
        device = next(iter(block_table.devices()))
        arrays = StepArrays(
            tile_req=jax.device_put(tile_req, device),
            tile_qstart=jax.device_put(tile_qstart, device),
            query_start_loc=interop.to_jax(
                common.query_start_loc, "query_start_loc", allow_copy=True
            ),
            seq_lens=interop.to_jax(common.seq_lens, "seq_lens", allow_copy=True),
            block_table=block_table,
            split_steps=jax.device_put(np.array([steps], np.int32), device),
        )
        return PallasMetadata(arrays=arrays, jax_device=device, **plan)

    def _packed_tiles(
        self, tile_req: np.ndarray, tile_qstart: np.ndarray, split_steps: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tile_req, tile_qstart, split_steps) on the device in one host-to-device copy,
        each at an offset aligned to ``PACKED_ALIGNMENT``; under a CUDA-graph reservation
        in one persistent buffer."""
        align = PACKED_ALIGNMENT // 4  # int32 elements
        stride = cdiv(tile_req.shape[0], align) * align
        host = np.zeros(2 * stride + align, np.int32)
        host[: tile_req.shape[0]] = tile_req
        host[stride : stride + tile_qstart.shape[0]] = tile_qstart
        host[2 * stride] = split_steps
        if self.graph_bounds is None:
            packed = to_device(host, self.device)
        else:
            packed = self.scratch("pallas_tiles", host.shape, torch.int32)
            packed.copy_(torch.from_numpy(host), non_blocking=True)
        return (
            packed[: tile_req.shape[0]],
            packed[stride : stride + tile_qstart.shape[0]],
            packed[2 * stride : 2 * stride + 1],
        )

    def _direct_metadata(
        self,
        common: CommonAttentionMetadata,
        tile_req: np.ndarray,
        tile_qstart: np.ndarray,
        plan: dict[str, Any],
    ) -> PallasMetadata:
        """The step's arrays as torch tensors for the direct launcher: the tiles and the
        split count packed (``_packed_tiles``), the step's own tensors where they are
        contiguous and aligned (copies otherwise)."""
        tiles = self._packed_tiles(tile_req, tile_qstart, plan["split_steps"])
        arrays = StepArrays(
            tile_req=tiles[0],
            tile_qstart=tiles[1],
            query_start_loc=_aligned(common.query_start_loc, "query_start_loc"),
            seq_lens=_aligned(common.seq_lens, "seq_lens"),
            block_table=_aligned(common.block_table, "block_table"),
            split_steps=tiles[2],
        )
        slots = plan["split_slots"]
        merge = self._split_merge(common.num_tokens, slots) if slots > 1 else None
        return PallasMetadata(
            arrays=arrays, jax_device=None, launcher="direct", merge=merge, **plan
        )

    def _split_merge(self, num_tokens: int, slots: int) -> SplitMerge:
        from pagedkv.toolkit.triton_lse_merge import merge_template

        heads, head_size = self.spec.num_heads, self.spec.head_size
        head_pad = configs.head_pad(head_size)
        partial = self.scratch(
            "pallas_partial", (num_tokens, slots, heads, head_pad), torch.float32
        )
        lse = self.scratch("pallas_lse", (num_tokens, slots, heads), torch.float32)
        indptr = self.scratch("pallas_merge_indptr", (num_tokens + 1,), torch.int32)
        # every row merges its own slots (slots past the step's split count: LSE -inf)
        torch.arange(0, (num_tokens + 1) * slots, slots, dtype=torch.int32, out=indptr)
        rows = partial.view(num_tokens * slots, heads, head_pad)[..., :head_size]
        launch = merge_template(rows, lse.view(num_tokens * slots, heads), indptr, num_tokens, None)
        return SplitMerge(partial, lse, launch)


def _aligned(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` as the direct launcher reads it: int32, contiguous and aligned as the
    kernel's module declares (a copy otherwise)."""
    if tensor.dtype != torch.int32:
        raise UnsupportedError(f"{name}: expected int32, got {tensor.dtype}")
    if not tensor.is_contiguous() or tensor.data_ptr() % PACKED_ALIGNMENT:
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor
