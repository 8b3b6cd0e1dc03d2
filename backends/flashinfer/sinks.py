"""FlashInfer's attention-sink kernel variant, compiled under a name that names its shape.

FlashInfer (0.7.2) builds ``BatchAttentionWithAttentionSinkWrapper``'s module under the
name ``batch_prefill_attention_sink_<q dtype>_swa_<bool>_<fa2|fa3>``: the head sizes
and the KV dtype are compiled into it but left out of the name. FlashInfer finds a
compiled module by its name (its JIT cache and its ahead-of-time builds are folders of
that name; in a process, ``get_batch_prefill_jit_module`` registers its ops by name), so
a layer of another head size can be handed the module built for the first one. On an
H100, with modules built by earlier runs, a head-64 layer given a head-128 module read
past its page table (NaN from unreferenced blocks), and a head-128 layer given a
head-64 module returned finite wrong values for nearly every element
(docs/results/flashinfer-sink-module-names-h100-thirtyseventh.txt).

So the variant is built here through the wrapper FlashInfer's sink class derives from
(``BatchPrefillWithPagedKVCacheWrapper`` with ``jit_args``, FlashInfer's interface for
custom attention variants), with FlashInfer's own variant source and the same compile
options, under a name that holds every parameter the module is compiled for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from pagedkv.spec import AttentionSpec

# FlashInfer's short dtype names (flashinfer.jit.utils.filename_safe_dtype_map), for
# the dtypes a sink layer can have (model-dtype caches only: see backend.validate_extra)
_DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
_NAME = re.compile(
    r"pagedkv_attention_sink_q_(?P<q>\w+?)_kv_(?P<kv>\w+?)_head_dim_qk_(?P<qk>\d+)"
    r"_head_dim_vo_(?P<vo>\d+)_swa_(?P<swa>True|False)_(?P<backend>fa2|fa3)"
)


@dataclass(frozen=True)
class SinkModule:
    """One compiled AttentionSink variant: every parameter it is compiled for."""

    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    head_dim_qk: int
    head_dim_vo: int
    use_sliding_window: bool
    backend: str  # FlashInfer's kernel family: "fa2" or "fa3" ("auto" resolved)

    @property
    def name(self) -> str:
        return (
            f"pagedkv_attention_sink_q_{_DTYPE_NAMES[self.q_dtype]}"
            f"_kv_{_DTYPE_NAMES[self.kv_dtype]}_head_dim_qk_{self.head_dim_qk}"
            f"_head_dim_vo_{self.head_dim_vo}_swa_{self.use_sliding_window}_{self.backend}"
        )

    @classmethod
    def parse(cls, name: str) -> SinkModule:
        """The module a ``name`` names (benchmarks/flashinfer_aot.py builds by name)."""
        m = _NAME.fullmatch(name)
        if m is None:
            raise ValueError(f"{name!r} is not a pagedkv attention-sink module name")
        dtype_of = {short: dtype for dtype, short in _DTYPE_NAMES.items()}
        return cls(
            dtype_of[m["q"]], dtype_of[m["kv"]], int(m["qk"]), int(m["vo"]),
            m["swa"] == "True", m["backend"],
        )  # fmt: skip

    def jit_args(self, fi: ModuleType) -> tuple[list[Any], dict[str, Any]]:
        """FlashInfer's ``jit_args`` and ``jit_kwargs`` for this module, as its sink
        wrapper passes them, under this module's name."""
        args = [
            self.name,
            self.q_dtype,  # query
            self.kv_dtype,  # K/V
            self.q_dtype,  # output
            torch.int32,  # page indices
            self.head_dim_qk,
            self.head_dim_vo,
            ["sink"],  # the run's extra tensor: one logit per query head
            ["float"],
            ["sm_scale"],  # the extra scalar
            ["double"],
            "AttentionSink",
            fi.jit.attention.variants.attention_sink_decl[self.backend],
        ]
        kwargs = {
            "use_sliding_window": self.use_sliding_window,
            "use_fp16_qk_reduction": False,
            "pos_encoding_mode": 0,  # none
            "paged_kv_stride_mode": "independent" if self.backend == "fa2" else "runtime",
            "module_surface": "full",
        }
        return args, kwargs


def sink_module(
    fi: ModuleType, device: torch.device, spec: AttentionSpec, backend: str
) -> SinkModule:
    """The module a sink layer of ``spec`` runs; ``backend="auto"`` picks the kernel
    family as FlashInfer's sink wrapper does (fa3 where the GPU and the shape allow it)."""
    if backend == "auto":
        backend = fi.utils.determine_attention_backend(
            device, 0, False, False, spec.dtype, spec.cache_dtype,
            head_dim_qk=spec.head_size, head_dim_vo=spec.head_size_v,
        )  # fmt: skip
    return SinkModule(
        spec.dtype, spec.cache_dtype, spec.head_size, spec.head_size_v,
        spec.sliding_window is not None, backend,
    )  # fmt: skip


def sink_wrapper(
    fi: ModuleType,
    workspace: torch.Tensor,
    kv_layout: str,
    module: SinkModule,
    **graph_buffers: Any,
) -> Any:
    """A paged prefill wrapper that runs ``module`` (``run(q, kv, sinks)``)."""
    jit_args, jit_kwargs = module.jit_args(fi)
    return fi.BatchPrefillWithPagedKVCacheWrapper(
        workspace,
        kv_layout,
        backend=module.backend,
        jit_args=jit_args,
        jit_kwargs=jit_kwargs,
        **graph_buffers,
    )
