"""benchmarks/plan_digest.py: a step's record holds what decides its launches (the
triton and MLA backends), and two records of different plans compare unequal."""

from __future__ import annotations

import json
import random
import runpy
from pathlib import Path

import pagedkv
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_digest.py"


@pytest.fixture(scope="module")
def tool():
    return runpy.run_path(str(SCRIPT), run_name="plan_digest")


def test_a_forced_split_changes_the_digest(tool):
    spec = tool["LAYERS"]["triton"][0]
    builder = pagedkv.get_backend("triton").make_builder(spec, "cpu")
    seq, query = tool["draw"](random.Random(0), "decode")
    common = tool["_common"](seq, query, spec.block_size)
    chosen = tool["digest"](builder.build(common))
    assert chosen == tool["digest"](builder.build(common))  # a step's plan is its own
    forced = tool["digest"](builder.build(common, num_splits=3))
    assert forced != chosen
    # the scratch the kernels write is recorded by shape, not by its (arbitrary) contents
    part = forced[1]
    assert part[4][1]["PartAcc"][0] == "tensor" and len(part[4][1]["PartAcc"]) == 3


def test_an_mla_steps_work_list_is_in_its_digest(tool):
    spec = tool["LAYERS"]["mla"][1]
    builder = pagedkv.get_backend("mla").make_builder(spec, "cpu")
    common = tool["_common"]([3000, 40], [1, 1], spec.block_size)
    record = tool["digest"](builder.build(common))
    items = record[0]
    assert (
        items[:3] == ["tensor", [4, items[1][1]], "torch.int32"]
        and len(items[3]) == 4 * items[1][1]
    )
    assert record != tool["digest"](builder.build(tool["_common"]([3000, 41], [1, 1], 64)))


def test_compare_counts_the_steps_planned_alike(tool, tmp_path, capsys):
    rows = [[0, "eager", [5], [1], ["None", "a"]], [0, "eager", [9], [1], ["None", "b"]]]
    before, same, other = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    before.write_text(json.dumps(rows))
    same.write_text(json.dumps(rows))
    other.write_text(json.dumps([rows[0], [*rows[1][:4], ["None", "c"]]]))
    assert tool["compare"](str(before), str(same)) == 0
    assert tool["compare"](str(before), str(other)) == 1
    out = capsys.readouterr().out
    assert (
        "2 of 2 steps planned alike" in out and "step 1 (layer 0, eager, 1 requests) differs" in out
    )
