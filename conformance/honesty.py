"""Honesty of declared capabilities: what a backend declares it runs, it accepts;
what it does not declare, ``validate`` rejects with a reason and ``select_backend``
refuses.

Each check turns one feature (or dtype, or KV-cache dtype) on in the backend's base
layer. Declarations hold for every device the backend declares, so the checks call
``validate(spec)`` and ``select_backend`` without a device: a limit of one device
(e.g. bfloat16 under Triton's CPU interpreter) shows as "not applicable" scenarios
instead. ``Feature.CUDA_GRAPH`` is not a property of a layer, so it is not checked.
"""

from __future__ import annotations

from collections.abc import Iterator

from pagedkv.backend import AttentionBackend
from pagedkv.errors import NoUsableBackendError, PagedKVError
from pagedkv.features import Feature
from pagedkv.selection import select_backend
from pagedkv.spec import KV_CACHE_DTYPES, SUPPORTED_DTYPES, AttentionSpec, alibi_slopes


def capability_problems(backend: AttentionBackend, config: str, base: AttentionSpec) -> list[str]:
    """Every dishonest declaration of ``backend`` (selected by ``config``), one line each.

    ``base`` is a layer the backend accepts; each probe changes one thing in it.
    """
    caps = backend.capabilities
    problems: list[str] = []
    for what, spec, declared in _probes(backend, base):
        reasons = backend.validate(spec)
        if declared and reasons:
            problems.append(
                f"{what} is declared, but validate() rejects a layer using it: {'; '.join(reasons)}"
            )
        elif not declared and not reasons:
            problems.append(
                f"{what} is not declared, but validate() accepts a layer using it (it must "
                "return a reason)"
            )
        problems += _selection_problems(backend, config, what, spec, declared)
    fp8 = sorted(k for k in caps.kv_cache_dtypes if k != "auto")
    if fp8 and Feature.FP8_KV not in caps.features:
        problems.append(
            f"kv_cache_dtypes declares {', '.join(fp8)} but features lack Feature.FP8_KV"
        )
    if Feature.FP8_KV in caps.features and not fp8:
        problems.append("Feature.FP8_KV is declared but kv_cache_dtypes holds no fp8 dtype")
    return problems


def _selection_problems(
    backend: AttentionBackend, config: str, what: str, spec: AttentionSpec, declared: bool
) -> list[str]:
    """select_backend(config, spec) returns the backend iff it declares ``what``."""
    try:
        chosen = select_backend(config, spec)
    except NoUsableBackendError as exc:
        if declared:
            reasons = "; ".join(r for why in exc.reasons.values() for r in why)
            return [f"{what} is declared, but select_backend({config!r}) refuses: {reasons}"]
        return []
    except PagedKVError as exc:
        return [f"{what}: select_backend({config!r}) raised {type(exc).__name__}: {exc}"]
    if not declared:
        return [f"{what} is not declared, but select_backend({config!r}) returned {chosen!r}"]
    if chosen.name != backend.name:
        return [f"{what}: select_backend({config!r}) returned {chosen.name}, not {backend.name}"]
    return []


def _probes(
    backend: AttentionBackend, base: AttentionSpec
) -> Iterator[tuple[str, AttentionSpec, bool]]:
    """(what, a layer using it, whether the backend declares it)."""
    caps = backend.capabilities
    features = caps.features
    for dtype in SUPPORTED_DTYPES:
        yield (
            f"dtype {str(dtype).removeprefix('torch.')}",
            base.replace(dtype=dtype),
            (dtype in caps.dtypes),
        )
    for kv_dtype in KV_CACHE_DTYPES:
        declared = kv_dtype in caps.kv_cache_dtypes and (
            kv_dtype == "auto" or Feature.FP8_KV in features
        )
        spec = base.replace(kv_cache_dtype=kv_dtype, k_scale=0.5, v_scale=2.0)
        yield f"kv_cache_dtype {kv_dtype}", spec, declared
    if base.is_mla:
        standard = AttentionSpec(
            num_heads=base.num_heads,
            num_kv_heads=1,
            head_size=base.head_size,
            dtype=base.dtype,
            block_size=base.block_size,
        )
        yield "a standard (non-MLA) layer", standard, False
    else:
        mla = base.replace(
            num_kv_heads=1,
            head_size=576,
            scale=192**-0.5,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
        )
        yield f"{Feature.MLA}", mla, Feature.MLA in features
    modifiers = {
        Feature.SLIDING_WINDOW: {"sliding_window": 2 * base.block_size + 1},
        Feature.LOGITS_SOFT_CAP: {"logits_soft_cap": 30.0},
        Feature.ALIBI: {"alibi_slopes": alibi_slopes(base.num_heads)},
        Feature.SINKS: {"use_sinks": True},
        Feature.NON_CAUSAL: {"causal": False},
    }
    for feature, change in modifiers.items():
        yield f"{feature}", base.replace(**change), feature in features
