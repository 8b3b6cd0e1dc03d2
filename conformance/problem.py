"""Build a paged problem from a Scenario, run it through a backend, and check it.

Method (docs/conformance.md): seeded random Q/K/V; physical blocks shuffled; block
0 is the null block; every block no table references holds NaN; slots past a
sequence's end inside its last block hold large finite garbage; the context K/V is
written through the backend's own ``write_kv`` and the step's new K/V go through
``forward``. The reference is float64 dense attention over the logical K/V.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.conformance.scenario import Scenario
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.reference import reference_attention, reference_mla
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.kv_write import dequantize_from_cache, quantize_for_cache

# What slots past a sequence's end hold: finite, far from real data, so a kernel
# that reads them without masking shows a large error (and stays NaN-free).
GARBAGE = 1000.0
# What padded rows of key/value hold: must never reach the cache.
PAD_VALUE = 777.0


@dataclass
class PagedProblem:
    """Everything one scenario needs, on one device."""

    scenario: Scenario
    spec: AttentionSpec
    num_blocks: int
    block_ids: list[list[int]]  # physical blocks of each request, in logical order
    keys: list[
        torch.Tensor
    ]  # [seq_len, Hkv, D] per request, in spec.dtype (MLA: latent [s, 1, L+R])
    values: list[torch.Tensor]  # [seq_len, Hkv, Dv] per request (MLA: latent prefix)
    query: torch.Tensor  # [T, Hq, D]
    new_key: torch.Tensor  # [T, Hkv, D]; padded rows hold PAD_VALUE
    new_value: torch.Tensor | None  # [T, Hkv, Dv]; None for MLA
    common: CommonAttentionMetadata
    context: CommonAttentionMetadata  # writes each request's context tokens
    sinks: torch.Tensor | None
    mla_weights: dict[str, torch.Tensor] = field(default_factory=dict)  # w_uk, w_uv, q_nope, q_pe


def build_problem(scenario: Scenario, device: torch.device | str) -> PagedProblem:
    """The random, shuffled-block problem of ``scenario`` (deterministic by its seed)."""
    spec = scenario.spec()
    gen = torch.Generator().manual_seed(scenario.seed)
    bs = spec.block_size
    needed = [-(-s // bs) for s in scenario.seq_lens]
    natural = 1 + sum(needed) + max(4, sum(needed) // 4)
    num_blocks = max(scenario.min_num_blocks, natural)
    # block 0 is the null block; the rest are handed out in shuffled order. A pool
    # enlarged by min_num_blocks hands out its highest blocks, so offsets reach the
    # end of the pool (where 32-bit offset arithmetic overflows).
    first = num_blocks - natural + 1
    shuffled = (torch.randperm(natural - 1, generator=gen) + first).tolist()
    _separate_neighbours(shuffled, needed, random.Random(scenario.seed))
    block_ids, taken = [], 0
    for n in needed:
        block_ids.append(shuffled[taken : taken + n])
        taken += n

    mla_weights: dict[str, torch.Tensor] = {}
    if scenario.is_mla:
        keys, values, query, mla_weights = _mla_data(scenario, spec, gen)
    else:
        keys = [
            _randn(gen, (s, spec.num_kv_heads, spec.head_size), spec.dtype)
            for s in scenario.seq_lens
        ]
        values = [
            _randn(gen, (s, spec.num_kv_heads, spec.head_size_v), spec.dtype)
            for s in scenario.seq_lens
        ]
        query = _randn(gen, (scenario.num_tokens, spec.num_heads, spec.head_size), spec.dtype)

    new_keys, new_values = [], []
    for k, v, q_len in zip(keys, values, scenario.query_lens, strict=True):
        new_keys.append(k[k.shape[0] - q_len :])
        new_values.append(v[v.shape[0] - q_len :])
    pad = scenario.num_padding_tokens
    new_key = torch.cat(
        [*new_keys, torch.full((pad, *keys[0].shape[1:]), PAD_VALUE, dtype=spec.dtype)]
    )
    new_value = torch.cat(
        [*new_values, torch.full((pad, *values[0].shape[1:]), PAD_VALUE, dtype=spec.dtype)]
    )
    if scenario.is_mla:
        new_value = None

    sinks = None
    if spec.use_sinks:
        sinks = torch.randn(spec.num_heads, generator=gen, dtype=torch.float32) * 2.0

    context_lens = [s - q for s, q in zip(scenario.seq_lens, scenario.query_lens, strict=True)]
    common = CommonAttentionMetadata.from_requests(
        scenario.seq_lens,
        scenario.query_lens,
        block_ids,
        bs,
        device,
        num_tokens=scenario.num_tokens,
    )
    context = CommonAttentionMetadata.from_requests(
        context_lens, context_lens, block_ids, bs, device
    )
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return PagedProblem(
        scenario=scenario,
        spec=spec,
        num_blocks=num_blocks,
        block_ids=block_ids,
        keys=keys,
        values=values,
        query=query.to(device),
        new_key=new_key.to(device),
        new_value=to(new_value),
        common=common,
        context=context,
        sinks=to(sinks),
        mla_weights=mla_weights,
    )


def _separate_neighbours(order: list[int], needed: list[int], rng: random.Random) -> None:
    """Swap blocks (in place) until no request holds physical block b then b + 1, so a
    kernel that assumes a request's blocks are contiguous always fails; tiny pools
    may leave a pair after the bounded number of passes."""
    owner = [r for r, n in enumerate(needed) for _ in range(n)]
    for _ in range(100):
        bad = [
            k
            for k in range(1, len(owner))
            if owner[k] == owner[k - 1] and order[k] == order[k - 1] + 1
        ]
        if not bad:
            return
        for k in bad:
            j = rng.randrange(len(order))
            order[k], order[j] = order[j], order[k]


def _randn(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def _mla_data(
    scenario: Scenario, spec: AttentionSpec, gen: torch.Generator
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    """Latent K/V and the absorbed query, from random un-absorbed weights."""
    lora, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
    assert lora is not None and rope is not None
    h, nope, vdim = spec.num_heads, scenario.qk_nope_head_dim, scenario.v_head_dim
    # scaled so that absorbed scores and outputs stay O(1)
    w_uk = torch.randn(lora, h, nope, generator=gen) / lora**0.5
    w_uv = torch.randn(lora, h, vdim, generator=gen) / lora**0.5
    latents = [_randn(gen, (s, 1, lora + rope), spec.dtype) for s in scenario.seq_lens]
    q_nope = torch.randn(scenario.num_tokens, h, nope, generator=gen)
    q_pe = _randn(gen, (scenario.num_tokens, h, rope), spec.dtype)
    q_absorbed = torch.einsum("thp,lhp->thl", q_nope, w_uk).to(spec.dtype)
    query = torch.cat([q_absorbed, q_pe], dim=-1)
    values = [lat[..., :lora] for lat in latents]
    weights = {"w_uk": w_uk, "w_uv": w_uv, "q_nope": q_nope, "q_pe": q_pe, "q_absorbed": q_absorbed}
    return latents, values, query, weights


# -- poisoning --------------------------------------------------------------------------


def poison_cache(backend: AttentionBackend, kv_cache: torch.Tensor, problem: PagedProblem) -> None:
    """NaN everywhere, then GARBAGE in every slot a request's blocks hold (context
    slots get overwritten by write_kv; those past the end stay GARBAGE)."""
    k_view, v_view = backend.kv_cache_to_logical(kv_cache, problem.spec)
    for view in (k_view, v_view):
        view.fill_(float("nan"))
        used = [b for ids in problem.block_ids for b in ids]
        if used:
            idx = torch.tensor(used, dtype=torch.int64, device=view.device)
            view[idx] = torch.tensor(GARBAGE, dtype=torch.float32).to(view.dtype).to(view.device)


def real_kv(problem: PagedProblem, k: torch.Tensor, scale: float) -> torch.Tensor:
    """What the cache holds for ``k``, read back as real values (fp8 round trip)."""
    cache_dtype = problem.spec.cache_dtype
    return dequantize_from_cache(quantize_for_cache(k, cache_dtype, scale), scale, torch.float64)


# -- reference ---------------------------------------------------------------------------


def cached_kv(problem: PagedProblem) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each request's K and V as the cache holds them, read back as float64 values."""
    spec = problem.spec
    keys = [real_kv(problem, k, spec.k_scale) for k in problem.keys]
    return keys, [real_kv(problem, v, spec.v_scale) for v in problem.values]


def reference_output(problem: PagedProblem) -> torch.Tensor:
    """Float64 [num_actual_tokens, Hq, Dv] from the logical K/V, no block tables."""
    s, spec = problem.scenario, problem.spec
    n = problem.common.num_actual_tokens
    query_lens = list(s.query_lens)
    keys, values = cached_kv(problem)
    if s.is_mla:
        # the un-absorbed math: up-project the latent per head, plain attention
        w = problem.mla_weights
        lora = spec.kv_lora_rank
        return reference_mla(
            w["q_nope"][:n],
            w["q_pe"][:n],
            [k[:, 0, :lora] for k in keys],
            [k[:, 0, lora:] for k in keys],
            w["w_uk"],
            w["w_uv"],
            query_lens,
            spec.scale,
            spec.causal,
        )
    return reference_attention(
        problem.query[:n].cpu(), keys, values, query_lens, spec, problem.sinks
    )
