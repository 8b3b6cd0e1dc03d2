"""benchmarks/triton_sweep.py: the occupancy it records for each compiled variant, the
key ranges it times and their plans (the sweep itself needs a GPU)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    return runpy.run_path(str(SCRIPT), run_name="triton_sweep")


def test_occupancy_unknown_without_a_compiled_kernel(sweep):
    assert sweep["occupancy"](None, 4) == (None, None)


def test_key_ranges_cover_the_rules_candidates(sweep):
    """--key-ranges times 1-1.75x each power of two of the key step (what the eager
    rule compares), within the rule's bounds; a step with chunks gets none."""
    from types import SimpleNamespace

    from pagedkv.backends.triton.configs import EAGER_RANGE_MULTIPLES, SPLIT_POLICY
    from pagedkv.bench.workloads import MATRICES

    rows = {w.name: w for w in MATRICES["standard"]}
    ragged = SimpleNamespace(workload=rows["ragged-decode-128"])
    keys = sweep["candidate_key_ranges"](ragged, 64)
    longest = max(ragged.workload.seq_lens)
    assert keys == sorted(set(keys)) and {512, 640, 768, 896, 1024, 1280} <= set(keys)
    for k in keys:
        assert k % 64 == 0 and SPLIT_POLICY.min_keys_per_split <= k < longest
        assert -(-longest // k) <= SPLIT_POLICY.max_splits
        assert any(k == 64 * m * (1 << p) for m in EAGER_RANGE_MULTIPLES for p in range(10))
    chunked = SimpleNamespace(workload=rows["mixed-16d+1chunk"])
    assert sweep["candidate_key_ranges"](chunked, 64) == []


def test_a_key_range_variant_is_planned_as_fixed_ranges(sweep, monkeypatch):
    """``Bench.launches(tile, 0, keys)`` plans the step with ranges of ``keys`` keys
    (planned only: the CPU does not time)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from pagedkv.bench.workloads import Layer, Workload

    layer = Layer(num_heads=4, num_kv_heads=2, head_size=32, dtype="fp16")
    workload = Workload("tiny-ragged", "ragged-decode", (1500, 40, 700), (1, 1, 1), layer)
    bench = sweep["Bench"](sweep["build_problem"](workload, device="cpu"))
    tile = bench.default[0]
    keys = 8 * tile.tile_n
    launches = bench.launches(tile, 0, keys)
    assert launches and all(callable(launch) for launch in launches)
    md = bench.builder.build(bench.problem.common, tile=tile, keys_per_split=keys)
    assert md.plan.trim_splits and md.plan.tiles_per_split == 8


def test_stages_and_key_steps_choose_the_candidate_tiles(sweep):
    """``--stages`` / ``--tile-n`` replace the stages and key steps tried (Triton gives
    the gathered K/V two buffers only from 5 stages on, so the default 1-3 never
    compares double buffering); ``--quick`` keeps the rule's rows, 2 stages."""
    from types import SimpleNamespace

    bench = SimpleNamespace(problem=SimpleNamespace(spec=SimpleNamespace(num_queries_per_kv=4)),
                            block_m=16)  # fmt: skip
    quick = sweep["candidate_tiles"](bench, True)
    assert {(t.block_m, t.num_stages) for t in quick} == {(16, 2)}
    tiles = sweep["candidate_tiles"](bench, True, (2, 5, 7), (32, 64))
    assert {(t.tile_n, t.num_stages) for t in tiles} == {
        (n, s) for n in (32, 64) for s in (2, 5, 7)
    }
    wide = sweep["candidate_tiles"](bench, False)
    assert {t.num_stages for t in wide} == {1, 2, 3} and {t.block_m for t in wide} == {16, 32}


def test_tiles_are_compared_on_the_rules_key_ranges(sweep):
    """A tile whose key step divides the rule's fixed range is timed on those ranges at the
    rule's count; other counts and other steps take even shares."""
    from types import SimpleNamespace

    from pagedkv.backends.triton.configs import TileConfig

    rule = TileConfig(16, 64, 4, 2)
    bench = SimpleNamespace(default=(rule, 6), default_keys=576)
    rule_keys = sweep["Bench"].rule_keys
    assert rule_keys(bench, TileConfig(16, 64, 4, 5), 6) == 576
    assert rule_keys(bench, TileConfig(16, 32, 4, 2), 6) == 576
    assert rule_keys(bench, TileConfig(16, 128, 4, 2), 6) == 0  # 576 is 4.5 steps of 128
    assert rule_keys(bench, rule, 4) == 0
    assert rule_keys(SimpleNamespace(default=(rule, 2), default_keys=0), rule, 2) == 0


def test_workloads_are_named_or_matched(sweep):
    """``--workloads`` takes names and patterns, in the matrix's order; one that matches
    nothing stops with the known names."""
    select = sweep["select_workloads"]
    assert select("decode-1x32k,decode-64x4096") == ["decode-64x4096", "decode-1x32k"]
    ragged = select("ragged-*")
    assert "ragged-decode-128" in ragged and all(n.startswith("ragged-") for n in ragged)
    with pytest.raises(SystemExit, match="no workload matches 'nothing-\\*'"):
        select("nothing-*")
