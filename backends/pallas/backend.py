"""The Pallas backend's layout, declared capabilities and availability checks."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

import torch
from pagedkv.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from pagedkv.backends.pallas import configs
from pagedkv.capabilities import Capabilities, MultipleOf
from pagedkv.errors import ConfigError
from pagedkv.features import Feature
from pagedkv.graph import GraphSupport
from pagedkv.layout import INTERLEAVED_HEADS
from pagedkv.options import BackendOption
from pagedkv.spec import AttentionSpec

# Register pressure of one tile (block_m x head_pad fp32 accumulator) bounds the head size.
MAX_HEAD_SIZE = 256


class PallasBackend(AttentionBackend):
    """A JAX Pallas kernel over the torch-owned cache.

    CPU tensors run in Pallas interpret mode through JAX (slow: for tests and CI).
    CUDA tensors run the kernel's Pallas Triton lowering: by default launched from
    torch (option ``launcher``: "direct", module ``direct``: the module JAX's lowering
    makes, compiled by Triton, on torch's stream, capturable in CUDA graphs), or
    through JAX's runtime ("jax": DLPack views of the torch tensors, no copy, on JAX's
    stream: no CUDA graphs).
    """

    name = "pallas"
    priority = 5  # below torch: interpret mode on CPU is slower than plain torch
    # (num_blocks, block_size, 2 * num_kv_heads, head_size): K of KV head h at index
    # 2h, V at 2h + 1 (the ragged-paged-attention convention)
    kv_layout = INTERLEAVED_HEADS
    capabilities = Capabilities(
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3", "fp8_e5m2"}),
        head_sizes=(MultipleOf(1, maximum=MAX_HEAD_SIZE),),
        block_sizes=(MultipleOf(1),),
        features=frozenset(
            {
                Feature.SLIDING_WINDOW,
                Feature.LOGITS_SOFT_CAP,
                Feature.ALIBI,
                Feature.SINKS,
                Feature.NON_CAUSAL,
                Feature.FP8_KV,
            }
        ),
        devices=frozenset({"cpu", "cuda"}),
        # the direct launcher's (the default on CUDA); launcher=jax: never
        cuda_graph=GraphSupport.MIXED,
        notes=(
            "CUDA graphs with the direct launcher (the default on CUDA); launcher=jax runs "
            "on JAX's stream, outside torch's capture",
            "head sizes are padded to a power of two (>= 16) inside the kernel",
        ),
    )
    option_specs: ClassVar[Mapping[str, BackendOption]] = {
        "block_m": BackendOption(
            0,
            "Query rows (tokens x grouped heads) per tile, a power of two; 0: auto",
            kind=int,
            minimum=0,
        ),
        "block_n": BackendOption(
            0,
            "Keys per inner-loop step, a power of two; 0: auto (64, 32 past head 128)",
            kind=int,
            minimum=0,
        ),
        "num_splits": BackendOption(
            0,
            f"KV splits of the longest query tile (flash-decoding; shorter tiles take "
            f"fewer ranges of the same keys), at most {configs.SPLIT_POLICY.max_splits}; "
            "0: chosen per step",
            kind=int,
            minimum=0,
            maximum=configs.SPLIT_POLICY.max_splits,
        ),
        "launcher": BackendOption(
            "auto",
            "Who launches the kernel on CUDA: direct (Triton's launcher on torch's stream, "
            "CUDA graphs), jax (JAX's runtime, on its stream), auto (direct where this JAX's "
            "lowering can be caught)",
            choices=("auto", "direct", "jax"),
        ),
        "num_warps": BackendOption(
            0,
            "Triton warps per program (GPU); 0: by the tile (configs.num_warps)",
            kind=int,
            minimum=0,
        ),
        "num_stages": BackendOption(
            configs.NUM_STAGES, "Triton pipeline stages (GPU)", kind=int, minimum=1
        ),
    }

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        # tl.dot needs every tile dimension >= 16; tiles are powers of two
        for key in ("block_m", "block_n"):
            value = int(self.options[key])
            if value and (value < 16 or value & (value - 1)):
                raise ConfigError(f"option {key}={value}: expected a power of two >= 16")
        if self.options["launcher"] == "jax" or (
            self.options["launcher"] == "auto" and _direct_unavailable()
        ):
            self.capabilities = replace(
                type(self).capabilities,
                cuda_graph=GraphSupport.NEVER,
                notes=("no CUDA graphs: the kernel runs on JAX's stream, outside torch's capture",),
            )

    # -- parts ------------------------------------------------------------------------

    def get_builder_cls(self) -> type[AttentionMetadataBuilder[Any]]:
        from pagedkv.backends.pallas.builder import PallasMetadataBuilder

        return PallasMetadataBuilder

    def get_impl_cls(self) -> type[AttentionImpl[Any]]:
        from pagedkv.backends.pallas.impl import PallasAttentionImpl

        return PallasAttentionImpl

    # -- support ----------------------------------------------------------------------

    def missing_dependency(self) -> str | None:
        return jax_missing()

    def validate(self, spec: AttentionSpec, device: torch.device | str | None = None) -> list[str]:
        reasons = super().validate(spec, device)
        if device is not None and torch.device(device).type == "cuda" and not reasons:
            why = jax_gpu_unavailable()
            if why:
                reasons.append(why)
        return reasons


def _direct_unavailable() -> str | None:
    """Why the direct launcher cannot run here (JAX missing, or its lowering cannot be
    caught), or None."""
    missing = jax_missing()
    if missing:
        return missing
    from pagedkv.backends.pallas.direct import capture_unavailable

    return capture_unavailable()


@functools.cache
def jax_missing() -> str | None:
    """Why JAX Pallas cannot be imported here, or None."""
    if importlib.util.find_spec("jax") is None:
        return "jax is not installed (pip install 'pagedkv[jax]')"
    try:
        from jax.experimental import pallas  # noqa: F401
        from pagedkv.backends.pallas import interop  # noqa: F401
    except ImportError as exc:
        return f"jax.experimental.pallas cannot be imported ({exc})"
    return None


@functools.cache
def jax_gpu_unavailable() -> str | None:
    """Why JAX cannot run this backend on CUDA tensors here, or None."""
    missing = jax_missing()
    if missing:
        return missing
    from pagedkv.backends.pallas import interop

    try:
        import jax
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError as exc:
        return f"jax {interop.jax_version()} has no Pallas Triton lowering ({exc})"
    interop.configure_jax()  # jax.devices starts JAX's GPU client
    try:
        jax.devices("gpu")
    except RuntimeError:
        return (
            "no JAX GPU backend for CUDA tensors (install jax[cuda12] or jax[cuda13]; "
            f"jax {jax.__version__} sees only {sorted({d.platform for d in jax.devices()})})"
        )
    return None
