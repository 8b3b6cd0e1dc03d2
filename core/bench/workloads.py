"""The workload matrix of ``pagedkv bench``: realistic serving steps, not only uniform batches.

A workload is one step (per-request context and query lengths) through one layer
shape. Lengths are drawn from seeded distributions, so a row is the same step on
every run and every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from pagedkv.spec import AttentionSpec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Layer:
    """The attention layer a workload runs through."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: str = "bf16"
    kv_cache_dtype: str = "auto"
    # MLA (a latent row of kv_lora_rank + qk_rope_head_dim per token, one KV head; the
    # query absorbed): both set, head_size their sum; the softmax scale of the model's
    # q_nope + q_pe width
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    scale: float | None = None

    def spec(self) -> AttentionSpec:
        return AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=DTYPES[self.dtype],
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            scale=self.scale,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
        )

    def describe(self) -> str:
        cache = "" if self.kv_cache_dtype == "auto" else f" {self.kv_cache_dtype}"
        if self.kv_lora_rank is not None:
            return (
                f"MLA H{self.num_heads} L{self.kv_lora_rank}+R{self.qk_rope_head_dim} "
                f"B{self.block_size} {self.dtype}{cache}"
            )
        return (
            f"Hq{self.num_heads}/Hkv{self.num_kv_heads} D{self.head_size} B{self.block_size} "
            f"{self.dtype}{cache}"
        )


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # decode, ragged-decode, spec-decode, mixed, prefill, chunked-prefill
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    layer: Layer = field(default_factory=Layer)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    def describe(self) -> str:
        decodes = sum(q == 1 for q in self.query_lens)
        others = self.num_reqs - decodes
        ctx = [s - q for s, q in zip(self.seq_lens, self.query_lens, strict=True)]
        return (
            f"{self.num_reqs} reqs ({decodes} decode, {others} longer), {self.num_tokens} tokens, "
            f"context {min(ctx)}..{max(ctx)} (mean {sum(ctx) // max(1, len(ctx))})"
        )


def uniform(
    name: str, batch: int, seq_len: int, query_len: int, layer: Layer, kind: str
) -> Workload:
    return Workload(name, kind, (seq_len,) * batch, (query_len,) * batch, layer)


def long_tailed_contexts(rng: random.Random, n: int, median: int, cap: int) -> list[int]:
    """Context lengths with a serving-like long tail (log-normal, sigma 1), in [16, cap]."""
    return [max(16, min(cap, int(rng.lognormvariate(0, 1.0) * median))) for _ in range(n)]


def ragged_decode(
    name: str, batch: int, median: int, cap: int, layer: Layer, seed: int = 0
) -> Workload:
    rng = random.Random(seed)
    ctx = long_tailed_contexts(rng, batch, median, cap)
    return Workload(name, "ragged-decode", tuple(c + 1 for c in ctx), (1,) * batch, layer)


def spec_decode(
    name: str, batch: int, median: int, draft: int, layer: Layer, seed: int = 0
) -> Workload:
    """Speculative decoding: each request verifies ``draft`` tokens (2-8)."""
    rng = random.Random(seed)
    ctx = long_tailed_contexts(rng, batch, median, 16 * median)
    return Workload(name, "spec-decode", tuple(c + draft for c in ctx), (draft,) * batch, layer)


def mixed(
    name: str,
    decodes: int,
    median: int,
    chunks: tuple[tuple[int, int], ...],
    layer: Layer,
    seed: int = 0,
) -> Workload:
    """A serving step: ragged decodes first, then chunked prefills ``(context, chunk)``."""
    rng = random.Random(seed)
    ctx = long_tailed_contexts(rng, decodes, median, 16 * median)
    seq = [c + 1 for c in ctx] + [c + q for c, q in chunks]
    qry = [1] * decodes + [q for _, q in chunks]
    return Workload(name, "mixed", tuple(seq), tuple(qry), layer)


def mixed_shape(text: str, dtype: str = "bf16") -> Workload:
    """A mixed step from ``decodes:median context:chunk context:chunk queries[:head
    size]`` (head size 128: 32 query heads over 8 KV heads; others 16 over 4; seed 7):
    the shapes benchmarks/mixed_chunk_sweep.py and the probes of a mixed step's plan
    take."""
    fields = [int(x) for x in text.split(":")]
    decodes, median, context, queries = fields[:4]
    head_size = fields[4] if len(fields) > 4 else 128
    layer = Layer(dtype=dtype)
    if head_size != 128:
        layer = Layer(head_size=head_size, num_heads=16, num_kv_heads=4, dtype=dtype)
    name = f"{decodes}d+chunk{queries}@{context}" + ("" if head_size == 128 else f"-d{head_size}")
    return mixed(name, decodes, median, ((context, queries),), layer, seed=7)


BASE = Layer()


def mla_layer(num_heads: int, lora: int, rope: int, nope: int, **more: object) -> Layer:
    """An MLA layer: ``nope`` + ``rope`` the query's width before absorption (its scale)."""
    return Layer(
        num_heads=num_heads, num_kv_heads=1, head_size=lora + rope, kv_lora_rank=lora,
        qk_rope_head_dim=rope, scale=(nope + rope) ** -0.5, **more,  # type: ignore[arg-type]
    )  # fmt: skip


def _matrix() -> dict[str, list[Workload]]:
    d64 = Layer(head_size=64, block_size=32)
    d256 = Layer(head_size=256, num_heads=16, num_kv_heads=4)
    gqa1 = Layer(num_heads=32, num_kv_heads=32)
    gqa8 = Layer(num_heads=64, num_kv_heads=8)
    gqa16 = Layer(num_heads=64, num_kv_heads=4)
    b64 = Layer(block_size=64)
    fp8 = Layer(kv_cache_dtype="fp8_e4m3")
    core = [
        uniform("decode-64x4096", 64, 4096, 1, BASE, "decode"),
        uniform("decode-256x1024", 256, 1024, 1, BASE, "decode"),
        uniform("decode-4x32k", 4, 32768, 1, BASE, "decode"),
        uniform("decode-1x32k", 1, 32768, 1, BASE, "decode"),
        uniform("prefill-8x2048", 8, 2048, 2048, BASE, "prefill"),
    ]
    serving = [
        ragged_decode("ragged-decode-128", 128, 1024, 32768, BASE, seed=1),
        ragged_decode("ragged-decode-32-long", 32, 8192, 131072, BASE, seed=2),
        mixed("mixed-96d+2chunks", 96, 1024, ((2048, 512), (8192, 512)), BASE, seed=3),
        mixed("mixed-16d+1chunk", 16, 2048, ((4096, 256),), BASE, seed=4),
        spec_decode("spec-decode-64x4", 64, 2048, 4, BASE, seed=5),
        spec_decode("spec-decode-32x8", 32, 2048, 8, BASE, seed=6),
        ragged_decode("gqa1-ragged-decode", 64, 1024, 16384, gqa1, seed=7),
        ragged_decode("gqa8-ragged-decode", 64, 2048, 32768, gqa8, seed=8),
        ragged_decode("gqa16-ragged-decode", 64, 2048, 32768, gqa16, seed=9),
        mixed("d64-b32-mixed", 64, 1024, ((1024, 512),), d64, seed=10),
        mixed("d256-mixed", 48, 1024, ((2048, 256),), d256, seed=11),
        ragged_decode("b64-ragged-decode", 64, 2048, 32768, b64, seed=12),
        uniform("fp8-decode-64x4096", 64, 4096, 1, fp8, "decode"),
        mixed("fp8-mixed", 64, 1024, ((2048, 512),), fp8, seed=13),
        uniform("prefill-2x8192", 2, 8192, 8192, BASE, "prefill"),
        Workload("chunked-prefill-4x2048+8k", "chunked-prefill", (10240,) * 4, (2048,) * 4, BASE),
    ]
    # decode steps far shorter than the longest context an engine reserves its CUDA
    # graphs for (``pagedkv bench --matrix short --graph-context 32768``): the steps of
    # the first thousands of tokens, where the reservation's plan, not the step, may
    # set the launch (the twenty-fourth to twenty-seventh sessions' short rows)
    short = [
        uniform(f"short-decode-{batch}x{seq_len}", batch, seq_len, 1, BASE, "decode")
        for batch, seq_len in (
            (1, 1024), (1, 4096), (4, 2048), (2, 8192), (8, 4096), (16, 1024), (32, 512),
            (64, 1024),
        )
    ] + [ragged_decode("short-ragged-decode-64", 64, 512, 4096, BASE, seed=17)]  # fmt: skip
    tiny = Layer(num_heads=4, num_kv_heads=2, head_size=32, block_size=16, dtype="fp32")
    cpu = [
        uniform("tiny-decode", 4, 100, 1, tiny, "decode"),
        mixed("tiny-mixed", 3, 40, ((30, 17),), tiny, seed=1),
        spec_decode("tiny-spec", 2, 40, 3, tiny, seed=2),
    ]
    # DeepSeek V2/V3: 128 heads (16 under 8-way tensor parallelism), latent 512 + 64
    deepseek = mla_layer(128, 512, 64, 128, block_size=64)
    deepseek_tp8 = mla_layer(16, 512, 64, 128, block_size=64)
    mla = [
        uniform("mla-decode-64x4096", 64, 4096, 1, deepseek, "decode"),
        uniform("mla-decode-256x1024", 256, 1024, 1, deepseek, "decode"),
        uniform("mla-decode-4x32k", 4, 32768, 1, deepseek, "decode"),
        uniform("mla-decode-1x32k", 1, 32768, 1, deepseek, "decode"),
        ragged_decode("mla-ragged-decode-256", 256, 1024, 32768, deepseek, seed=14),
        ragged_decode("mla-tp8-ragged-decode-64", 64, 2048, 32768, deepseek_tp8, seed=15),
        mixed("mla-mixed-64d+1chunk", 64, 2048, ((4096, 512),), deepseek, seed=16),
    ]
    tiny_mla = mla_layer(8, 64, 16, 32, block_size=16, dtype="fp32")
    cpu_mla = [
        uniform("tiny-mla-decode", 3, 90, 1, tiny_mla, "decode"),
        mixed("tiny-mla-mixed", 3, 40, ((30, 9),), tiny_mla, seed=3),
    ]
    return {
        "core": core, "standard": core + serving, "short": short, "tiny": cpu, "mla": mla,
        "tiny-mla": cpu_mla,
    }  # fmt: skip


MATRICES = _matrix()
