"""The FlashInfer backend's declaration: layouts, options and capabilities."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from pagedkv.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    BackendOption,
    OptionValue,
)
from pagedkv.capabilities import Capabilities, MultipleOf
from pagedkv.features import Feature
from pagedkv.graph import GraphSupport
from pagedkv.layout import BLOCK_HND, BLOCK_NHD
from pagedkv.spec import AttentionSpec

KV_LAYOUTS = {"NHD": BLOCK_NHD, "HND": BLOCK_HND}


class FlashInferBackend(AttentionBackend):
    """FlashInfer's batch decode and batch prefill wrappers over one paged cache.

    Per step the builder converts the block table to FlashInfer's CSR page lists and
    runs ``plan()``; per layer ``attend`` only calls ``run()``: single-token rows go
    through ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores), multi-token rows
    through ``BatchPrefillWithPagedKVCacheWrapper``. Layers with sinks run every row
    through FlashInfer's AttentionSink variant (``sinks.py``: built under a name that
    names its head sizes), because the plain wrappers' fa2/fa3 kernels (everything
    below SM100) drop ``run(sinks=...)`` without a word.
    After ``reserve_cuda_graph`` pure-decode steps plan on fixed-buffer wrappers.
    """

    name = "flashinfer"
    priority = 45
    kv_layout = BLOCK_NHD
    option_specs: ClassVar[Mapping[str, BackendOption]] = {
        "kv_layout": BackendOption(
            "NHD",
            "physical order inside a block: NHD (block_size, heads) or HND (heads, block_size)",
            choices=("NHD", "HND"),
        ),
        "prefill_backend": BackendOption(
            "auto",
            "FlashInfer kernel family for multi-token rows (auto: fa3 on SM90 where it can)",
            choices=("auto", "fa2", "fa3"),
        ),
    }
    capabilities = Capabilities(
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3", "fp8_e5m2"}),
        head_sizes=(64, 128, 256),
        block_sizes=(MultipleOf(1),),
        features=frozenset(
            {
                Feature.SLIDING_WINDOW,
                Feature.LOGITS_SOFT_CAP,
                Feature.SINKS,
                Feature.NON_CAUSAL,
                Feature.FP8_KV,
            }
        ),
        devices=frozenset({"cuda"}),
        # mixed steps would need the prefill wrapper's graph mode, whose plan fixes the
        # batch size and total rows at the first plan; not wired (docs/flashinfer.md)
        cuda_graph=GraphSupport.PURE_DECODE,
        notes=(
            "CUDA graphs: pure-decode steps after builder.reserve_cuda_graph(...)",
            "ALiBi: FlashInfer applies its own slopes, not the layer's; not wired",
        ),
    )

    def __init__(self, **options: OptionValue) -> None:
        super().__init__(**options)
        # the layout is a property of the configured instance, not of the class
        self.kv_layout = KV_LAYOUTS[str(self.options["kv_layout"])]

    # -- parts ------------------------------------------------------------------------

    def get_builder_cls(self) -> type[AttentionMetadataBuilder[Any]]:
        from pagedkv.backends.flashinfer.builder import FlashInferMetadataBuilder

        return FlashInferMetadataBuilder

    def get_impl_cls(self) -> type[AttentionImpl[Any]]:
        from pagedkv.backends.flashinfer.impl import FlashInferImpl

        return FlashInferImpl

    # -- support ----------------------------------------------------------------------

    def missing_dependency(self) -> str | None:
        if importlib.util.find_spec("flashinfer") is None:
            return "flashinfer-python is not installed (pip install 'pagedkv[flashinfer]')"
        try:
            importlib.import_module("flashinfer")
        except Exception as exc:  # a broken install must not hide the others
            return f"flashinfer-python is installed but `import flashinfer` failed: {type(exc).__name__}: {exc}"
        return None

    def is_available(self) -> tuple[bool, str]:
        available, why = super().is_available()
        if not available:
            return available, why
        toolchain = jit_toolchain_problem()
        if toolchain:
            return False, toolchain
        return True, ""

    def validate_extra(self, spec: AttentionSpec) -> list[str]:
        out = []
        if not spec.causal and spec.sliding_window is not None:
            out.append(
                "non-causal sliding window is not supported by flashinfer: its window_left "
                "bounds keys on the left only, the contract's non-causal window is two-sided"
            )
        if spec.use_sinks and spec.logits_soft_cap is not None:
            out.append(
                "sinks with logits_soft_cap are not supported by flashinfer: its AttentionSink "
                "kernel variant (the only sink path below SM100) has no soft cap"
            )
        if spec.use_sinks and spec.is_fp8_kv:
            out.append(
                "sinks with an fp8 KV cache are not supported by flashinfer here: the "
                "AttentionSink variant is wired for model-dtype caches only"
            )
        if spec.is_fp8_kv and self.options["prefill_backend"] == "fa3":
            out.append(
                "prefill_backend=fa3 with an fp8 KV cache is not supported by flashinfer: its "
                "fa3 kernels read fp8 K/V only with fp8 queries (use prefill_backend=auto or fa2)"
            )
        return out


def jit_toolchain_problem() -> str | None:
    """Why FlashInfer could not build kernels here, or None.

    FlashInfer ships sources and compiles each kernel variant with nvcc on first use
    (unless flashinfer-jit-cache provides them); it looks for nvcc the way this does.
    """
    if importlib.util.find_spec("flashinfer_jit_cache") is not None:
        return None
    nvcc = os.environ.get("FLASHINFER_NVCC")
    if not nvcc:
        cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        if not cuda_home:
            found = shutil.which("nvcc")
            cuda_home = os.path.dirname(os.path.dirname(found)) if found else "/usr/local/cuda"
        nvcc = os.path.join(cuda_home, "bin", "nvcc")
    if os.path.exists(nvcc):
        return None
    return (
        f"FlashInfer compiles its kernels with nvcc on first use and {nvcc} does not exist "
        "(set CUDA_HOME or FLASHINFER_NVCC, or install flashinfer-jit-cache)"
    )
