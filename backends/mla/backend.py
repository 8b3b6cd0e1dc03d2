"""The MLA backend's layout, options and declared capabilities."""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar

import torch
from pagedkv.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, BackendOption
from pagedkv.backends.mla.configs import SPLIT_POLICY
from pagedkv.capabilities import Capabilities, MultipleOf
from pagedkv.features import Feature
from pagedkv.graph import GraphSupport
from pagedkv.layout import LATENT
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.interpreter import interpreting

# The [BLOCK_M, kv_lora_rank] float32 accumulator lives in registers, the rope part
# of the query and the latent tiles in shared memory: these bound the padded widths.
MAX_LORA_RANK = 512
MAX_ROPE_DIM = 128


def _pow2(low: int, high: int) -> tuple[int, ...]:
    return tuple(1 << i for i in range(low.bit_length() - 1, high.bit_length()))


class MLABackend(AttentionBackend):
    """DeepSeek-style multi-head latent attention over a latent cache, in Triton.

    One latent row per token, ``concat(kv_c, k_pe)``, no KV-head axis. The query is
    the absorbed one; the output is the latent-space value (the caller applies W_UV).
    On a CPU it runs under the Triton interpreter (``TRITON_INTERPRET=1``).
    """

    name = "mla"
    priority = 50
    kv_layout = LATENT
    option_specs: ClassVar[dict[str, BackendOption]] = {
        "num_splits": BackendOption(
            None,
            "split-KV programs per tile (default: fill the GPU, see configs.py); a step "
            "whose partial outputs would pass configs.MAX_FORCED_PARTIAL_BYTES splits less",
            kind=int,
            minimum=1,
            maximum=SPLIT_POLICY.max_splits,
        ),
        "block_m": BackendOption(
            None, "query rows (token x head) per program", _pow2(16, 128), kind=int
        ),
        "block_n": BackendOption(None, "latent rows per loop iteration", _pow2(16, 128), kind=int),
        "num_warps": BackendOption(None, "warps per program", (4, 8, 16), kind=int),
        "num_stages": BackendOption(
            None, "pipelining depth of the latent loads", (1, 2, 3, 4), kind=int
        ),
        "lazy_rescale": BackendOption(
            None, "rescale the accumulator only when a row max grows by > 2**8", kind=bool
        ),
        "use_tma": BackendOption(None, "TMA latent loads where the layout allows", kind=bool),
        "use_gluon": BackendOption(
            None, "the Gluon wgmma kernel on sm_90 where it applies (docs/mla.md)", kind=bool
        ),
    }
    capabilities = Capabilities(
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3", "fp8_e5m2"}),
        head_sizes=(MultipleOf(1, maximum=MAX_LORA_RANK + MAX_ROPE_DIM),),
        block_sizes=(MultipleOf(16),),
        features=frozenset({Feature.MLA, Feature.FP8_KV, Feature.NON_CAUSAL}),
        devices=frozenset({"cpu", "cuda"}),
        # any step within the reserved bounds: tiles, splits and buffers come from the
        # bounds, padding tiles and rows are skipped by the kernels (docs/mla.md)
        cuda_graph=GraphSupport.MIXED,
        notes=(
            "cpu: only under the Triton interpreter (TRITON_INTERPRET=1), float16/float32",
            "fp8: the whole latent is stored / k_scale (V is a view of it; v_scale is unused)",
            f"kv_lora_rank <= {MAX_LORA_RANK}, qk_rope_head_dim <= {MAX_ROPE_DIM}",
        ),
    )

    # -- parts ------------------------------------------------------------------------

    def get_builder_cls(self) -> type[AttentionMetadataBuilder[Any]]:
        from pagedkv.backends.mla.builder import MLAMetadataBuilder

        return MLAMetadataBuilder

    def get_impl_cls(self) -> type[AttentionImpl[Any]]:
        from pagedkv.backends.mla.impl import MLAAttentionImpl

        return MLAAttentionImpl

    # -- support ----------------------------------------------------------------------

    def missing_dependency(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'pagedkv[triton]')"
        return None

    def is_available(self) -> tuple[bool, str]:
        missing = self.missing_dependency()
        if missing:
            return False, missing
        if not torch.cuda.is_available() and not interpreting():
            return False, "no CUDA device, and TRITON_INTERPRET=1 is not set for a CPU run"
        return True, ""

    def validate(self, spec: AttentionSpec, device: torch.device | str | None = None) -> list[str]:
        reasons = super().validate(spec, device)
        on_cpu = device is not None and torch.device(device).type == "cpu"
        if on_cpu and spec.dtype == torch.bfloat16:
            reasons.append(
                "bfloat16 is not supported by mla on a CPU: the Triton interpreter "
                "computes bf16 on raw bits (triton-lang/triton#11584)"
            )
        return reasons

    def validate_extra(self, spec: AttentionSpec) -> list[str]:
        if not spec.is_mla:
            return []
        out = []
        if spec.kv_lora_rank > MAX_LORA_RANK:
            out.append(
                f"kv_lora_rank {spec.kv_lora_rank} not supported by mla (at most {MAX_LORA_RANK}: "
                "the latent accumulator lives in registers)"
            )
        if spec.qk_rope_head_dim > MAX_ROPE_DIM:
            out.append(
                f"qk_rope_head_dim {spec.qk_rope_head_dim} not supported by mla "
                f"(at most {MAX_ROPE_DIM})"
            )
        return out
