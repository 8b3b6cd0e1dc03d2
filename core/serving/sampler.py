"""Sampling: greedy, or temperature with top-k / top-p, per row, reproducible per seed."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pagedkv.serving.params import SamplingParams
from pagedkv.transfer import to_device


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One token per row.

    logits: [N, V], any float dtype (computed in float32); params, generators: one per
    row (a generator makes that row's draw independent of the rest of the batch).
    Returns int64 [N] on logits' device. Sampled rows use the exponential race
    (argmax of p / q with q ~ Exp(1)), which draws from p exactly.
    """
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return tokens
    rows = to_device(random_rows, logits.device, torch.int64)
    probs = _filtered_probs(logits[rows], [params[i] for i in random_rows])
    q = torch.empty_like(probs)
    for j, i in enumerate(random_rows):
        q[j].exponential_(generator=generators[i])
    q.clamp_(min=torch.finfo(q.dtype).tiny)  # a zero draw would divide by zero
    tokens[rows] = (probs / q).argmax(dim=-1)
    return tokens


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax of logits / temperature, restricted to each row's top-k and top-p set."""
    # host values copied without blocking, and the filter decided on the host: reading
    # a device tensor (``bool(t.any())``) would wait for the step in flight
    device = logits.device
    temperature = to_device([p.temperature for p in params], device, torch.float32)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_ks = [min(p.top_k or vocab, vocab) for p in params]
    top_ps = [p.top_p for p in params]
    if any(k < vocab for k in top_ks) or any(p < 1 for p in top_ps):
        top_k = to_device(top_ks, device, torch.int64)
        top_p = to_device(top_ps, device, torch.float32)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)
        drop = rank[None, :] >= top_k[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # keep a token while the mass before it is below top_p (the first is always kept)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(dim=-1)
