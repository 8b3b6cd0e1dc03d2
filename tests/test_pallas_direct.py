"""The Pallas backend's direct launcher without a GPU: JAX's lowering is caught and
Triton compiles it for sm_90 (every kernel variant), the launcher option's rules, the
CUDA-graph plan (split slots from the bounds, persistent step arrays). Its launches run
in tests/test_pallas_gpu.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pagedkv
import pytest
import torch
from pagedkv import AttentionSpec, CommonAttentionMetadata
from pagedkv.errors import ConfigError, UnsupportedError
from pagedkv.graph import GraphBounds, GraphSupport

pytest.importorskip("jax")
pytest.importorskip("triton")

from pagedkv.backends.pallas import configs, direct
from pagedkv.backends.pallas.builder import num_tiles_bound
from pagedkv.backends.pallas.lowering import VARIANTS
from triton_compile import SM90_MAX_SHARED, _loop_spills


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_is_caught_and_compiles_for_sm90(name):
    cfg, dtype, cache_dtype = VARIANTS[name]
    cfg = replace(cfg, num_warps=configs.num_warps(cfg.block_m, cfg.head_size))  # the impl's
    shape = direct.LaunchShape(
        cfg,
        num_tokens=64,
        num_tiles=24,
        num_reqs=8,
        table_width=32,
        cache_shape=(512, cfg.block_size, 2 * cfg.num_kv_heads, cfg.head_size),
        dtype=dtype,
        cache_dtype=cache_dtype,
    )
    module = direct.lower(shape)
    assert module.grid == (24, cfg.num_kv_heads, cfg.split_slots)
    # the kernel's parameters: 6 step arrays, slopes, sinks, q, kv, 1 or 2 outputs
    outputs = 2 if cfg.split_slots > 1 else 1
    assert module.text.count("!tt.ptr<") >= 10 + outputs
    compiled = direct.compile_module(module, cfg, (9, 0))
    assert compiled.metadata.name == cfg.name
    assert compiled.metadata.shared <= SM90_MAX_SHARED
    # the rule of every kernel here: no spill inside a loop (tests/test_triton_compile.py)
    assert _loop_spills(compiled.asm["cubin"]) in (0, None), name


def test_launcher_rules():
    cpu = torch.device("cpu")
    assert direct.resolve_launcher("auto", cpu) == "jax"  # interpret mode runs through JAX
    assert direct.resolve_launcher("jax", torch.device("cuda", 0)) == "jax"
    with pytest.raises(UnsupportedError, match="launcher=direct on cpu"):
        direct.resolve_launcher("direct", cpu)
    with pytest.raises(ConfigError, match="launcher"):
        direct.resolve_launcher("xla", cpu)
    with pytest.raises(ConfigError, match="launcher"):
        pagedkv.get_backend("pallas", launcher="xla")


def test_graph_support_follows_the_launcher():
    assert pagedkv.get_backend("pallas").capabilities.graph_support is GraphSupport.MIXED
    jax_runtime = pagedkv.get_backend("pallas", launcher="jax")
    assert jax_runtime.capabilities.graph_support is GraphSupport.NEVER
    assert "JAX's stream" in jax_runtime.capabilities.notes[0]


def test_graph_split_slots_stay_within_the_partial_budget_and_the_waves():
    def slots(tokens: int, query_len: int = 1, kv_heads: int = 8) -> tuple[int, int]:
        bounds = GraphBounds(tokens, tokens, 256, max_query_len=query_len)
        block_q = configs.block_q(query_len, configs.padded_group(32 // kv_heads))
        tiles = num_tiles_bound(tokens, tokens // query_len, block_q)
        chosen = configs.graph_split_slots(
            bounds, num_heads=32, num_kv_heads=kv_heads, head_size=128, num_tiles=tiles,
            num_sms=132,
        )  # fmt: skip
        return chosen, tiles * kv_heads

    wave = configs.PROGRAMS_PER_SM * 132
    assert slots(1)[0] == configs.SPLIT_POLICY.max_splits  # one long decode: every split
    assert slots(4)[0] == configs.SPLIT_POLICY.max_splits
    # 64 decodes: 512 programs a slot, 16 waves of 528 programs hold 16 slots
    assert slots(64)[0] == 16
    # 256 decodes: 4.2 MB of partials a slot (15 fit in 64 MiB), 2048 programs (4 slots)
    assert slots(256)[0] == 4
    assert slots(256, query_len=4)[0] == 8  # speculative decoding: 1024 programs a slot
    # a mixed step's bounds (17 requests, one of them a 256-token chunk): 34 tiles
    assert slots(272, query_len=16)[0] == 8
    for tokens in (1, 3, 64, 200, 1024, 8192):
        for kv_heads in (1, 8, 32):
            s, programs = slots(tokens, kv_heads=kv_heads)
            assert s & (s - 1) == 0
            if s > 1:
                assert s * tokens * 32 * 129 * 4 <= configs.GRAPH_PARTIAL_BYTES
                assert s * programs <= configs.GRAPH_PROGRAM_WAVES * wave


def _common(seq_lens, query_lens, width=40):
    ids = [list(range(1 + i * width, 1 + i * width + -(-n // 16))) for i, n in enumerate(seq_lens)]
    return CommonAttentionMetadata.from_requests(list(seq_lens), list(query_lens), ids, 16, "cpu")


def test_graph_steps_share_one_launch_shape_and_persistent_arrays():
    """Under a reservation every step gets the bounds' tile height and split slots, its
    split count within them, and its tile arrays in the same buffer (views, so that a
    replay reads the step built last)."""
    spec = AttentionSpec(
        num_heads=8, num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=16
    )
    backend = pagedkv.get_backend("pallas")
    builder = backend.make_builder(spec, "cpu")
    bounds = GraphBounds(max_num_reqs=4, max_num_tokens=8, max_blocks_per_req=40, max_query_len=4)
    builder.reserve_cuda_graph(bounds)
    long_decode = builder.build(_common([600], [1]))
    mixed = builder.build(_common([20, 7, 300], [4, 1, 2]))
    slots = long_decode.split_slots
    for md in (long_decode, mixed):
        assert md.split_slots == slots
        assert 1 <= md.num_splits <= slots
        # the tile height of the bounds' longest query, whatever the step's
        assert md.block_q == configs.block_q(4, configs.padded_group(spec.num_queries_per_kv))
    assert long_decode.block_q == mixed.block_q
    pointer = lambda a: a.unsafe_buffer_pointer()  # noqa: E731
    assert pointer(long_decode.arrays.tile_req) == pointer(mixed.arrays.tile_req)
    # the first step's views read the second step's tiles
    assert np.array_equal(
        np.asarray(long_decode.arrays.tile_req), np.asarray(mixed.arrays.tile_req)
    )


def test_idle_split_slots_leave_the_result_unchanged():
    """Under a reservation a step using 2 of the launch's slots: the idle programs mark
    their rows empty without attending, and the merge gives the eager step's result
    (interpret mode, the kernel and combine the GPU runs)."""
    spec = AttentionSpec(
        num_heads=8, num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=16
    )
    backend = pagedkv.get_backend("pallas", num_splits=2)
    cache = backend.allocate_kv_cache(1 + 4 * 40, spec, "cpu")
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(0)))
    impl = backend.make_impl(spec)
    step = _common([600, 33, 1, 200], [1, 1, 1, 1])
    query = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))
    eager = impl.forward(query, None, None, cache, backend.make_builder(spec, "cpu").build(step))
    builder = backend.make_builder(spec, "cpu")
    builder.reserve_cuda_graph(GraphBounds(4, 4, 40))
    md = builder.build(step)
    assert md.num_splits == 2 < md.split_slots
    graphed = impl.forward(query, None, None, cache, md)
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
    unsplit = pagedkv.get_backend("pallas", num_splits=1)
    alone = unsplit.make_impl(spec).forward(
        query, None, None, cache, unsplit.make_builder(spec, "cpu").build(step)
    )
    torch.testing.assert_close(eager, alone, rtol=1e-5, atol=1e-5)
