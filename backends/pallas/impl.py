"""The Pallas backend's attention: one jitted kernel call on JAX views of the query and
the cache (torch owns both; the base class has checked them and written the new K/V).

On CUDA each forward crosses torch -> JAX -> torch once: the query's DLPack import
orders the kernel after torch's work, the result's import orders torch after JAX.
Everything else a call needs is prepared once (per step in the metadata, per cache
tensor, per layer here), so the host does only those two imports, the dispatch and
the copy into the output.
"""

from __future__ import annotations

import jax
import numpy as np
import torch
from pagedkv.backend import AttentionImpl
from pagedkv.backends.pallas import configs, direct, interop
from pagedkv.backends.pallas.builder import PallasMetadata
from pagedkv.backends.pallas.kernel import KernelConfig, jitted
from pagedkv.errors import UnsupportedError
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.dispatch import current_stream

# jax's Triton lowering computes element offsets of arrays up to 4 GiB in 32-bit
# signed integers (64-bit above): a 1-byte cache of 2-4 GiB is read at wrapped addresses
_INT32_OFFSET_ELEMENTS = 2**31
_INT64_OFFSET_BYTES = 2**32


def triton_offset_overflow(kv_cache: torch.Tensor) -> str | None:
    """Why the GPU kernel cannot address ``kv_cache``, or None."""
    if (
        kv_cache.device.type == "cuda"
        and kv_cache.element_size() == 1
        and kv_cache.numel() >= _INT32_OFFSET_ELEMENTS
        and kv_cache.numel() * kv_cache.element_size() <= _INT64_OFFSET_BYTES
    ):
        return (
            f"kv_cache: an fp8 cache of {kv_cache.numel()} elements (2-4 GiB) overflows the "
            "32-bit offsets of the Pallas Triton lowering; allocate under 2 GiB or over 4 GiB "
            "per layer"
        )
    return None


class PallasAttentionImpl(AttentionImpl[PallasMetadata]):
    def __init__(self, spec: AttentionSpec, *, sinks: torch.Tensor | None = None, **options):
        super().__init__(spec, sinks=sinks, **options)
        self._cache_view = interop.CacheView()
        self._configs: dict[tuple[int, int, int, str], KernelConfig] = {}
        # host copies, read once here: a forward must not sync to fetch them
        zeros = np.zeros(spec.num_heads, np.float32)
        self._slopes = np.asarray(spec.alibi_slopes, np.float32) if spec.alibi_slopes else zeros
        self._sinks = self.sinks.cpu().numpy() if self.sinks is not None else zeros
        self._head_arrays: dict[jax.Device, tuple[jax.Array, jax.Array]] = {}
        # the direct launcher's: compiled variants by config and shapes, slopes and sinks
        self._direct_kernels: dict[tuple, direct.DirectKernel] = {}
        self._head_tensors: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def check_cache(
        self, kv_cache: object, device: torch.device | None = None, metadata: object = None
    ) -> None:
        """The layout's check, then the one limit of the GPU lowering (before any write)."""
        super().check_cache(kv_cache, device, metadata)
        assert isinstance(kv_cache, torch.Tensor)
        problem = triton_offset_overflow(kv_cache)
        if problem:
            raise UnsupportedError(problem)

    def attend(
        self,
        query: torch.Tensor,  # [T, num_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, 2 * num_kv_heads, head_size]
        metadata: PallasMetadata,
        output: torch.Tensor,  # [T, num_heads, head_size]
    ) -> None:
        if metadata.launcher == "direct":
            self._attend_direct(query, kv_cache, metadata, output)
            return
        assert metadata.jax_device is not None
        slopes, sinks = self._head_params(metadata.jax_device)
        result = jitted(metadata.target)(
            interop.to_jax(query.contiguous(), "query", allow_copy=True),
            self._cache_view.get(kv_cache),
            metadata.arrays,
            slopes,
            sinks,
            cfg=self._config(metadata),
        )
        output.copy_(interop.to_torch(result, output.device))

    def _attend_direct(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: PallasMetadata,
        output: torch.Tensor,
    ) -> None:
        """The kernel launched from torch (module ``direct``) on the current stream: into
        ``output`` itself where it is laid out as the kernel writes, else through a
        buffer; with splits, into the step's partials, merged into ``output``."""
        if kv_cache.data_ptr() % direct.DEFAULT_ALIGNMENT:
            raise UnsupportedError(
                f"kv_cache: the direct launcher needs the cache at a "
                f"{direct.DEFAULT_ALIGNMENT}-byte aligned address (got {kv_cache.data_ptr():#x}); "
                "allocate it on its own or pass the option launcher=jax"
            )
        kernel = self._direct_kernel(query, kv_cache, metadata)
        q = query if _aligned(query) else query.clone(memory_format=torch.contiguous_format)
        addresses = [*self._direct_args(metadata, query.device), q.data_ptr(), kv_cache.data_ptr()]
        merge = metadata.merge
        if merge is not None:
            kernel.launch(
                [*addresses, merge.partial.data_ptr(), merge.lse.data_ptr()], current_stream()
            )
            from pagedkv.toolkit.triton_lse_merge import output_args

            merge.launch.run_with(call=output_args(output))
            return
        in_place = _aligned(output) and output.dtype == query.dtype
        out = output if in_place else torch.empty_like(query)
        kernel.launch([*addresses, out.data_ptr()], current_stream())
        if not in_place:
            output.copy_(out)

    def _direct_kernel(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: PallasMetadata
    ) -> direct.DirectKernel:
        cfg = self._config(metadata)
        arrays = metadata.arrays
        num_reqs, width = arrays.block_table.shape
        key = (id(cfg), query.shape[0], arrays.tile_req.shape[0], num_reqs, width, query.dtype,
               kv_cache.shape, kv_cache.dtype)  # fmt: skip
        kernel = self._direct_kernels.get(key)
        if kernel is None:
            shape = direct.LaunchShape(
                cfg,
                num_tokens=query.shape[0],
                num_tiles=arrays.tile_req.shape[0],
                num_reqs=num_reqs,
                table_width=width,
                cache_shape=tuple(kv_cache.shape),
                dtype=_jax_dtype(query.dtype),
                cache_dtype=_jax_dtype(kv_cache.dtype),
            )
            kernel = self._direct_kernels[key] = direct.kernel(shape, query.device)
        return kernel

    def _direct_args(self, metadata: PallasMetadata, device: torch.device) -> list[int]:
        """Addresses of the step's arrays, then of the layer's slopes and sinks."""
        heads = self._head_tensors.get(device)
        if heads is None:
            heads = self._head_tensors[device] = tuple(
                torch.from_numpy(a).to(device) for a in (self._slopes, self._sinks)
            )
        return [*(a.data_ptr() for a in metadata.arrays), heads[0].data_ptr(), heads[1].data_ptr()]

    def _head_params(self, device: jax.Device) -> tuple[jax.Array, jax.Array]:
        """ALiBi slopes and sink logits as [num_heads] float32 arrays on the device."""
        arrays = self._head_arrays.get(device)
        if arrays is None:
            arrays = self._head_arrays[device] = (
                jax.device_put(self._slopes, device),
                jax.device_put(self._sinks, device),
            )
        return arrays

    def _config(self, metadata: PallasMetadata) -> KernelConfig:
        key = (metadata.block_q, metadata.block_n, metadata.split_slots, metadata.target)
        cfg = self._configs.get(key)
        if cfg is None:
            cfg = self._configs[key] = self._new_config(*key)
        return cfg

    def _new_config(
        self, block_q: int, block_n: int, split_slots: int, target: str
    ) -> KernelConfig:
        s = self.spec
        assert s.scale is not None
        block_m = block_q * configs.padded_group(s.num_queries_per_kv)
        return KernelConfig(
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            head_size=s.head_size,
            block_size=s.block_size,
            scale=s.scale,
            causal=s.causal,
            sliding_window=s.sliding_window,
            logits_soft_cap=s.logits_soft_cap,
            use_alibi=s.alibi_slopes is not None,
            use_sinks=s.use_sinks,
            k_scale=s.k_scale if s.is_fp8_kv else 1.0,
            v_scale=s.v_scale if s.is_fp8_kv else 1.0,
            block_q=block_q,
            block_n=block_n,
            split_slots=split_slots,
            target=target,
            num_warps=int(self.options.get("num_warps") or configs.num_warps(block_m, s.head_size)),
            num_stages=int(self.options.get("num_stages") or configs.NUM_STAGES),
        )


def _aligned(tensor: torch.Tensor) -> bool:
    """Whether the direct launcher can pass ``tensor`` as it is: contiguous, aligned as
    the kernel's module declares its pointers."""
    return tensor.is_contiguous() and tensor.data_ptr() % direct.DEFAULT_ALIGNMENT == 0


def _jax_dtype(dtype: torch.dtype) -> str:
    """JAX's name of a torch dtype (the same for every dtype this backend takes)."""
    return str(dtype).removeprefix("torch.")
