"""DeepSeek-V2/V3 multi-head latent attention from a Hugging Face checkpoint.

``kv_b_proj.weight`` ``[H * (nope + v), L]`` up-projects the latent ``kv_c [L]`` to each
head's key part ``k_nope [nope]`` and value ``[v]``, head by head:
``kv_b_proj(kv_c).view(H, nope + v)``. The absorbed form needs them apart:
``W_UK [L, H, nope]`` with ``k_nope[h] = kv_c @ W_UK[:, h]`` and ``W_UV [L, H, v]`` with
``v[h] = kv_c @ W_UV[:, h]`` (the layouts ``pagedkv.backends.mla.absorb`` takes).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from pagedkv.models.errors import ModelSupportError


def split_kv_b_proj(
    weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK ``[L, H, nope]`` and W_UV ``[L, H, v]`` from ``kv_b_proj.weight``
    ``[H * (nope + v), L]`` (new contiguous tensors, the weight's dtype and device)."""
    per_head = qk_nope_head_dim + v_head_dim
    if weight.dim() != 2 or weight.shape[0] != num_heads * per_head:
        raise ModelSupportError(
            f"kv_b_proj.weight: expected [num_heads * (qk_nope_head_dim + v_head_dim), "
            f"kv_lora_rank] = [{num_heads} * ({qk_nope_head_dim} + {v_head_dim}), L], got "
            f"{list(weight.shape)}"
        )
    w = weight.detach().view(num_heads, per_head, weight.shape[1])  # [H, nope + v, L]
    w_uk = w[:, :qk_nope_head_dim].permute(2, 0, 1).contiguous()
    w_uv = w[:, qk_nope_head_dim:].permute(2, 0, 1).contiguous()
    return w_uk, w_uv


def is_mla_attention(module: Any) -> bool:
    return hasattr(module, "kv_b_proj") and hasattr(module, "kv_lora_rank")


def pass_latent_through(module: Any, attention_name: str) -> None:
    """Make the module hand its latent to the attention function under ``attention_name``.

    HF's DeepSeek attention expands the latent with ``expand_kv`` before calling the
    attention function; pagedkv caches the latent itself, so under pagedkv's attention
    ``expand_kv`` returns ``key = concat(kv_c, k_pe)`` ``[B, 1, T, L + R]`` and
    ``value = None``. Any other attention implementation gets HF's expansion.
    """
    original = getattr(type(module), "expand_kv", None)
    if original is None:
        raise ModelSupportError(
            f"{type(module).__name__} has no expand_kv: this transformers version's MLA "
            "attention cannot hand its latent to pagedkv"
        )
    module.expand_kv = functools.partial(_expand_kv, module, original, attention_name)


def _expand_kv(
    module: Any, original: Any, attention_name: str, kv_nope: torch.Tensor, k_rot: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if module.config._attn_implementation != attention_name:
        return original(module, kv_nope, k_rot)
    return torch.cat((kv_nope, k_rot), dim=-1), None
