"""Weight absorption around the latent attention, for models that hold W_UK / W_UV.

MLA's keys and values are per-head up-projections of the latent:
``k_nope[h] = kv_c @ W_UK[:, h]`` and ``v[h] = kv_c @ W_UV[:, h]``. Attention never
needs them: ``q_nope[h] . k_nope[h] = (W_UK[:, h] @ q_nope[h]) . kv_c`` (absorb the
query), and ``sum p * v[h] = (sum p * kv_c) @ W_UV[:, h]`` (up-project the output).
"""

from __future__ import annotations

from typing import Any

import torch
from pagedkv.errors import UnsupportedError


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, nope] and W_UK [L, H, nope] -> absorbed q_nope [T, H, L].

    One batched matmul over heads, in the inputs' dtype (fp32 accumulation on GPUs).
    """
    _check_weight("w_uk", w_uk, q_nope, "q_nope")
    # [H, T, nope] @ [H, nope, L] -> [H, T, L]
    return torch.bmm(q_nope.transpose(0, 1), w_uk.permute(1, 2, 0)).transpose(0, 1)


def up_project(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Attention output in latent space [T, H, L] and W_UV [L, H, v] -> [T, H, v]."""
    expected = (o_latent.shape[-1], o_latent.shape[1] if o_latent.dim() == 3 else -1)
    if o_latent.dim() != 3 or w_uv.dim() != 3 or tuple(w_uv.shape[:2]) != expected:
        raise UnsupportedError(
            f"w_uv: expected [L, H, v] = [{o_latent.shape[-1]}, {o_latent.shape[1]}, v] for "
            f"o_latent {list(o_latent.shape)}, got {list(w_uv.shape)}"
        )
    # [H, T, L] @ [H, L, v] -> [H, T, v]
    return torch.bmm(o_latent.transpose(0, 1), w_uv.permute(1, 0, 2)).transpose(0, 1)


def mla_attention(
    impl: Any,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor | None,
    k_pe: torch.Tensor | None,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: Any,
) -> torch.Tensor:
    """A model's MLA layer from un-absorbed inputs: absorb q_nope with W_UK, write the
    new latent rows, attend, up-project with W_UV.

    impl: an MLAAttentionImpl; q_nope [T, H, nope]; q_pe [T, H, R]; kv_c [T, L] and
    k_pe [T, R] (or None); w_uk [L, H, nope]; w_uv [L, H, v]. Returns [T, H, v] in
    the layer's dtype.
    """
    dtype = impl.spec.dtype
    q_absorbed = absorb_query(q_nope.to(dtype), w_uk.to(dtype))
    o_latent = impl.forward_mla(q_absorbed, q_pe, kv_c, k_pe, kv_cache, metadata)
    return up_project(o_latent, w_uv.to(dtype))


def _check_weight(name: str, w: torch.Tensor, x: torch.Tensor, x_name: str) -> None:
    if x.dim() != 3 or w.dim() != 3 or w.shape[1:] != x.shape[1:]:
        raise UnsupportedError(
            f"{name}: expected [L, H, nope] = [L, {x.shape[1] if x.dim() == 3 else '?'}, "
            f"{x.shape[-1]}] for {x_name} {list(x.shape)}, got {list(w.shape)}"
        )
