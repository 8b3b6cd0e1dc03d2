"""The MLA backend's per-layer attention (and the latent write of the parts form).

Prefill and chunked-prefill rows take the same absorbed path as decode: every query
row attends over the latent cache with its own causal limit. With 16 or more heads per
token the absorbed form is already compute-dense (the heads fill the M dimension of
the matmuls), it needs no per-head K/V up-projection of the context, and one kernel
serves mixed batches. A long prefill does more FLOPs per token this way than the
un-absorbed form (L + R = 576 wide scores instead of 192 per head), which is the
price of that simplicity (docs/mla.md).
"""

from __future__ import annotations

from typing import Any

import torch
from pagedkv.backend import AttentionImpl, expect_tensor
from pagedkv.backends.mla.builder import MLAMetadata
from pagedkv.backends.mla.plan import POINTER, LayerArgs, StepPlan, cache_problem, layer_args
from pagedkv.errors import UnsupportedError
from pagedkv.toolkit.interpreter import interpreter_problem
from pagedkv.toolkit.kv_write import cache_writer
from pagedkv.toolkit.launch import KernelLaunch


class MLAAttentionImpl(AttentionImpl[MLAMetadata]):
    """Absorbed attention over the latent cache for one MLA layer.

    ``forward`` (the base class's) takes the contract's concatenated tensors and writes
    the latent rows with the shared writer; ``forward_mla`` and ``write_latent`` take
    the parts (absorbed q_nope, q_pe, kv_c, k_pe) as a model produces them, so nothing
    is concatenated on the way in.
    """

    def __init__(self, spec, **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        # (key, kernel kind, arguments) of the last cache this layer attended over: its TMA
        # descriptors cost tens of microseconds of Python to build
        self._cache_memo: tuple[tuple, str, LayerArgs] | None = None

    # -- checks -----------------------------------------------------------------------

    def check_cache(
        self, kv_cache: object, device: torch.device | None = None, metadata: object = None
    ) -> None:
        """The layout's check, and that Triton kernels can run where the cache is."""
        super().check_cache(kv_cache, device, metadata)
        assert isinstance(kv_cache, torch.Tensor)
        if kv_cache.device.type == "cpu":
            problem = interpreter_problem("cpu")
            if problem:
                raise UnsupportedError(f"the mla backend runs Triton kernels: {problem}")
            if self.spec.dtype == torch.bfloat16:
                raise UnsupportedError(
                    "bfloat16 is not supported under the Triton interpreter (it computes bf16 "
                    "on raw bits, triton-lang/triton#11584); use float16/float32 on a CPU"
                )

    # -- the latent write -------------------------------------------------------------

    def write_latent(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: MLAMetadata,
        *,
        use_triton: bool | None = None,
    ) -> None:
        """kv_c [T, L] (normalised compressed KV) and k_pe [T, R] or [T, 1, R] (RoPE'd)
        go to their slots, concatenated in the cache; negative slots are skipped.
        use_triton: as ``pagedkv.toolkit.kv_write.write_kv_by_slot`` (None: the Triton
        kernel for CUDA tensors)."""
        num_tokens = self.check_metadata(metadata)
        self.check_cache(kv_cache, kv_cache.device, metadata)
        self._write_parts(kv_c, k_pe, kv_cache, metadata, num_tokens, use_triton)

    def latent_write_operands(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(key, value, k_view, v_view) for the shared writer: kv_c into the latent's
        first L values, k_pe into the last R (one launch); value None when R = 0."""
        k_view, v_view = self._latent_parts(kv_cache)
        key, value = self._latent_rows(kv_c, k_pe)
        return key, value, k_view, v_view

    def _latent_parts(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The latent's views [N, B, 1, L] and [N, B, 1, R] (None when R = 0)."""
        lora = self.spec.kv_lora_rank
        latent = self.cache_views(kv_cache).k  # [N, B, 1, L + R]
        if self.spec.qk_rope_head_dim == 0:
            return latent[..., :lora], None
        return latent[..., :lora], latent[..., lora:]

    def _latent_rows(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """kv_c and k_pe as the writer's [T, 1, L] and [T, 1, R] rows (k_pe None when
        R = 0)."""
        if self.spec.qk_rope_head_dim == 0:
            return kv_c.unsqueeze(1), None
        return kv_c.unsqueeze(1), k_pe.unsqueeze(1) if k_pe.dim() == 2 else k_pe

    def _write_parts(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: MLAMetadata,
        num_tokens: int,  # the metadata's, from check_metadata
        use_triton: bool | None,
    ) -> None:
        s = self.spec
        expect_tensor("kv_c", kv_c, (num_tokens, s.kv_lora_rank), s.dtype)
        if isinstance(k_pe, torch.Tensor) and k_pe.dim() == 3:
            expect_tensor("k_pe", k_pe, (num_tokens, 1, s.qk_rope_head_dim), s.dtype)
        else:
            expect_tensor("k_pe", k_pe, (num_tokens, s.qk_rope_head_dim), s.dtype)
        # the latent's two parts' writer, kept with the cache's views (per kernel choice)
        derived = self.cache_views(kv_cache).derived
        writer = derived.get(("latent writer", use_triton))
        if writer is None:
            # one scale for both parts: the whole latent row is stored / k_scale
            writer = derived[("latent writer", use_triton)] = cache_writer(
                *self._latent_parts(kv_cache), s.k_scale, s.k_scale, use_triton=use_triton
            )
        writer(*self._latent_rows(kv_c, k_pe), metadata.slot_mapping)

    # -- attention --------------------------------------------------------------------

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: MLAMetadata,
        output: torch.Tensor,
    ) -> None:
        """query [T, H, L + R] absorbed; output [T, H, L] (apply W_UV to get the heads'
        values)."""
        lora = self.spec.kv_lora_rank
        self._attend(query[..., :lora], query[..., lora:], kv_cache, metadata, output)

    def forward_mla(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor | None,
        k_pe: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: MLAMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The parts form of ``forward``.

        q_nope: [T, H, L], the query's no-PE part already multiplied by W_UK
        (``absorb_query``); q_pe: [T, H, R]; kv_c: [T, L] and k_pe: [T, R] or
        [T, 1, R], the new latent rows (both None: nothing to write). Returns
        ``output`` or a new [T, H, L] tensor in spec.dtype.
        """
        s, num_tokens = self.spec, self.check_metadata(metadata)
        expect_tensor("q_nope", q_nope, (num_tokens, s.num_heads, s.kv_lora_rank), s.dtype)
        expect_tensor("q_pe", q_pe, (num_tokens, s.num_heads, s.qk_rope_head_dim), s.dtype)
        if output is not None:
            expect_tensor("output", output, (num_tokens, s.num_heads, s.kv_lora_rank), s.dtype)
        if (kv_c is None) != (k_pe is None):
            raise UnsupportedError("kv_c and k_pe must be given together (or both None)")
        self.check_cache(kv_cache, q_nope.device, metadata)
        if kv_c is not None:
            self._write_parts(kv_c, k_pe, kv_cache, metadata, num_tokens, None)  # type: ignore[arg-type]
        out = self.new_output(q_nope, output)
        self._attend(q_nope, q_pe, kv_cache, metadata, out)
        return out

    def _attend(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: MLAMetadata,
        output: torch.Tensor,
    ) -> None:
        # the kernels index the last dims with stride 1 (other strides are free)
        out = output
        if output.stride(-1) != 1:
            out = torch.empty(output.shape, dtype=output.dtype, device=output.device)
        if metadata.zero_rows_from is not None:
            out[metadata.zero_rows_from :] = 0  # padding rows: zero, not stale
        plan, layer = self._plan_and_layer(kv_cache, metadata)
        plan.run(_unit_last_stride(q_nope), _unit_last_stride(q_pe), out, layer)
        if out is not output:
            output.copy_(out)

    def plan_attention(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: MLAMetadata,
        out: torch.Tensor,
    ) -> list[KernelLaunch]:
        """The kernel launches of the attention into ``out`` (no write), as the forward
        runs them (for the sm_90 compile check and the CUDA-graph tests); the kernel is
        the one the builder planned for its device (``metadata.plan.kind``)."""
        plan, layer = self._plan_and_layer(kv_cache, metadata)
        return plan.launches(_unit_last_stride(q_nope), _unit_last_stride(q_pe), out, layer)

    def _plan_and_layer(
        self, kv_cache: torch.Tensor, metadata: MLAMetadata
    ) -> tuple[StepPlan, LayerArgs]:
        """The step's plan for this cache (the pointer-load plan where TMA cannot read
        it) and the layer's arguments over it (computed once per cache)."""
        plan = metadata.plan
        block_n = metadata.config.block_n
        key = (plan.kind, block_n, kv_cache.data_ptr(), kv_cache.shape, kv_cache.dtype)
        memo = self._cache_memo
        if memo is None or memo[0] != key:
            kind = plan.kind if cache_problem(kv_cache, plan.kind) is None else POINTER
            memo = self._cache_memo = (key, kind, layer_args(kind, kv_cache, self.spec, block_n))
        if memo[1] != plan.kind:
            assert plan.fallback is not None  # only a POINTER plan has none
            plan = plan.fallback()
        return plan, memo[2]


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
