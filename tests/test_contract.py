"""Contract v2 on the CPU: the shared forward and build, the step checks, CUDA-graph
staging semantics, and a backend written against the first contract still working."""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from pagedkv import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    Capabilities,
    CommonAttentionMetadata,
    GraphBounds,
    GraphSupport,
    MetadataError,
    UnsupportedError,
)
from pagedkv.backends.torch import TorchBackend
from pagedkv.backends.torch.builder import TorchMetadata
from pagedkv.conformance import Scenario, run_scenario
from pagedkv.reference import reference_attention
from pagedkv.step_check import full_validation

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32, block_size=4)


def _step(seq_lens, query_lens, blocks, **kw) -> CommonAttentionMetadata:
    return CommonAttentionMetadata.from_requests(seq_lens, query_lens, blocks, 4, **kw)


def _inputs(num_tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, 4, 16, generator=g)
    k = torch.randn(num_tokens, 2, 16, generator=g)
    v = torch.randn(num_tokens, 2, 16, generator=g)
    return q, k, v


# -- the step checks every build runs ------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(block_size=8), "built for blocks of 8 tokens, the layer's spec has block_size 4"),
        (
            dict(seq_lens_cpu=torch.tensor([9, 3], dtype=torch.int32)),
            "seq_lens\\[0\\] = 9 needs 3 blocks of 4 but block_table rows hold 2",
        ),
        (
            dict(query_start_loc_cpu=torch.tensor([0, 3, 2], dtype=torch.int32)),
            "non-decreasing",
        ),
        (
            dict(seq_lens_cpu=torch.tensor([1, 3], dtype=torch.int32)),
            "seq_lens\\[0\\] = 1 < query_len 2",
        ),
        (
            dict(slot_mapping=torch.zeros(3, dtype=torch.int64)),
            "5 scheduled tokens but slot_mapping \\(the token rows\\) has only 3",
        ),
        (
            dict(block_table=torch.zeros(2, 2, dtype=torch.int64)),
            "block_table: expected a 2-D torch.int32",
        ),
    ],
)
def test_build_refuses_metadata_that_would_corrupt(change, message):
    common = _step([6, 3], [2, 3], [[1, 2], [3]])
    builder = TorchBackend().make_builder(SPEC, "cpu")
    bad = dataclasses.replace(common, **change)
    with pytest.raises(MetadataError, match=message):
        builder.build(bad)


def test_strided_metadata_is_made_contiguous_before_the_write():
    backend = TorchBackend()
    common = _step([5, 2], [5, 2], [[1, 2], [3]])
    wide = torch.full((2 * common.num_tokens,), -7, dtype=torch.int64)
    wide[::2] = common.slot_mapping
    strided = dataclasses.replace(common, slot_mapping=wide[::2])
    assert not strided.slot_mapping.is_contiguous()
    cache = backend.allocate_kv_cache(5, SPEC, "cpu")
    q, k, v = _inputs(common.num_tokens)
    backend.make_impl(SPEC).forward(
        q, k, v, cache, backend.make_builder(SPEC, "cpu").build(strided)
    )
    k_view, _ = backend.kv_cache_to_logical(cache, SPEC)
    slots = common.slot_mapping
    assert torch.equal(k_view.reshape(-1, 2, 16)[slots], k)


def test_debug_switch_validates_block_ids_against_the_pool():
    backend = TorchBackend()
    common = _step([5], [5], [[1, 9]])  # block 9 of a 5-block pool
    builder, impl = backend.make_builder(SPEC, "cpu"), backend.make_impl(SPEC)
    cache = backend.allocate_kv_cache(5, SPEC, "cpu")
    with (
        full_validation(True),
        pytest.raises(MetadataError, match=r"block_table\[0, 1\] = 9 .* \[0, 5\)"),
    ):
        impl.forward(*_inputs(5), cache, builder.build(common))


def test_debug_switch_at_build_bounds_block_ids_below_only():
    # a builder does not know the pool's size: a negative id is refused as such, with no
    # made-up upper bound in the message (it once printed [0, 2**58 - 1))
    builder = TorchBackend().make_builder(SPEC, "cpu")
    common = _step([5], [5], [[1, 9]])
    negative = dataclasses.replace(common, block_table=torch.tensor([[-3, 9]], dtype=torch.int32))
    with full_validation(True):
        builder.build(common)  # block 9 passes: only the forward knows the pool's 5 blocks
        with pytest.raises(
            MetadataError, match=r"block_table\[0, 0\] = -3 .*expected a block id >= 0$"
        ):
            builder.build(negative)


def test_debug_switch_is_read_from_the_environment_at_import():
    code = "from pagedkv.step_check import full_validation_enabled as f; print(f())"
    for value, expected in (("1", "True"), ("on", "True"), ("", "False"), ("0", "False")):
        env = {**os.environ, "PAGEDKV_VALIDATE": value}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert run.stdout.strip() == expected, run.stderr


# -- the shared forward ---------------------------------------------------------------------


def test_forward_checks_the_cache_through_the_layout():
    backend = TorchBackend()
    impl = backend.make_impl(SPEC)
    md = backend.make_builder(SPEC, "cpu").build(_step([3], [3], [[1]]))
    half = torch.zeros(backend.get_kv_cache_shape(4, 4, 2, 16), dtype=torch.float16)
    with pytest.raises(UnsupportedError, match="kv_cache: expected dtype torch.float32"):
        impl.forward(*_inputs(3), half, md)


def test_cache_views_follow_the_cache_and_do_not_keep_it_alive():
    """The shared forward keeps a cache's logical views between calls: a write and the
    attention after it use the cache given, a new cache (or new storage behind the same
    tensor) gets new views, and a dropped cache is freed with its views."""
    backend = TorchBackend()
    impl, fresh = backend.make_impl(SPEC), backend.make_impl(SPEC)
    md = backend.make_builder(SPEC, "cpu").build(_step([3], [3], [[1]]))
    caches = [backend.allocate_kv_cache(4, SPEC, "cpu") for _ in range(2)]
    for seed, cache in enumerate(caches):
        out = impl.forward(*_inputs(3, seed), cache, md)
        want = fresh.forward(*_inputs(3, seed), backend.allocate_kv_cache(4, SPEC, "cpu"), md)
        assert torch.equal(out, want)
        assert impl.cache_views(cache).k.untyped_storage().data_ptr() == cache.data_ptr()
    first, second = caches
    assert not torch.equal(first, second)  # each took its own step's K/V
    second.set_(first.clone())  # the same tensor object over new storage
    k_view = impl.cache_views(second).k
    assert k_view.untyped_storage().data_ptr() == second.data_ptr() != first.data_ptr()
    ref = weakref.ref(second)
    del second, cache, caches, k_view
    gc.collect()
    assert ref() is None and impl._kept_views is None


def test_the_cache_writer_is_kept_with_the_caches_views():
    """``write_kv``'s writer is found once per cache (with its views) and made anew for
    another cache; what it writes is what a fresh impl writes."""
    backend = TorchBackend()
    impl, fresh = backend.make_impl(SPEC), backend.make_impl(SPEC)
    md = backend.make_builder(SPEC, "cpu").build(_step([3], [3], [[1]]))
    first, second = (backend.allocate_kv_cache(4, SPEC, "cpu") for _ in range(2))
    writer = impl.cache_writer(first)
    assert impl.cache_writer(first) is writer
    assert impl.cache_views(first).derived["writer"] is writer
    _, key, value = _inputs(3)
    impl.write_kv(key, value, first, md)
    assert impl.cache_writer(first) is writer
    assert impl.cache_writer(second) is not writer
    want = backend.allocate_kv_cache(4, SPEC, "cpu")
    fresh.write_kv(key, value, want, md)
    assert torch.equal(first, want) and not torch.equal(second, want)


def test_a_step_of_no_token_rows_writes_and_attends_nothing():
    # a kernel launcher may reject zero rows (JAX's Pallas raised from inside its gather):
    # the shared forward never asks one for them, and still checks its arguments
    class Refuses(type(TorchBackend().make_impl(SPEC))):
        def attend(self, *args):
            raise AssertionError("attend was called with zero rows")

        def write_kv(self, *args):
            raise AssertionError("write_kv was called with zero rows")

    backend = TorchBackend()
    impl = Refuses(SPEC, cache_layout=backend.make_impl(SPEC).cache_layout)
    md = backend.make_builder(SPEC, "cpu").build(_step([0], [0], [[]]))
    cache = backend.allocate_kv_cache(2, SPEC, "cpu")
    out = impl.forward(*_inputs(0), cache, md)
    assert tuple(out.shape) == (0, 4, 16)
    with pytest.raises(UnsupportedError, match="query: expected shape \\[0, 4, 16\\]"):
        impl.forward(*_inputs(1), cache, md)


def test_parts_must_implement_their_method():
    class NoAttend(AttentionImpl[Any]):
        pass

    class NoBuild(AttentionMetadataBuilder[Any]):
        pass

    with pytest.raises(TypeError, match="must implement attend"):
        NoAttend(SPEC)
    with pytest.raises(TypeError, match="must implement build_metadata"):
        NoBuild(SPEC, "cpu")


def test_forward_refuses_metadata_its_builder_did_not_build():
    backend = TorchBackend()
    common = _step([5, 3], [1, 3], [[1, 2], [3]])
    cache = backend.allocate_kv_cache(5, SPEC, "cpu")
    impl = backend.make_impl(SPEC)
    assert type(impl).metadata_class is TorchMetadata  # M of AttentionImpl[TorchMetadata]
    before = cache.clone()
    # the step itself, the build forgotten; another backend's metadata; no metadata at all
    first_contract = FirstContractBackend().make_builder(SPEC, "cpu").build(common)
    for wrong in (common, first_contract, object()):
        name = type(wrong).__name__
        with pytest.raises(
            UnsupportedError, match=f"metadata: expected the TorchMetadata .* got {name}"
        ):
            impl.forward(*_inputs(4), cache, wrong)
    assert torch.equal(cache, before)  # refused before the write
    # an impl that leaves M open takes what its builder builds, and still refuses an
    # object that is no step's metadata by name
    assert _FirstContractImpl.metadata_class is None
    open_impl = FirstContractBackend().make_impl(SPEC)
    with pytest.raises(UnsupportedError, match="metadata: expected a builder's step metadata"):
        AttentionImpl.forward(open_impl, *_inputs(4), cache, object())


@pytest.mark.parametrize("num_blocks", [0, -1, 2.0, True, "3", None])
def test_a_cache_of_no_blocks_or_of_a_non_count_is_refused(num_blocks):
    with pytest.raises(
        UnsupportedError, match=f"num_blocks: expected a positive int, got {num_blocks!r}"
    ):
        TorchBackend().allocate_kv_cache(num_blocks, SPEC, "cpu")


@pytest.mark.parametrize(
    "src, dst, message",
    [
        ([1], [9], r"dst\[0\] = 9 is out of range: expected a block id in \[0, 4\)"),
        (torch.tensor([1, -2]), [2, 3], r"src\[1\] = -2 is out of range"),
    ],
)
def test_copy_blocks_refuses_ids_past_the_pool(src, dst, message):
    # on a GPU such an id is a device-side assert in index_copy_, which ends the process's
    # CUDA context: host ids are checked before they are sent
    cache = TorchBackend().allocate_kv_cache(4, SPEC, "cpu")
    with pytest.raises(UnsupportedError, match=message):
        TorchBackend().copy_blocks(cache, src, dst)


def test_a_cache_takes_any_integer_count():
    assert TorchBackend().allocate_kv_cache(np.int64(3), SPEC, "cpu").shape[1] == 3


# -- CUDA-graph staging (the mechanics, runnable on a CPU) ---------------------------------


class _GraphTorch(TorchBackend):
    """The torch kernel over staged metadata: checks the padding semantics of
    reserve_cuda_graph without a GPU."""

    name = "graph_torch"
    capabilities = dataclasses.replace(TorchBackend.capabilities, cuda_graph=GraphSupport.MIXED)


def test_reserved_builds_reuse_buffers_and_pad_to_the_bounds():
    backend = _GraphTorch()
    builder, impl = backend.make_builder(SPEC, "cpu"), backend.make_impl(SPEC)
    bounds = GraphBounds(max_num_reqs=4, max_num_tokens=12, max_blocks_per_req=4, max_query_len=5)
    builder.reserve_cuda_graph(bounds)
    cache = backend.allocate_kv_cache(16, SPEC, "cpu")
    eager_cache = cache.clone()
    eager = TorchBackend().make_builder(SPEC, "cpu")
    ptrs = None
    for step, (seqs, qlens, blocks) in enumerate(
        [([5, 9], [5, 2], [[1, 2], [3, 4, 5]]), ([13, 1, 2], [1, 1, 2], [[6, 7, 8, 9], [10], [11]])]
    ):
        common = _step(seqs, qlens, blocks)
        md: TorchMetadata = builder.build(common)
        staged = md.common
        assert staged.num_tokens == 12 and staged.num_reqs == 4
        assert staged.max_query_len == 5 and staged.max_seq_len == 16
        assert staged.slot_mapping[common.num_tokens :].eq(-1).all()
        now = tuple(
            t.data_ptr()
            for t in (
                staged.query_start_loc,
                staged.seq_lens,
                staged.block_table,
                staged.slot_mapping,
            )
        )
        assert ptrs is None or now == ptrs  # the same buffers every step
        ptrs = now
        q, k, v = _inputs(12, seed=step)
        out = impl.forward(q, k, v, cache, md)
        n = common.num_tokens
        want = impl.forward(q[:n], k[:n], v[:n], eager_cache, eager.build(common))
        assert torch.equal(out[:n], want)
    assert torch.equal(cache, eager_cache)


def test_reservation_bounds_are_enforced_and_declared_support_checked():
    builder = _GraphTorch().make_builder(SPEC, "cpu")
    builder.reserve_cuda_graph(GraphBounds(max_num_reqs=2, max_num_tokens=4, max_blocks_per_req=2))
    with pytest.raises(MetadataError, match="max_query_len = 3 exceeds the CUDA-graph reservation"):
        builder.build(_step([3], [3], [[1]]))
    with pytest.raises(MetadataError, match="needs 3 blocks .* holds 2 per request"):
        builder.build(_step([9], [1], [[1, 2, 3]]))
    with pytest.raises(UnsupportedError, match="declares graph support never"):
        TorchBackend().make_builder(SPEC, "cpu").reserve_cuda_graph(
            GraphBounds(max_num_reqs=2, max_num_tokens=2, max_blocks_per_req=2)
        )


# -- a backend written against the first contract -----------------------------------------


class _FirstContractBuilder(AttentionMetadataBuilder[Any]):
    def build(self, common):
        return common


class _FirstContractImpl(AttentionImpl[Any]):
    """Overrides forward and write_kv, as the first contract required."""

    def write_kv(self, key, value, kv_cache, metadata):
        slots = metadata.slot_mapping
        rows = (slots >= 0).nonzero().squeeze(1)
        flat = kv_cache.view(kv_cache.shape[0], 2, -1, *kv_cache.shape[3:])
        b, o = slots[rows] // self.spec.block_size, slots[rows] % self.spec.block_size
        flat[b, 0, o] = key[rows].to(kv_cache.dtype)
        flat[b, 1, o] = value[rows].to(kv_cache.dtype)

    def forward(self, query, key, value, kv_cache, metadata, output=None):
        if key is not None:
            self.write_kv(key, value, kv_cache, metadata)
        out = self.new_output(query, output)
        k = kv_cache[:, 0].flatten(0, 1)
        v = kv_cache[:, 1].flatten(0, 1)
        qsl, seq = metadata.query_start_loc_cpu.tolist(), metadata.seq_lens_cpu.tolist()
        for i, s in enumerate(seq):
            ids = metadata.block_table[i, : -(-s // self.spec.block_size)].long()
            slots = (
                ids[:, None] * self.spec.block_size + torch.arange(self.spec.block_size)
            ).flatten()[:s]
            q_len = qsl[i + 1] - qsl[i]
            o = reference_attention(
                query[qsl[i] : qsl[i + 1]], [k[slots]], [v[slots]], [q_len], self.spec
            )
            out[qsl[i] : qsl[i + 1]] = o.to(out.dtype)
        return out


class FirstContractBackend(AttentionBackend):
    name = "first_contract"
    layout = "(num_blocks, 2, block_size, num_kv_heads, head_size)"
    block_axis = 0
    capabilities = Capabilities(dtypes=frozenset({torch.float32, torch.float16}))

    def get_kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    def kv_cache_to_logical(self, kv_cache, spec):
        return kv_cache[:, 0], kv_cache[:, 1]

    def get_builder_cls(self):
        return _FirstContractBuilder

    def get_impl_cls(self):
        return _FirstContractImpl


def test_a_first_contract_backend_keeps_working():
    backend = FirstContractBackend()
    assert backend.layout == "(num_blocks, 2, block_size, num_kv_heads, head_size)"
    assert backend.block_axis == 0
    scenario = Scenario(
        "first-contract", seq_lens=(20, 33, 7), query_lens=(1, 33, 3), dtype=torch.float32
    )
    result = run_scenario(backend, scenario, "cpu")
    assert result.passed, result.report()
    cache = backend.allocate_kv_cache(4, SPEC, "cpu")
    cache[1].fill_(3.0)
    backend.copy_blocks(cache, torch.tensor([1]), torch.tensor([2]))
    assert cache[2].eq(3.0).all() and cache[3].eq(0).all()


def test_a_staged_step_pads_as_a_fresh_staging_would():
    """The persistent buffers write a padding tail only where the last step's does not
    already hold it: after any sequence of steps they hold what staging the step into
    new buffers gives (padding requests of no keys and the step's token count, padding
    slots -1)."""
    import random

    from pagedkv.graph import GraphStaging

    bounds = GraphBounds(max_num_reqs=6, max_num_tokens=16, max_blocks_per_req=4, max_query_len=4)
    kept = GraphStaging(bounds, 4, torch.device("cpu"))
    rng = random.Random(0)
    for _ in range(60):
        num_reqs = rng.randint(0, 6)
        query_lens = [rng.randint(0 if num_reqs > 1 else 1, 4) for _ in range(num_reqs)]
        while sum(query_lens) > 12:
            query_lens[query_lens.index(max(query_lens))] -= 1
        seq_lens = [q + rng.randint(0, 16 - q) for q in query_lens]
        blocks = [list(range(1 + 4 * i, 1 + 4 * i + -(-s // 4))) for i, s in enumerate(seq_lens)]
        padded = sum(query_lens) + rng.randint(0, 16 - sum(query_lens))
        common = _step(seq_lens, query_lens, blocks, num_tokens=padded)
        staged = kept.stage(common)
        fresh = GraphStaging(bounds, 4, torch.device("cpu")).stage(common)
        for name in ("query_start_loc", "seq_lens", "slot_mapping"):
            assert torch.equal(getattr(staged, name), getattr(fresh, name)), name
        rows = staged.block_table[:num_reqs, : common.block_table.shape[1]]
        assert torch.equal(rows, fresh.block_table[:num_reqs, : common.block_table.shape[1]])
        assert torch.equal(staged.query_start_loc_cpu, fresh.query_start_loc_cpu)
        assert torch.equal(staged.seq_lens_cpu, fresh.seq_lens_cpu)
