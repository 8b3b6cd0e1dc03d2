"""``pagedkv bench --before ... --after ...``: the runs of a tree before a change and
after it, compared row by row and time by time, each change judged against the spread
of the runs themselves.

A backend author's question after a change is "did any row get slower?", and on a GPU
the answer hides in the noise between two runs of the same tree (a row's eager time
moved 1-3% between calls of one session on the H200). So each side is several runs
(best alternated, old / new / old / new, so that a drift of the machine falls on both),
and a change gets a verdict only where the runs' ranks make it unlikely to be that
noise: the exact two-sided Mann-Whitney test at ``ALPHA`` (the test ``asv compare``
applies to a benchmark's samples), and a change of at least ``MIN_CHANGE`` of the
before median. With two runs a side no split of the runs is rare enough (complete
separation happens one time in three by chance); with three, complete separation is
the one that counts (one time in ten by chance); with four, one time in 35.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np
from pagedkv.bench.report import saved_rows
from pagedkv.bench.runners import Row

# the times compared, by their column in ``Row`` (lower is better for each); ``host_us``
# is a property of the row (eager - graph)
TIMES: dict[str, str] = {
    "eager": "eager_us",
    "graph": "graph_us",
    "host": "host_us",
    "launch": "launch_us",
    "layer": "layer_us",
    "write": "write_us",
    "build": "build_us",
}
HEADERS = ["workload", "config", "time", "before us", "after us", "change", "p", "verdict"]
# a verdict's largest p-value (two-sided): three runs a side reach it by complete
# separation alone
ALPHA = 0.1
# ... and its least change, a share of the before median: below it a change is none,
# however consistent (a time moved by a shared cause, a clock, not by the change)
MIN_CHANGE = 0.01


@dataclass(frozen=True)
class Change:
    """One time of one (workload, config), in every run of each side."""

    workload: str
    config: str
    time: str  # a key of TIMES
    before: tuple[float, ...]
    after: tuple[float, ...]

    @property
    def difference_us(self) -> float:
        return statistics.median(self.after) - statistics.median(self.before)

    @functools.cached_property
    def p_value(self) -> float:
        return rank_p_value(self.before, self.after)

    @property
    def verdict(self) -> str:
        """``faster`` / ``slower`` where the change passes the rank test at ``ALPHA`` and
        is at least ``MIN_CHANGE``; ``no change`` where it does not; ``too few runs``
        where no outcome of these runs could pass the test."""
        if least_p_value(len(self.before), len(self.after)) > ALPHA:
            return "too few runs"
        difference = self.difference_us
        if self.p_value > ALPHA or abs(difference) < MIN_CHANGE * abs(
            statistics.median(self.before)
        ):
            return "no change"
        return "faster" if difference < 0 else "slower"

    def cells(self) -> list[str]:
        before = statistics.median(self.before)
        change = f"{self.difference_us:+.1f} us"
        if before > 0:  # (eager - graph may be zero or negative: no share of it)
            change += f" ({self.difference_us / before:+.1%})"
        return [
            self.workload, self.config, self.time, _runs(self.before), _runs(self.after),
            change, f"{self.p_value:.3f}", self.verdict,
        ]  # fmt: skip


def rank_p_value(before: tuple[float, ...], after: tuple[float, ...]) -> float:
    """The exact two-sided p-value of the Mann-Whitney test that ``after`` and ``before``
    come from one distribution: the share of all splits of the pooled runs into sides of
    these sizes whose rank sum is at least as far from even (ties take their mean rank).
    Counted by the sizes and rank sums of subsets, one run at a time, not by listing the
    splits: eight runs a side are 12,870 of them."""
    n, m = len(before), len(after)
    pooled = np.array((*before, *after), dtype=np.float64)
    # doubled mean ranks (1-based): ints, ties included
    order = np.argsort(pooled, kind="stable")
    ranks = np.empty(n + m, dtype=np.float64)
    ranks[order] = np.arange(1, n + m + 1)
    for value in np.unique(pooled):
        tied = pooled == value
        ranks[tied] = ranks[tied].mean()
    doubled = np.rint(2 * ranks).astype(np.int64)
    # subsets[k, s]: subsets of k runs whose doubled ranks sum to s
    subsets = np.zeros((m + 1, int(doubled.sum()) + 1), dtype=np.float64)
    subsets[0, 0] = 1.0
    for r in doubled:
        subsets[1:, r:] += subsets[:-1, : subsets.shape[1] - r].copy()
    # a side's doubled rank sum is even at m (m + 1) + n m
    center = m * (m + 1) + n * m
    observed = abs(int(doubled[n:].sum()) - center)
    sums = np.arange(subsets.shape[1])
    return float(subsets[m, np.abs(sums - center) >= observed].sum() / math.comb(n + m, m))


def least_p_value(n: int, m: int) -> float:
    """The smallest p-value ``rank_p_value`` can give for sides of ``n`` and ``m`` runs:
    that of complete separation, in either direction."""
    return min(1.0, 2 / math.comb(n + m, m))


def _runs(values: tuple[float, ...]) -> str:
    """The runs' median, and their range where there are several."""
    median = f"{statistics.median(values):.1f}"
    if len(values) == 1:
        return median
    return f"{median} ({min(values):.1f}-{max(values):.1f})"


def _rows(runs: list[dict[str, Any]]) -> dict[tuple[str, str], list[Row]]:
    """Each (workload, config)'s rows over ``runs`` (``--json`` files' contents), in
    order of appearance; rows that failed are left out."""
    found: dict[tuple[str, str], list[Row]] = {}
    for run in runs:
        for row in saved_rows(run):
            found.setdefault((row.workload, row.impl), []).append(row)
    return found


def compare_runs(
    before: list[dict[str, Any]], after: list[dict[str, Any]], times: tuple[str, ...] = ()
) -> tuple[list[Change], list[str]]:
    """Every time (``times``, keys of ``TIMES``; none: all) that both sides measured for
    a (workload, config) they share, in the order the ``after`` runs list them; and a
    line for each (workload, config) only one side has."""
    old, new = _rows(before), _rows(after)
    changes = []
    for key, rows in new.items():
        if key not in old:
            continue
        for name in times or TIMES:
            attribute = TIMES[name]
            was = tuple(v for r in old[key] if (v := getattr(r, attribute)) is not None)
            now = tuple(v for r in rows if (v := getattr(r, attribute)) is not None)
            if was and now:
                changes.append(Change(*key, name, was, now))
    unmatched = [f"only after: {w}, {c}" for w, c in new if (w, c) not in old]
    unmatched += [f"only before: {w}, {c}" for w, c in old if (w, c) not in new]
    return changes, unmatched


def summary(changes: list[Change]) -> str:
    """Per time, how many rows got faster, slower or did not change beyond the runs'
    noise (and how many had too few runs for a verdict)."""
    lines = []
    for name in dict.fromkeys(c.time for c in changes):
        verdicts = [c.verdict for c in changes if c.time == name]
        counts = [
            f"{verdicts.count(v)} {label}" for v, label in VERDICTS.items() if verdicts.count(v)
        ]
        lines.append(f"{name}: {', '.join(counts)}")
    return "\n".join(lines)


# each verdict as the summary counts it
VERDICTS = {
    "faster": "faster",
    "slower": "slower",
    "no change": "no change beyond the runs' noise",
    "too few runs": f"with too few runs for a verdict (p <= {ALPHA} needs 3 a side)",
}
