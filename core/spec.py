"""AttentionSpec: everything a backend needs to know about one attention layer."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch
from pagedkv.errors import SpecError
from pagedkv.features import Feature
from pagedkv.intmath import is_int

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,  # the cache stores the model dtype
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer: head geometry, dtypes, block size and the score modifiers.

    A standard layer stores K and V per KV head. An MLA layer (``kv_lora_rank`` set)
    stores one latent row per token: ``head_size = kv_lora_rank + qk_rope_head_dim``
    (K is the whole row), ``head_size_v = kv_lora_rank`` (V is its prefix), and a
    single KV "head" shared by every query head.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int
    head_size_v: int | None = None  # None: same as head_size (MLA: kv_lora_rank)
    scale: float | None = None  # None: head_size ** -0.5 (required for MLA)
    kv_cache_dtype: str = "auto"
    # fp8 caches store value / scale; readers multiply back. Per layer, calibrated.
    k_scale: float = 1.0
    v_scale: float = 1.0
    # A query at position p sees keys k with p - k < sliding_window (and k - p <
    # sliding_window when non-causal). None: unlimited.
    sliding_window: int | None = None
    # scores become cap * tanh(score / cap) before masking. None: off.
    logits_soft_cap: float | None = None
    # per query head; bias = slope * (key_pos - query_pos), added after softcap.
    alibi_slopes: tuple[float, ...] | None = None
    # one learned logit per query head joins each softmax denominator (no value).
    use_sinks: bool = False
    causal: bool = True
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:  # numpy ints and the like become Python ints
            value = getattr(self, name)
            if is_int(value) and type(value) is not int:
                object.__setattr__(self, name, int(value))
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self._default_head_size_v())
        slopes = None if self.alibi_slopes is None else _as_floats(self.alibi_slopes)
        if slopes is not None:
            object.__setattr__(self, "alibi_slopes", slopes)
        problems = self.problems()
        if problems:
            raise SpecError("invalid AttentionSpec: " + "; ".join(problems))
        if self.scale is None:
            object.__setattr__(self, "scale", self.head_size**-0.5)

    def _default_head_size_v(self) -> int | None:
        if self.kv_lora_rank is not None:
            return self.kv_lora_rank
        return self.head_size

    def problems(self) -> list[str]:
        """Every inconsistency in this spec, one sentence each (empty: valid)."""
        out = _type_problems(self)
        if out:
            return out  # the checks below compare values of the right types
        if self.num_heads % self.num_kv_heads:
            out.append(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            out.append(f"dtype must be one of float32/float16/bfloat16, got {self.dtype}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            out.append(
                f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r}"
            )
        if self.alibi_slopes is not None and len(self.alibi_slopes) != self.num_heads:
            out.append(
                f"alibi_slopes must have one slope per query head ({self.num_heads}), got "
                f"{len(self.alibi_slopes)}"
            )
        out.extend(self._mla_problems())
        return out

    def _mla_problems(self) -> list[str]:
        lora, rope = self.kv_lora_rank, self.qk_rope_head_dim
        if lora is None and rope is None:
            return []
        if lora is None or rope is None:
            return ["MLA needs both kv_lora_rank and qk_rope_head_dim"]
        out = []
        if self.head_size != lora + rope:
            out.append(
                f"MLA head_size must be kv_lora_rank + qk_rope_head_dim = {lora + rope}, "
                f"got {self.head_size}"
            )
        if self.head_size_v != lora:
            out.append(f"MLA head_size_v must be kv_lora_rank = {lora}, got {self.head_size_v}")
        if self.num_kv_heads != 1:
            out.append(
                f"MLA stores one latent per token: num_kv_heads must be 1, got {self.num_kv_heads}"
            )
        if self.scale is None:
            out.append(
                "MLA needs an explicit scale (the model's qk head dim ** -0.5, times the yarn "
                "mscale**2 when used); it is never derived from the latent width"
            )
        return out

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def cache_dtype(self) -> torch.dtype:
        """The element type stored in the KV cache."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype

    @property
    def is_fp8_kv(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def required_features(self) -> frozenset[Feature]:
        """Features a backend must declare to run this layer."""
        need = set()
        if self.sliding_window is not None:
            need.add(Feature.SLIDING_WINDOW)
        if self.logits_soft_cap is not None:
            need.add(Feature.LOGITS_SOFT_CAP)
        if self.alibi_slopes is not None:
            need.add(Feature.ALIBI)
        if self.use_sinks:
            need.add(Feature.SINKS)
        if not self.causal:
            need.add(Feature.NON_CAUSAL)
        if self.is_fp8_kv:
            need.add(Feature.FP8_KV)
        if self.is_mla:
            need.add(Feature.MLA)
        return frozenset(need)

    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token costs in this layer (K and V, or the MLA latent)."""
        itemsize = self.cache_dtype.itemsize
        if self.is_mla:
            return self.head_size * itemsize
        return self.num_kv_heads * (self.head_size + self.head_size_v) * itemsize

    def replace(self, **changes: object) -> AttentionSpec:
        """A copy with some fields changed (the scale is re-derived unless given)."""
        if "scale" not in changes and "head_size" in changes and not self.is_mla:
            changes["scale"] = None
        if "head_size_v" not in changes and ("head_size" in changes or "kv_lora_rank" in changes):
            changes["head_size_v"] = None
        return dataclasses.replace(self, **changes)


# The fields' types, checked before anything else: a bool is not an int (True would be
# a window of 1), a float is not an int (16.0 would flow into shapes), and a float
# field is finite where infinity means nothing (an infinite soft cap or slope turns
# every output into NaN).
_POSITIVE_INT_FIELDS = ("num_heads", "num_kv_heads", "head_size", "block_size")
_OPTIONAL_POSITIVE_INT_FIELDS = ("head_size_v", "sliding_window", "kv_lora_rank")
_INT_FIELDS = (*_POSITIVE_INT_FIELDS, *_OPTIONAL_POSITIVE_INT_FIELDS, "qk_rope_head_dim")
_OPTIONAL_POSITIVE_FLOAT_FIELDS = ("scale", "logits_soft_cap")
_POSITIVE_FLOAT_FIELDS = ("k_scale", "v_scale")
_BOOL_FIELDS = ("use_sinks", "causal")


def _type_problems(spec: AttentionSpec) -> list[str]:
    out = []
    for name in (*_POSITIVE_INT_FIELDS, *_OPTIONAL_POSITIVE_INT_FIELDS):
        value = getattr(spec, name)
        optional = name in _OPTIONAL_POSITIVE_INT_FIELDS
        if (value is None and optional) or (is_int(value) and value > 0):
            continue
        out.append(f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}")
    rope = spec.qk_rope_head_dim
    if not (rope is None or (is_int(rope) and rope >= 0)):
        out.append(f"qk_rope_head_dim must be an int >= 0 or None, got {rope!r}")
    for name in (*_POSITIVE_FLOAT_FIELDS, *_OPTIONAL_POSITIVE_FLOAT_FIELDS):
        value = getattr(spec, name)
        optional = name in _OPTIONAL_POSITIVE_FLOAT_FIELDS
        if (value is None and optional) or (_is_real(value) and math.isfinite(value) and value > 0):
            continue
        out.append(
            f"{name} must be a finite positive number{' or None' if optional else ''}, got "
            f"{value!r}"
        )
    slopes = spec.alibi_slopes
    if slopes is not None and not (
        isinstance(slopes, tuple) and all(_is_real(s) and math.isfinite(s) for s in slopes)
    ):
        out.append(
            f"alibi_slopes must be finite numbers (one per query head) or None, got {slopes!r}"
        )
    for name in _BOOL_FIELDS:
        value = getattr(spec, name)
        if not isinstance(value, bool):
            out.append(f"{name} must be a bool, got {value!r}")
    if not isinstance(spec.dtype, torch.dtype):
        out.append(f"dtype must be a torch.dtype, got {spec.dtype!r}")
    if not isinstance(spec.kv_cache_dtype, str):
        out.append(f"kv_cache_dtype must be a str, got {spec.kv_cache_dtype!r}")
    return out


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_floats(values: object) -> tuple[float, ...] | None:
    """``values`` (a list, tuple, array or tensor of numbers) as a tuple of floats; None
    when it is not one (a bool or a str is not a number)."""
    if isinstance(values, str | bytes) or not hasattr(values, "__iter__"):
        return None
    out = []
    for value in values:  # type: ignore[attr-defined]
        if isinstance(value, bool | str | bytes):
            return None
        try:
            out.append(float(value))
        except (TypeError, ValueError):
            return None
    return tuple(out)


def alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """The standard ALiBi slopes (Press et al.), for any head count."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(num_heads - closest)]
    return tuple(slopes)
