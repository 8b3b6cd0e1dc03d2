"""How well the split rule's estimate ranks fixed key ranges, against measured times.

    python benchmarks/key_range_fit.py ranges.json

``ranges.json`` is ``benchmarks/triton_sweep.py --key-ranges --json``'s output (any
GPU). For each row it re-estimates every measured range with the rule as it is now
(``configs.key_range_estimates``; each row's programs per SM as the sweep compiled
them, on the GPU's SM count) and prints the range the estimate ranks first and the one
the rule takes (``split_kv.key_range_pick``: the longest power of two within its tie),
each one's measured time over the fastest range's, and their geometric means: the
figures to keep near 1 when the estimate's constants or the tie change (docs/triton.md,
"The ranges' estimate refitted", "A tie among fixed ranges"). Runs on a CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np
from pagedkv.backends.triton import configs
from pagedkv.backends.triton.configs import LayerShape, StepShape, TileConfig
from pagedkv.bench.workloads import MATRICES
from pagedkv.toolkit.launch import KernelFit
from pagedkv.toolkit.split_kv import key_range_pick

WORKLOADS = {w.name: w for w in MATRICES["standard"]}


def parse_tile(name: str) -> TileConfig:
    m, n, w, s = name.split("-")
    return TileConfig(int(m[1:]), int(n[1:]), int(w[1:]), int(s[1:]))


def rank_rows(
    trials: list[dict], num_sms: int
) -> list[tuple[str, int, float, int, float, int, float]]:
    """Per row: (name, the estimate's first, its µs, the fastest range, its µs, the
    rule's pick, its µs)."""
    rows: dict[str, list[dict]] = {}
    for t in trials:
        if t.get("keys_per_split") and t.get("us"):
            rows.setdefault(t["workload"], []).append(t)
    out = []
    for name, timed in rows.items():
        workload = WORKLOADS[name]
        layer = LayerShape.of(workload.layer.spec())
        step = StepShape(np.asarray(workload.query_lens), np.asarray(workload.seq_lens))
        tile = parse_tile(timed[0]["tile"])
        per_sm = timed[0]["programs_per_sm"]

        def fit(t: TileConfig, form: configs.LaunchForm, n: int = per_sm) -> KernelFit:
            return KernelFit(0, 0, 0, n)  # every form as the sweep's ranged launches compiled

        keys = [t["keys_per_split"] for t in timed]
        estimates = configs.key_range_estimates(layer, step, tile, keys, num_sms, fit)
        pick = min(range(len(keys)), key=lambda i: estimates[i])
        best = min(range(len(keys)), key=lambda i: timed[i]["us"])
        order = np.argsort(keys, kind="stable")  # the rule's candidates ascend
        steps_each = np.asarray(keys)[order] // tile.tile_n
        rule = int(order[key_range_pick(steps_each, np.asarray(estimates)[order])])
        out.append(
            (name, keys[pick], timed[pick]["us"], keys[best], timed[best]["us"],
             keys[rule], timed[rule]["us"])
        )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_json", help="benchmarks/triton_sweep.py --key-ranges --json output")
    p.add_argument("--num-sms", type=int, default=132, help="the GPU's (default: the H200's)")
    args = p.parse_args(argv)
    with open(args.sweep_json) as f:
        trials = json.load(f)["trials"]
    rows = rank_rows(trials, args.num_sms)
    if not rows:
        sys.exit(f"{args.sweep_json}: no fixed-range trials (run the sweep with --key-ranges)")
    print(
        f"{'row':<24} {'first':>6} {'us':>8} {'rule':>6} {'us':>8} {'fastest':>8} {'us':>8} "
        f"{'first/fastest':>14} {'rule/fastest':>13}"
    )
    for name, pick, pick_us, best, best_us, rule, rule_us in rows:
        print(
            f"{name:<24} {pick:>6} {pick_us:8.1f} {rule:>6} {rule_us:8.1f} {best:>8} "
            f"{best_us:8.1f} {pick_us / best_us:14.3f} {rule_us / best_us:13.3f}"
        )
    for label, column in (("the estimate's first", 2), ("the rule's pick", 6)):
        ratios = [row[column] / row[4] for row in rows]
        mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"{label}: geometric mean {mean:.3f}, worst {max(ratios):.3f}")


if __name__ == "__main__":
    main()
