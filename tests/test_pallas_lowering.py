"""Every Pallas kernel variant lowers for the GPU (Triton) without a GPU; the TPU
status is pinned so that a change in it is noticed (docs/pallas.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from pagedkv.backends.pallas.lowering import (
    TRITON_CUSTOM_CALL,
    VARIANTS,
    export_kernel,
)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lowers_for_gpu_triton(variant):
    cfg, dtype, cache_dtype = VARIANTS[variant]
    exported = export_kernel(cfg, "cuda", dtype, cache_dtype)
    assert exported.platforms == ("cuda",)
    assert TRITON_CUSTOM_CALL in exported.mlir_module()


def test_tpu_lowering_stops_at_the_gathers_from_the_whole_cache():
    """Mosaic reads ANY-space refs only through DMA; this kernel gathers rows from the
    cache in place (what makes it fast in interpret mode and on Triton)."""
    cfg, dtype, cache_dtype = VARIANTS["causal-bf16"]
    with pytest.raises(ValueError, match="ANY memory space can only be accessed using async_copy"):
        export_kernel(cfg, "tpu", dtype, cache_dtype)


def test_gpu_smoke_harness_runs_in_interpret_mode():
    """The GPU smoke command's problem and reference agree where it can run here."""
    from pagedkv.backends.pallas.lowering import smoke

    assert smoke("interpret").startswith("interpret: WORKS")
