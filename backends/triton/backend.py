"""The Triton backend's layout, declared capabilities and where it can run."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, ClassVar

import torch
from pagedkv.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, BackendOption
from pagedkv.backends.triton.configs import SPLIT_POLICY
from pagedkv.capabilities import Capabilities, MultipleOf
from pagedkv.features import Feature
from pagedkv.spec import AttentionSpec

_KERNEL_MODULE = "pagedkv.backends.triton.attention_kernel"


def interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter. Decided when the kernel module
    is first imported (TRITON_INTERPRET=1 then); until then, by the environment."""
    module = sys.modules.get(_KERNEL_MODULE)
    if module is not None:
        return type(module.unified_attention_kernel).__name__ == "InterpretedFunction"
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonBackend(AttentionBackend):
    """Our own Triton kernels: one unified paged-attention kernel for mixed batches,
    split-KV decode with a reduction kernel, and the shared Triton KV write."""

    name = "triton"
    priority = 40
    layout = "(2, num_blocks, block_size, num_kv_heads, head_size)"
    block_axis = 1
    capabilities = Capabilities(
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3", "fp8_e5m2"}),
        head_sizes=(MultipleOf(8, minimum=32, maximum=256),),
        block_sizes=(MultipleOf(16),),
        features=frozenset(
            {
                Feature.SLIDING_WINDOW,
                Feature.LOGITS_SOFT_CAP,
                Feature.ALIBI,
                Feature.SINKS,
                Feature.NON_CAUSAL,
                Feature.FP8_KV,
                Feature.CUDA_GRAPH,
            }
        ),
        devices=frozenset({"cuda", "cpu"}),
        notes=(
            "cpu: only in Triton's interpreter (TRITON_INTERPRET=1), float16/float32",
            "cuda_graph: builder.reserve_cuda_graph(...) before capture",
        ),
    )
    option_specs: ClassVar[dict[str, BackendOption]] = {
        "num_splits": BackendOption(
            default=None,
            help="KV splits per sequence (flash-decoding); unset or 0 chooses per batch, 1 never splits",
            kind=int,
            minimum=0,
            maximum=SPLIT_POLICY.max_splits,
        ),
    }

    def get_kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def kv_cache_to_logical(
        self, kv_cache: torch.Tensor, spec: AttentionSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache[0], kv_cache[1]

    def missing_dependency(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'pagedkv[triton]')"
        return None

    def is_available(self) -> tuple[bool, str]:
        missing = self.missing_dependency()
        if missing:
            return False, missing
        if not torch.cuda.is_available() and not interpreting():
            return False, (
                "no CUDA device (torch.cuda.is_available() is False); set TRITON_INTERPRET=1 "
                "to run the kernels in Triton's interpreter"
            )
        return True, ""

    def validate(self, spec: AttentionSpec, device: torch.device | str | None = None) -> list[str]:
        reasons = super().validate(spec, device)
        if device is not None and torch.device(device).type == "cpu":
            if not interpreting():
                reasons.append(
                    "device cpu needs Triton's interpreter: set TRITON_INTERPRET=1 before the "
                    "kernels are first imported"
                )
            if spec.dtype == torch.bfloat16 or spec.cache_dtype == torch.bfloat16:
                reasons.append(
                    "bfloat16 on cpu: Triton's interpreter computes bfloat16 wrongly "
                    "(triton-lang/triton#11584); run bfloat16 on a GPU"
                )
        return reasons

    def get_builder_cls(self) -> type[AttentionMetadataBuilder[Any]]:
        from pagedkv.backends.triton.builder import TritonMetadataBuilder

        return TritonMetadataBuilder

    def get_impl_cls(self) -> type[AttentionImpl[Any]]:
        from pagedkv.backends.triton.impl import TritonAttentionImpl

        return TritonAttentionImpl
