"""Sampling: greedy, or temperature with top-k / top-p, per row, reproducible per seed."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pagedkv.serving.params import SamplingParams


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
    rows = torch.tensor(random_rows, device=logits.device)
    probs = _filtered_probs(logits[rows], [params[i] for i in random_rows])
    q = torch.empty_like(probs)
    for j, i in enumerate(random_rows):
        q[j].exponential_(generator=generators[i])
    q.clamp_(min=torch.finfo(q.dtype).tiny)  # a zero draw would divide by zero
    tokens[rows] = (probs / q).argmax(dim=-1)
    return tokens


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax of logits / temperature, restricted to each row's top-k and top-p set."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=logits.device).clamp(max=vocab)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    if (top_k < vocab).any() or (top_p < 1).any():
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
