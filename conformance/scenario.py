"""Scenario: one conformance case, small enough to reproduce from one line."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from pagedkv.spec import AttentionSpec, alibi_slopes

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class Scenario:
    """A batch (per-request seq and query lengths) plus the layer it runs through.

    Standard layers use num_heads/num_kv_heads/head_size. MLA scenarios set
    ``kv_lora_rank`` and ``qk_rope_head_dim`` (and ``qk_nope_head_dim`` /
    ``v_head_dim`` for the un-absorbed reference); head_size is then derived.
    """

    name: str
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    num_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 64
    dtype: torch.dtype = torch.float16
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    alibi: bool = False
    use_sinks: bool = False
    causal: bool = True
    # None: head_size ** -0.5 (MLA: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5). Set
    # to check that a backend uses spec.scale rather than deriving its own.
    scale: float | None = None
    num_padding_tokens: int = 0  # extra rows with slot -1 after the scheduled tokens
    min_num_blocks: int = 0  # pool size floor (e.g. > 32k blocks for 64-bit offsets)
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    seed: int = 0
    tags: frozenset[str] = frozenset()  # the features and axes it exercises

    def __post_init__(self) -> None:
        if len(self.seq_lens) != len(self.query_lens):
            raise ValueError(f"{self.name}: seq_lens and query_lens differ in length")
        for i, (s, q) in enumerate(zip(self.seq_lens, self.query_lens, strict=True)):
            if not 0 <= q <= s:
                raise ValueError(f"{self.name}: request {i} has query_len {q} > seq_len {s}")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens) + self.num_padding_tokens

    def row_requests(self) -> list[int]:
        """The request of each scheduled query row, in packed order (padding excluded)."""
        return [r for r, q in enumerate(self.query_lens) for _ in range(q)]

    def spec(self) -> AttentionSpec:
        if self.is_mla:
            assert self.qk_rope_head_dim is not None
            return AttentionSpec(
                num_heads=self.num_heads,
                num_kv_heads=1,
                head_size=self.kv_lora_rank + self.qk_rope_head_dim,
                dtype=self.dtype,
                block_size=self.block_size,
                scale=self.scale or (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5,
                kv_cache_dtype=self.kv_cache_dtype,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
                causal=self.causal,
                kv_lora_rank=self.kv_lora_rank,
                qk_rope_head_dim=self.qk_rope_head_dim,
            )
        return AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            block_size=self.block_size,
            scale=self.scale,
            kv_cache_dtype=self.kv_cache_dtype,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            alibi_slopes=alibi_slopes(self.num_heads) if self.alibi else None,
            use_sinks=self.use_sinks,
            causal=self.causal,
        )

    def layer(self) -> dict[str, Any]:
        """The attention layer this scenario runs (its spec), as JSON-ready fields."""
        spec = self.spec()
        fields: dict[str, Any] = {
            "num_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size,
            "head_size_v": spec.head_size_v,
            "dtype": _DTYPE_NAMES[spec.dtype],
            "block_size": spec.block_size,
            "scale": spec.scale,
            "kv_cache_dtype": spec.kv_cache_dtype,
            "k_scale": spec.k_scale,
            "v_scale": spec.v_scale,
            "sliding_window": spec.sliding_window,
            "logits_soft_cap": spec.logits_soft_cap,
            "alibi": spec.alibi_slopes is not None,
            "use_sinks": spec.use_sinks,
            "causal": spec.causal,
        }
        if self.is_mla:
            fields.update(
                kv_lora_rank=self.kv_lora_rank,
                qk_rope_head_dim=self.qk_rope_head_dim,
                qk_nope_head_dim=self.qk_nope_head_dim,
                v_head_dim=self.v_head_dim,
            )
        return fields

    def replace(self, **changes: object) -> Scenario:
        return dataclasses.replace(self, **changes)

    def repro(self) -> str:
        """A one-line Python reproduction of this case."""
        fields = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "name" or value == f.default:
                continue
            if f.name == "tags":
                continue
            text = f"torch.{_DTYPE_NAMES[value]}" if isinstance(value, torch.dtype) else repr(value)
            fields.append(f"{f.name}={text}")
        return f"Scenario({self.name!r}, {', '.join(fields)})"
