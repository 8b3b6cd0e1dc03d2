"""Capacity maths: KV bytes per token and per block, what fits a memory budget.

Units are binary throughout (KiB = 1024 B, GiB = 1024^3 B), as in the chapter this
reproduces: its "6 GB" budget is 6 x 1024^3 bytes and its "160 KB" is 160 x 1024.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pagedkv.errors import KVCacheUsageError
from pagedkv.intmath import cdiv
from pagedkv.kv.presets import ModelPreset
from pagedkv.spec import AttentionSpec

KiB = 1024
MiB = 1024**2
GiB = 1024**3

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "int4": 0.5,
}


def dtype_bytes(name: str) -> float:
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise KVCacheUsageError(
            f"unknown dtype {name!r}: expected one of {', '.join(DTYPE_BYTES)}"
        ) from None


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one tensor-parallel rank stores (pagedkv.distributed's rule: an even
    share, or one replicated head when there are more ranks than heads)."""
    from pagedkv.distributed import kv_heads_per_rank as rule
    from pagedkv.errors import SpecError

    try:
        return rule(num_kv_heads, tp)
    except SpecError as exc:
        raise KVCacheUsageError(str(exc)) from None


@dataclass(frozen=True)
class KVShape:
    """The per-token cache geometry of a model.

    Standard attention: K and V of ``num_kv_heads`` heads (``head_size`` and
    ``head_size_v`` values). MLA (``is_mla``): one latent row of ``head_size``
    values, the same on every rank: tensor parallelism splits the query heads, not
    the latent, so each rank caches the whole row.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    head_size_v: int | None = None
    is_mla: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise KVCacheUsageError(f"{name} must be a positive int, got {value!r}")

    @classmethod
    def from_preset(cls, preset: ModelPreset) -> KVShape:
        if preset.is_mla:
            assert preset.kv_lora_rank is not None and preset.qk_rope_head_dim is not None
            latent = preset.kv_lora_rank + preset.qk_rope_head_dim
            return cls(preset.num_layers, 1, latent, is_mla=True)
        return cls(preset.num_layers, preset.num_kv_heads, preset.head_size)

    @classmethod
    def from_spec(cls, spec: AttentionSpec, num_layers: int) -> KVShape:
        """A model of ``num_layers`` layers like ``spec``."""
        if spec.is_mla:
            return cls(num_layers, 1, spec.head_size, is_mla=True)
        return cls(num_layers, spec.num_kv_heads, spec.head_size, spec.head_size_v)

    def bytes_per_token_per_layer(self, kv_dtype_bytes: float, tp: int = 1) -> int:
        if self.is_mla:
            if tp <= 0:
                raise KVCacheUsageError(f"tensor-parallel degree must be >= 1, got {tp}")
            return int(self.head_size * kv_dtype_bytes)
        heads = kv_heads_per_rank(self.num_kv_heads, tp)
        head_size_v = self.head_size_v or self.head_size
        return int(heads * (self.head_size + head_size_v) * kv_dtype_bytes)


@dataclass(frozen=True)
class CapacityEstimate:
    """Everything ``pagedkv capacity`` prints; bytes are per tensor-parallel rank."""

    tp: int
    block_size: int
    kv_dtype_bytes: float
    bytes_per_token_per_layer: int
    bytes_per_token: int  # all layers
    bytes_per_block_per_layer: int
    bytes_per_block: int  # all layers: a "complete block"
    kv_budget_bytes: int | None = None
    num_tokens: int | None = None  # floor(budget / bytes_per_token)
    num_blocks: int | None = None  # floor(budget / bytes_per_block)
    request_len: int | None = None  # average prompt + output tokens
    blocks_per_request: int | None = None
    max_concurrency: int | None = None  # requests of request_len the blocks hold
    concurrency: int | None = None  # a target concurrency ...
    blocks_for_concurrency: int | None = None  # ... and the blocks it needs
    fits: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def kv_budget_bytes(gpu_memory: float, weights: float, overhead: float = 0.0) -> int:
    """Bytes left for the KV cache on one GPU: memory - weights - runtime overhead."""
    budget = gpu_memory - weights - overhead
    if budget <= 0:
        raise KVCacheUsageError(
            f"no room for a KV cache: {gpu_memory / GiB:.2f} GiB memory - {weights / GiB:.2f} GiB "
            f"weights - {overhead / GiB:.2f} GiB overhead = {budget / GiB:.2f} GiB"
        )
    return int(budget)


def weights_bytes_per_rank(
    preset: ModelPreset, tp: int = 1, weight_dtype: str | None = None
) -> int:
    """A weights estimate: parameters x bytes per parameter / tp (even sharding)."""
    return int(preset.num_params * dtype_bytes(weight_dtype or preset.weight_dtype) / tp)


def estimate_capacity(
    shape: KVShape,
    kv_dtype_bytes: float,
    *,
    tp: int = 1,
    block_size: int = 16,
    kv_budget: int | None = None,
    request_len: int | None = None,
    concurrency: int | None = None,
) -> CapacityEstimate:
    """Per-token and per-block cost; with a budget, what fits; with a request length
    (prompt + output tokens), how many such requests and what a target concurrency needs."""
    if block_size <= 0:
        raise KVCacheUsageError(f"block_size must be positive, got {block_size}")
    per_layer = shape.bytes_per_token_per_layer(kv_dtype_bytes, tp)
    per_token = per_layer * shape.num_layers
    fields: dict[str, Any] = dict(
        tp=tp,
        block_size=block_size,
        kv_dtype_bytes=kv_dtype_bytes,
        bytes_per_token_per_layer=per_layer,
        bytes_per_token=per_token,
        bytes_per_block_per_layer=per_layer * block_size,
        bytes_per_block=per_token * block_size,
    )
    num_blocks = None
    if kv_budget is not None:
        if kv_budget <= 0:
            raise KVCacheUsageError(f"kv_budget must be positive, got {kv_budget}")
        num_blocks = kv_budget // (per_token * block_size)
        fields.update(
            kv_budget_bytes=kv_budget, num_tokens=kv_budget // per_token, num_blocks=num_blocks
        )
    if request_len is not None:
        if request_len <= 0:
            raise KVCacheUsageError(f"request length must be positive, got {request_len}")
        per_request = cdiv(request_len, block_size)
        fields.update(request_len=request_len, blocks_per_request=per_request)
        if num_blocks is not None:
            fields["max_concurrency"] = num_blocks // per_request
        if concurrency is not None:
            if concurrency <= 0:
                raise KVCacheUsageError(f"concurrency must be positive, got {concurrency}")
            needed = concurrency * per_request
            fields.update(concurrency=concurrency, blocks_for_concurrency=needed)
            if num_blocks is not None:
                fields["fits"] = needed <= num_blocks
    elif concurrency is not None:
        raise KVCacheUsageError("a target concurrency needs a request length (prompt + output)")
    return CapacityEstimate(**fields)
