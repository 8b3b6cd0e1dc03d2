"""Batch invariance: a request's output, bit for bit, whatever else is in its batch.

One request R (its own seeded context, step rows and query) runs in several batches:
alone; after other requests; before them; in the middle of a reordered batch; with
padding rows; and in a batch large enough that a split-KV policy decides differently
than for R alone. Its output rows must be bitwise identical in every batch for a
backend that declares ``Capabilities.batch_invariant``; for the others the largest
difference is reported, not judged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.conformance.cache import _bits
from pagedkv.conformance.scenario import Scenario
from pagedkv.intmath import cdiv
from pagedkv.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class _Request:
    seq_len: int
    query_len: int
    seed: int


def _tensors(spec, req: _Request) -> dict[str, torch.Tensor]:
    """K/V of every position and the queries of the last ``query_len``, from the request's seed."""
    gen = torch.Generator().manual_seed(req.seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(spec.dtype)

    return {
        "k": randn(req.seq_len, spec.num_kv_heads, spec.head_size),
        "v": randn(req.seq_len, spec.num_kv_heads, spec.head_size_v),
        "q": randn(req.query_len, spec.num_heads, spec.head_size),
    }


def _run_batch(
    backend: AttentionBackend,
    spec,
    requests: list[_Request],
    device: str,
    *,
    padding: int,
    block_offset: int,
) -> list[torch.Tensor]:
    """Each request's output rows, from one step holding all of them (context written
    first, then the step with its new rows), physical blocks placed from ``block_offset``."""
    bs = spec.block_size
    data = [_tensors(spec, r) for r in requests]
    blocks, next_block = [], 1 + block_offset
    for r in requests:
        n = cdiv(r.seq_len, bs)
        blocks.append(list(range(next_block, next_block + n))[::-1])  # non-contiguous order
        next_block += n
    cache = backend.allocate_kv_cache(next_block + 1, spec, device)
    builder, impl = backend.make_builder(spec, device), backend.make_impl(spec)
    ctx_lens = [r.seq_len - r.query_len for r in requests]
    if sum(ctx_lens):
        context = CommonAttentionMetadata.from_requests(ctx_lens, ctx_lens, blocks, bs, device)
        key = torch.cat([d["k"][:c] for d, c in zip(data, ctx_lens, strict=True)]).to(device)
        value = torch.cat([d["v"][:c] for d, c in zip(data, ctx_lens, strict=True)]).to(device)
        impl.write_kv(key, value, cache, builder.build(context))
    tokens = sum(r.query_len for r in requests)
    step = CommonAttentionMetadata.from_requests(
        [r.seq_len for r in requests], [r.query_len for r in requests], blocks, bs, device,
        num_tokens=tokens + padding,
    )  # fmt: skip

    def rows(name: str, pad_shape: tuple[int, ...]) -> torch.Tensor:
        parts = [d[name][-r.query_len :] for d, r in zip(data, requests, strict=True)]
        parts.append(torch.full((padding, *pad_shape), 7.0, dtype=spec.dtype))
        return torch.cat(parts).to(device)

    query = torch.cat(
        [d["q"] for d in data]
        + [torch.full((padding, spec.num_heads, spec.head_size), 3.0, dtype=spec.dtype)]
    ).to(device)
    out = impl.forward(
        query,
        rows("k", (spec.num_kv_heads, spec.head_size)),
        rows("v", (spec.num_kv_heads, spec.head_size_v)),
        cache,
        builder.build(step),
    )
    starts = [0]
    for r in requests:
        starts.append(starts[-1] + r.query_len)
    return [out[starts[i] : starts[i + 1]].cpu() for i in range(len(requests))]


def invariance_differences(
    backend: AttentionBackend, base: Scenario, device: str
) -> dict[str, float]:
    """Batch name -> largest |difference| of request R's output against R alone
    (0.0 where bitwise identical)."""
    spec = base.spec()
    bs = spec.block_size
    # long enough that a split-KV policy splits it when it runs alone (on a CPU's
    # stand-in SM count too), and not in a batch of a few more requests
    target = _Request(seq_len=80 * bs + 3, query_len=1, seed=1234)
    chunk = _Request(seq_len=6 * bs + 5, query_len=bs + 3, seed=99)
    others = [
        _Request(seq_len=(3 + i % 7) * bs - i, query_len=1 + (i % 3 == 0) * 2, seed=i)
        for i in range(1, 9)
    ]
    many = [_Request(seq_len=2 * bs + i, query_len=1, seed=500 + i) for i in range(48)]
    batches = {
        "after others": ([*others[:4], target], 0),
        "before others": ([target, *others[4:]], 0),
        "reordered, with a chunk": ([others[5], chunk, target, others[2], others[7]], 0),
        "with padding rows": ([others[1], target], 5),
        "in a large batch (other split decision)": ([*many, target], 0),
    }
    alone = _run_batch(backend, spec, [target], device, padding=0, block_offset=0)[0]
    out = {}
    for i, (name, (requests, padding)) in enumerate(batches.items()):
        rows = _run_batch(
            backend, spec, requests, device, padding=padding, block_offset=7 * (i + 1)
        )
        got = rows[requests.index(target)]
        same = torch.equal(_bits(got), _bits(alone))
        out[name] = 0.0 if same else float((got.float() - alone.float()).abs().max())
    return out
