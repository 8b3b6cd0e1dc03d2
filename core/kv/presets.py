"""KV-relevant shapes of well-known models, from their published config.json files."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import KVCacheUsageError


@dataclass(frozen=True)
class ModelPreset:
    """What decides a model's KV-cache size, plus its parameter count for a weights guess.

    A standard layer caches K and V per KV head (``head_size`` each). An MLA layer
    caches one latent row of ``kv_lora_rank + qk_rope_head_dim`` values per token,
    shared by every head (``num_kv_heads`` is then 1).
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    num_params: int  # total parameters (weights bytes = num_params x weight dtype bytes)
    dtype: str  # the model's activation / KV dtype
    weight_dtype: str  # how the published checkpoint stores weights
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    source: str = ""

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            "llama-2-7b", 32, 32, 32, 128, 6_738_415_616, "float16", "float16",
            source="meta-llama/Llama-2-7b-hf config.json",
        ),
        ModelPreset(
            "llama-2-13b", 40, 40, 40, 128, 13_015_864_320, "float16", "float16",
            source="meta-llama/Llama-2-13b-hf config.json",
        ),
        ModelPreset(
            "llama-3-8b", 32, 32, 8, 128, 8_030_261_248, "bfloat16", "bfloat16",
            source="meta-llama/Meta-Llama-3-8B config.json",
        ),
        ModelPreset(
            "llama-3-70b", 80, 64, 8, 128, 70_553_706_496, "bfloat16", "bfloat16",
            source="meta-llama/Meta-Llama-3-70B config.json",
        ),
        ModelPreset(
            "deepseek-v3", 61, 128, 1, 576, 671_000_000_000, "bfloat16", "fp8",
            kv_lora_rank=512, qk_rope_head_dim=64,
            source="deepseek-ai/DeepSeek-V3 config.json (MLA: kv_lora_rank 512 + rope 64)",
        ),
    )
}  # fmt: skip


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise KVCacheUsageError(
            f"unknown model preset {name!r}: expected one of {', '.join(PRESETS)}"
        ) from None
