"""The Triton backend against the float64 reference, on shuffled physical blocks.

On a CPU the kernels run in Triton's interpreter (enabled below, before the kernel
modules are first imported): float16/float32 only, small shapes. On a GPU the same
scenarios run compiled, bfloat16 included.
"""

from __future__ import annotations

import os

import pagedkv
import pytest
import torch
from pagedkv import AttentionSpec, ConfigError, MetadataError, UnsupportedError
from pagedkv.backends.triton.builder import TritonMetadataBuilder
from pagedkv.backends.triton.configs import SPLIT_POLICY, TILES, choose_num_splits, select_tile
from pagedkv.conformance import Scenario, run_scenario

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"

MIXED = dict(seq_lens=(1, 17, 33, 64, 40, 5), query_lens=(1, 17, 5, 1, 8, 0))
DECODE = dict(seq_lens=(97, 3, 200, 64), query_lens=(1, 1, 1, 1))
# lengths one short of, at and one past the key tiles (16 to 128 keys): off-by-one traps
EDGES = dict(seq_lens=(127, 128, 129, 63, 65, 15), query_lens=(1, 1, 1, 1, 1, 1))
SCENARIOS = [
    Scenario("mixed-fp16", **MIXED, num_padding_tokens=3),
    Scenario("mixed-fp32-gqa5", **MIXED, num_heads=10, num_kv_heads=2, dtype=torch.float32),
    Scenario("mqa-head128", **MIXED, num_heads=8, num_kv_heads=1, head_size=128),
    Scenario("mha", **MIXED, num_heads=4, num_kv_heads=4),
    Scenario("decode", **DECODE),
    Scenario("decode-tile-edges", **EDGES),
    Scenario("decode-tile-edges-fp32", **EDGES, dtype=torch.float32, head_size=128),
    Scenario("prefill-q-block-edges", seq_lens=(131, 64), query_lens=(100, 64)),
    Scenario("spec-decode-4", seq_lens=(40, 90), query_lens=(4, 4)),
    Scenario("prefill-block32", seq_lens=(70, 9), query_lens=(70, 9), block_size=32),
    Scenario("chunked-prefill-block48", seq_lens=(150, 20), query_lens=(37, 20), block_size=48),
    Scenario("block128-tile-inside-page", seq_lens=(300, 5), query_lens=(2, 5), block_size=128),
    Scenario("head32", **MIXED, head_size=32),
    Scenario("head80", **MIXED, head_size=80),
    Scenario(
        "head256-fp32", seq_lens=(40, 3), query_lens=(2, 3), head_size=256, dtype=torch.float32
    ),
    Scenario("window-smaller-than-block", **MIXED, sliding_window=5),
    # windows whose first key lands on a tile boundary (tiles of 64 and 128 keys)
    Scenario("window-several-tiles", seq_lens=(300, 70), query_lens=(3, 70), sliding_window=107),
    Scenario("decode-window-tile-edge", seq_lens=(300, 200), query_lens=(1, 1), sliding_window=43),
    Scenario("softcap", **MIXED, logits_soft_cap=5.0),
    Scenario("alibi", **MIXED, alibi=True),
    Scenario("sinks", **MIXED, use_sinks=True),
    Scenario("non-causal", seq_lens=(30, 12), query_lens=(20, 12), causal=False),
    Scenario(
        "non-causal-window", seq_lens=(30, 12), query_lens=(30, 12), causal=False, sliding_window=9
    ),
    Scenario("fp8-e4m3", **MIXED, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0),
    Scenario("fp8-e5m2", **MIXED, kv_cache_dtype="fp8_e5m2", k_scale=0.25, v_scale=1.5),
    Scenario(
        "everything",
        **MIXED,
        sliding_window=20,
        logits_soft_cap=30.0,
        alibi=True,
        use_sinks=True,
        dtype=torch.float32,
    ),
]
# flash-decoding: every split count must give the single-pass answer
SPLIT_SCENARIOS = [
    (3, Scenario("split3-mixed", **MIXED, num_padding_tokens=2)),
    (4, Scenario("split4-decode-sinks", **DECODE, use_sinks=True)),
    (2, Scenario("split2-window-fp32", **DECODE, sliding_window=70, dtype=torch.float32)),
    (5, Scenario("split5-fp8", **DECODE, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0)),
    (
        3,
        Scenario(
            "split3-everything",
            **MIXED,
            logits_soft_cap=30.0,
            alibi=True,
            use_sinks=True,
            sliding_window=40,
        ),
    ),
]
BF16 = [
    s.replace(name=s.name + "-bf16", dtype=torch.bfloat16)
    for s in SCENARIOS
    if s.dtype == torch.float16
]


def _check(scenario: Scenario, **options: object) -> None:
    backend = pagedkv.get_backend("triton", **options)
    result = run_scenario(backend, scenario, DEVICE, backend_label="triton")
    assert result.passed, result.report()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_matches_reference(scenario):
    _check(scenario)


@pytest.mark.parametrize(
    "splits, scenario", SPLIT_SCENARIOS, ids=[s.name for _, s in SPLIT_SCENARIOS]
)
def test_split_kv_matches_reference(splits, scenario):
    _check(scenario, num_splits=splits)


@pytest.mark.skipif(not ON_GPU, reason="bfloat16 needs a GPU (Triton's interpreter gets it wrong)")
@pytest.mark.parametrize("scenario", BF16, ids=lambda s: s.name)
def test_bfloat16_matches_reference(scenario):
    _check(scenario)


def test_automatic_split_on_a_long_decode():
    """One long sequence, few programs: the builder splits on its own and stays exact."""
    scenario = Scenario(
        "auto-split", seq_lens=(1200,), query_lens=(1,), num_heads=4, num_kv_heads=2
    )
    spec = scenario.spec()
    builder = TritonMetadataBuilder(spec, DEVICE)
    common = pagedkv.CommonAttentionMetadata.from_requests(
        [1200], [1], [list(range(1, 76))], 16, DEVICE
    )
    assert builder.build(common).num_splits > 1
    _check(scenario)


# -- decisions (host only) ------------------------------------------------------------------

H200_SMS = 132
SPEC = AttentionSpec(
    num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=16
)


class _H200Builder(TritonMetadataBuilder):
    def num_sms(self) -> int:
        return H200_SMS


@pytest.mark.parametrize(
    "num_seqs, seq_len, query_len, expect",
    [
        (64, 4096, 1, 1),  # 512 programs already fill the GPU
        (256, 1024, 1, 1),
        (4, 32768, 1, 17),  # 32 programs: split to fill 4 per SM
        (1, 32768, 1, 64),  # capped by max_splits
        (1, 700, 1, 1),  # too short to split
        (8, 2048, 2048, 1),  # prefill never splits
    ],
)
def test_split_choice(num_seqs, seq_len, query_len, expect):
    builder = _H200Builder(SPEC, "cpu")
    tile, block_q, splits = builder.choose(num_seqs, num_seqs * query_len, query_len, seq_len)
    assert splits == expect
    kind = "decode" if query_len == 1 else "prefill"
    if kind == "decode" and splits > 1:
        kind = "decode-split"
    assert tile == select_tile(kind, SPEC.head_size, SPEC.dtype, SPEC.kv_cache_dtype)
    assert block_q == tile.block_m // SPEC.num_queries_per_kv


def test_split_choice_is_monotone_in_batch_size():
    previous = SPLIT_POLICY.max_splits
    for programs in range(1, 600, 7):
        splits = choose_num_splits(SPLIT_POLICY, programs, 1, 1 << 20, H200_SMS)
        assert 1 <= splits <= previous
        previous = splits


def test_every_tile_fits_the_kernel_rules():
    for key, tile in TILES.items():
        assert tile.block_m >= 16 and tile.tile_n >= 16, key
        assert tile.block_m & (tile.block_m - 1) == 0 and tile.tile_n & (tile.tile_n - 1) == 0
        assert tile.num_warps in (1, 2, 4, 8, 16) and tile.num_stages >= 1


def test_forced_splits_option_is_checked():
    with pytest.raises(ConfigError, match="num_splits=65"):
        TritonMetadataBuilder(SPEC, "cpu", num_splits=65)
    with pytest.raises(ConfigError, match="expected an int"):
        pagedkv.get_backend("triton", num_splits="many")


def test_graph_buffers_keep_their_addresses_and_pad():
    builder = TritonMetadataBuilder(SPEC, "cpu")
    builder.reserve_cuda_graph(max_num_reqs=4, max_num_tokens=4, max_blocks_per_req=8)
    first = builder.build(
        pagedkv.CommonAttentionMetadata.from_requests([20, 33], [1, 1], [[3, 4], [5, 6, 7]], 16)
    )
    second = builder.build(
        pagedkv.CommonAttentionMetadata.from_requests(
            [5, 60, 2], [1, 1, 1], [[9], [1, 2, 3, 4], [8]], 16
        )
    )
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        assert getattr(first, name).data_ptr() == getattr(second, name).data_ptr(), name
    assert (first.num_seqs, first.num_tokens, first.tile) == (
        second.num_seqs,
        second.num_tokens,
        second.tile,
    )
    assert second.query_start_loc.tolist() == [0, 1, 2, 3, 3]
    assert second.seq_lens.tolist() == [5, 60, 2, 0]
    assert second.slot_mapping.tolist() == [9 * 16 + 4, 4 * 16 + 11, 8 * 16 + 1, -1]
    with pytest.raises(MetadataError, match="num_reqs = 5 exceeds the CUDA-graph reservation"):
        builder.build(
            pagedkv.CommonAttentionMetadata.from_requests([1] * 5, [1] * 5, [[1]] * 5, 16)
        )


# -- declared support ----------------------------------------------------------------------


def test_rejections_carry_reasons():
    backend = pagedkv.get_backend("triton")
    assert "head_size 36 not supported by triton" in backend.validate(SPEC.replace(head_size=36))[0]
    assert "head_size 512" in backend.validate(SPEC.replace(head_size=512))[0]
    assert "block_size 8 not supported" in backend.validate(SPEC.replace(block_size=8))[0]
    mla = AttentionSpec(
        num_heads=4,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.float16,
        block_size=16,
        scale=0.07,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
    )
    assert "MLA layers (kv_lora_rank set) are not supported by triton" in backend.validate(mla)
    if not ON_GPU:
        reasons = backend.validate(SPEC, "cpu")
        assert any("bfloat16 on cpu" in r for r in reasons)
        with pytest.raises(UnsupportedError, match="bfloat16 on cpu"):
            backend.make_builder(SPEC, "cpu")
    assert backend.validate(SPEC.replace(dtype=torch.float16), DEVICE) == []


def test_forward_argument_errors_name_the_argument():
    spec = SPEC.replace(dtype=torch.float16, num_heads=4, num_kv_heads=2, head_size=64)
    backend = pagedkv.get_backend("triton")
    md = backend.make_builder(spec, DEVICE).build(
        pagedkv.CommonAttentionMetadata.from_requests([3], [3], [[1]], 16, DEVICE)
    )
    impl = backend.make_impl(spec)
    q = torch.randn(3, 4, 64, device=DEVICE).half()
    kv = torch.randn(3, 2, 64, device=DEVICE).half()
    cache = backend.allocate_kv_cache(2, spec, DEVICE)
    with pytest.raises(
        UnsupportedError, match=r"kv_cache: expected shape \[2, num_blocks, 16, 2, 64\]"
    ):
        impl.forward(q, kv, kv, cache[:, :, :8], md)
    with pytest.raises(UnsupportedError, match="kv_cache: expected dtype torch.float16"):
        impl.forward(q, kv, kv, cache.float(), md)
    with pytest.raises(UnsupportedError, match=r"query: expected shape \[3, 4, 64\]"):
        impl.forward(q[:2], kv, kv, cache, md)
