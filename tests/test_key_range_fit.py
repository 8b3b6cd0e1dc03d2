"""benchmarks/key_range_fit.py over the H200's recorded key-range sweep: the split rule's
estimate must keep ranking the measured ranges well (a change of its constants or its
form that ranks them worse fails here, on a CPU)."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "docs" / "results" / "sweep-h200-twelfth-key-ranges.json"


@pytest.fixture(scope="module")
def fit_tool():
    return runpy.run_path(str(ROOT / "benchmarks" / "key_range_fit.py"), run_name="key_range_fit")


def test_the_estimate_ranks_the_h200_ranges_near_the_fastest(fit_tool):
    import json

    trials = json.loads(SWEEP.read_text())["trials"]
    rows = fit_tool["rank_rows"](trials, 132)
    assert len(rows) == 8
    ratios = {name: pick_us / best_us for name, _, pick_us, _, best_us, _, _ in rows}
    # the waves' tail gave 1.026 and 1.131 (speculative 32x8); measured noise is ~1%
    assert math.exp(sum(map(math.log, ratios.values())) / len(ratios)) < 1.02, ratios
    assert max(ratios.values()) < 1.06, ratios
    assert ratios["spec-decode-32x8"] < 1.02 and ratios["gqa16-ragged-decode"] < 1.02
    # the rule's pick (the longest power of two within the tie): 1.013 and 1.033 where the
    # estimate's first gave 1.014 and 1.054 (speculative 64x4: 1280 keys, 2048 the fastest)
    rule = {name: rule_us / best_us for name, _, _, _, best_us, _, rule_us in rows}
    assert math.exp(sum(map(math.log, rule.values())) / len(rule)) < 1.02, rule
    assert max(rule.values()) < 1.04, rule
    assert rule["spec-decode-64x4"] < 1.01 and rule["gqa16-ragged-decode"] < 1.01, rule


def test_a_sweep_without_ranges_is_refused(fit_tool, tmp_path):
    empty = tmp_path / "sweep.json"
    empty.write_text('{"trials": [{"workload": "decode-64x4096", "keys_per_split": 0}]}')
    with pytest.raises(SystemExit, match="no fixed-range trials"):
        fit_tool["main"]([str(empty)])
