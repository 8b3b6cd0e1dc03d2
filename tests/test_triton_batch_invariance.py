"""Batch invariance of the Triton backend: with ``batch_invariant=true`` a request's
output is bitwise the same whatever else is in the batch.

The same request (same K/V, same query) runs alone, after and before others, among
padding rows, reordered, beside a long prefill (which changes the default's tiles)
and beside many requests (which changes the default's split decision). On a CPU the
kernels run in Triton's interpreter (tiny shapes, float16/float32).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pagedkv
import pytest
import torch
from pagedkv import AttentionSpec, CommonAttentionMetadata

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Request:
    seq_len: int
    query_len: int
    seed: int  # its K/V and queries, the same in every batch


# the requests whose outputs are compared: a long decode (split in either mode) and a
# chunk of queries over a context
LONG, CHUNK = Request(1100, 1, 1), Request(70, 5, 2)
TARGETS = (LONG, CHUNK)
SHORT = tuple(Request(20 + 9 * i, 1, 10 + i) for i in range(3))
PREFILL = Request(128, 128, 30)  # enough query rows to change the default's rows per program
CROWD = tuple(Request(17, 1, 40 + i) for i in range(6))  # enough programs not to split
LONGER = Request(1700, 1, 50)  # more splits in the launch than LONG needs
# name: (the batch's requests in order, padding rows)
BATCHES = {
    "alone": ([LONG, CHUNK], 0),
    "among-others": ([SHORT[0], LONG, SHORT[1], CHUNK, SHORT[2]], 0),
    "padded": ([LONG, CHUNK, SHORT[0]], 7),
    "reordered": ([SHORT[2], CHUNK, SHORT[1], LONG], 0),
    "beside-a-prefill": ([PREFILL, LONG, CHUNK], 0),
    "in-a-crowd": ([*CROWD[:3], LONG, CHUNK, *CROWD[3:]], 0),
    "beside-a-longer-request": ([CHUNK, LONGER, LONG], 0),
}


def _tensors(spec: AttentionSpec, request: Request) -> tuple[torch.Tensor, ...]:
    """K, V [seq_len, Hkv, D] and Q [query_len, Hq, D] of a request, from its seed."""
    gen = torch.Generator().manual_seed(request.seed)
    kv_shape = (request.seq_len, spec.num_kv_heads, spec.head_size)
    k, v = (torch.randn(kv_shape, generator=gen).to(spec.dtype) for _ in range(2))
    q = torch.randn(request.query_len, spec.num_heads, spec.head_size, generator=gen)
    return k, v, q.to(spec.dtype)


def request_outputs(
    backend: pagedkv.AttentionBackend,
    spec: AttentionSpec,
    batch: list[Request],
    num_padding_tokens: int = 0,
) -> tuple[list[torch.Tensor], object]:
    """Each request's output rows [query_len, Hq, D] when ``batch`` runs as one step,
    and the step's metadata. Physical blocks are handed out in reverse, so a request's
    blocks differ from batch to batch (only their contents are the same)."""
    bs = spec.block_size
    needed = [-(-r.seq_len // bs) for r in batch]
    num_blocks = 1 + sum(needed)
    free = list(range(num_blocks - 1, 0, -1))
    block_ids = []
    for n in needed:
        block_ids.append(free[:n])
        free = free[n:]
    cache = backend.allocate_kv_cache(num_blocks, spec, DEVICE)
    k_view, v_view = backend.kv_cache_to_logical(cache, spec)
    queries = []
    for request, ids in zip(batch, block_ids, strict=True):
        k, v, q = _tensors(spec, request)
        idx = torch.tensor(ids, device=DEVICE)
        for view, x in ((k_view, k), (v_view, v)):
            rows = torch.zeros(len(ids) * bs, *x.shape[1:], dtype=x.dtype)
            rows[: request.seq_len] = x
            view[idx] = rows.view(len(ids), bs, *x.shape[1:]).to(DEVICE)
        queries.append(q)
    num_tokens = sum(r.query_len for r in batch) + num_padding_tokens
    common = CommonAttentionMetadata.from_requests(
        [r.seq_len for r in batch],
        [r.query_len for r in batch],
        block_ids,
        bs,
        DEVICE,
        num_tokens=num_tokens,
    )
    query = torch.zeros(num_tokens, spec.num_heads, spec.head_size, dtype=spec.dtype)
    query[: num_tokens - num_padding_tokens] = torch.cat(queries)
    metadata = backend.make_builder(spec, DEVICE).build(common)
    out = backend.make_impl(spec).forward(query.to(DEVICE), None, None, cache, metadata)
    starts = common.query_start_loc_cpu.tolist()
    return [out[starts[i] : starts[i + 1]].cpu() for i in range(len(batch))], metadata


def target_outputs(backend: pagedkv.AttentionBackend, spec: AttentionSpec) -> dict:
    """{batch name: ([each target's output], metadata)} over BATCHES."""
    out = {}
    for name, (batch, padding) in BATCHES.items():
        rows, metadata = request_outputs(backend, spec, batch, padding)
        out[name] = ([rows[batch.index(t)] for t in TARGETS], metadata)
    return out


def max_difference(results: dict) -> float:
    """The largest |difference| of a target's output from its output alone."""
    alone = results["alone"][0]
    return max(
        float((got.double() - want.double()).abs().max())
        for outputs, _ in results.values()
        for got, want in zip(outputs, alone, strict=True)
    )


SPEC = AttentionSpec(num_heads=2, num_kv_heads=1, head_size=32, dtype=torch.float32, block_size=16)
# bfloat16 needs a GPU (Triton's interpreter computes it wrongly)
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch_invariant_outputs_are_bitwise_identical(dtype):
    spec = SPEC.replace(dtype=dtype)
    backend = pagedkv.get_backend("triton", batch_invariant=True)
    assert backend.capabilities.batch_invariant
    results = target_outputs(backend, spec)
    alone = results["alone"][0]
    for name, (outputs, _) in results.items():
        for target, got, want in zip(TARGETS, outputs, alone, strict=True):
            assert torch.equal(got, want), (
                f"{name}: {target} differs from its output alone by "
                f"{float((got.double() - want.double()).abs().max()):.3g}"
            )
    # and it is attention: the long decode against the torch backend
    torch_rows, _ = request_outputs(pagedkv.get_backend("torch"), spec, list(TARGETS))
    # bf16 keeps 8 mantissa bits: its outputs round at ~4e-3 of their magnitude
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for got, want in zip(alone, torch_rows, strict=True):
        assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_default_plans_differ_between_batches(dtype, capsys):
    """Without the option the same batches change the tiles and the split decision
    (so the test above exercises both); how far the outputs move is reported."""
    spec = SPEC.replace(dtype=dtype)
    backend = pagedkv.get_backend("triton")
    assert not backend.capabilities.batch_invariant
    results = target_outputs(backend, spec)
    plans = {
        name: [(str(p.plan.tile), p.plan.num_splits) for p in md.parts]
        for name, (_, md) in results.items()
    }
    launches = [launch for parts in plans.values() for launch in parts]
    assert len({splits for _, splits in launches}) > 1, plans
    if dtype != torch.float32:  # fp32 programs keep the fewest rows in every batch
        assert len({tile for tile, _ in launches}) > 1, plans
    with capsys.disabled():
        print(
            f"\n[triton default, {dtype}] max |output - output alone| over the batches: "
            f"{max_difference(results):.3g} (plans: {plans})"
        )


def test_batch_invariant_excludes_forced_splits():
    with pytest.raises(pagedkv.ConfigError, match="num_splits and batch_invariant"):
        pagedkv.get_backend("triton", batch_invariant=True, num_splits=4)
    builder = pagedkv.get_backend("triton", batch_invariant=True).make_builder(SPEC, DEVICE)
    step = CommonAttentionMetadata.from_requests([40], [1], [[1, 2, 3]], 16, DEVICE)
    with pytest.raises(pagedkv.ConfigError, match="num_splits=2: a batch-invariant plan"):
        builder.build(step, num_splits=2)
    assert pagedkv.get_backend("triton", batch_invariant="true").capabilities.describe()[
        "batch_invariant"
    ]
