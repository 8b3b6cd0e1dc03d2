"""Tensor parallelism for Hugging Face decoders (Megatron-style, as vLLM runs them).

Each decoder layer's projections are sharded in place, from the full weights every
rank holds:

- column-parallel (each rank computes a slice of the outputs, no communication):
  ``q_proj`` (the rank's query heads), ``k_proj`` / ``v_proj`` (its KV heads — one head
  replicated on ``tp / num_kv_heads`` ranks when ``tp > num_kv_heads``), ``gate_proj``
  and ``up_proj`` (a slice of the intermediate size);
- row-parallel (each rank multiplies its slice of the inputs; the partial sums are
  all-reduced, then the bias added once): ``o_proj`` and ``down_proj``.

The head ranges come from ``pagedkv.distributed.shard_spec``, the same ranges the
rank's attention spec has, so the cache holds exactly the heads the projections
produce. Embeddings, norms and the LM head stay replicated. HF's attention modules
reshape with ``-1`` heads, so they run unchanged on their slice. Models whose layers
are not dense attention + gate/up/down MLP (MoE experts, DeepSeek's MLA) are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from pagedkv.distributed import HeadShard, shard_spec
from pagedkv.errors import SpecError
from pagedkv.models.errors import ModelSupportError
from pagedkv.models.mla import is_mla_attention
from pagedkv.models.specs import attention_layer, attention_modules
from pagedkv.serving.parallel import TensorParallel
from torch import nn

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_slice @ W_slice^T) + b``: this rank's input columns of a
    linear layer; every rank ends with the full output."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = nn.functional.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


def head_shard(module: Any, config: Any, tp: TensorParallel) -> HeadShard:
    """The heads of one attention module that ``tp.rank`` holds (block size and dtype
    do not change the head ranges)."""
    full = attention_layer(module, config, torch.float32, block_size=16).spec
    try:
        return shard_spec(full, tp.size, tp.rank)
    except SpecError as exc:
        raise ModelSupportError(f"layer {module.layer_idx}: {exc}") from None


def shard_model(model: Any, tp: TensorParallel) -> None:
    """Shard ``model``'s decoder layers in place for rank ``tp.rank`` of ``tp.size``."""
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise ModelSupportError(
            f"{type(model).__name__}: tensor parallelism needs the decoder layers at "
            "model.base_model.layers"
        )
    for attn in attention_modules(model):
        if is_mla_attention(attn):
            raise ModelSupportError(
                f"layer {attn.layer_idx}: tensor parallelism of MLA attention (DeepSeek) is not "
                "supported; dense attention (q/k/v/o_proj) only"
            )
        _need(attn, ATTENTION_PROJECTIONS, f"layer {attn.layer_idx} attention")
        mlp = getattr(layers[attn.layer_idx], "mlp", None)
        _need(mlp, MLP_PROJECTIONS, f"layer {attn.layer_idx} MLP ({type(mlp).__name__})")
        shard = head_shard(attn, model.config, tp)
        d = attn.head_dim
        _column(attn, "q_proj", shard.query_heads.start * d, shard.query_heads.stop * d)
        _column(attn, "k_proj", shard.kv_heads.start * d, shard.kv_heads.stop * d)
        _column(attn, "v_proj", shard.kv_heads.start * d, shard.kv_heads.stop * d)
        _row(attn, "o_proj", shard.query_heads.start * d, shard.query_heads.stop * d, tp)
        intermediate = mlp.gate_proj.out_features
        if intermediate % tp.size:
            raise ModelSupportError(
                f"layer {attn.layer_idx}: intermediate size {intermediate} is not divisible by "
                f"tp size {tp.size}"
            )
        part = intermediate // tp.size
        lo, hi = tp.rank * part, (tp.rank + 1) * part
        _column(mlp, "gate_proj", lo, hi)
        _column(mlp, "up_proj", lo, hi)
        _row(mlp, "down_proj", lo, hi, tp)


def _need(module: Any, names: tuple[str, ...], where: str) -> None:
    missing = [n for n in names if not isinstance(getattr(module, n, None), nn.Linear)]
    if missing:
        raise ModelSupportError(
            f"{where}: tensor parallelism shards {', '.join(names)} (nn.Linear); missing "
            f"{', '.join(missing)} (MoE experts and other layers are not sharded)"
        )


def _column(parent: nn.Module, name: str, lo: int, hi: int) -> None:
    """Keep output features [lo, hi) of ``parent.name``."""
    full: nn.Linear = getattr(parent, name)
    part = nn.Linear(full.in_features, hi - lo, bias=full.bias is not None)
    part = part.to(device=full.weight.device, dtype=full.weight.dtype)
    with torch.no_grad():
        part.weight.copy_(full.weight[lo:hi])
        if full.bias is not None:
            part.bias.copy_(full.bias[lo:hi])
    setattr(parent, name, part.requires_grad_(False))


def _row(parent: nn.Module, name: str, lo: int, hi: int, tp: TensorParallel) -> None:
    """Keep input features [lo, hi) of ``parent.name``; all-reduce its output."""
    full: nn.Linear = getattr(parent, name)
    weight = full.weight.detach()[:, lo:hi].contiguous()
    bias = None if full.bias is None else full.bias.detach().clone()
    setattr(parent, name, RowParallelLinear(weight, bias, tp.group))
