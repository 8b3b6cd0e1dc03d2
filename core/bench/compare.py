"""``pagedkv bench --before ... --after ...``: the runs of a tree before a change and
after it, compared row by row and time by time, each change judged against the spread
of the runs themselves.

A backend author's question after a change is "did any row get slower?", and on a GPU
the answer hides in the noise between two runs of the same tree (a row's eager time
moved 1-3% between calls of one session on the H200). So each side may be several
runs (best alternated, old / new / old / new, so that a drift of the machine falls on
both), and a change counts only when every run of one side is faster than every run of
the other: with two runs a side, that is a change larger than either side's spread.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields
from typing import Any

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
HEADERS = ["workload", "config", "time", "before us", "after us", "change", "verdict"]


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

    @property
    def verdict(self) -> str:
        """``faster`` / ``slower`` when every run of one side beat every run of the
        other, ``within spread`` when they overlap, ``-`` with one run on a side (no
        spread to judge by)."""
        if len(self.before) < 2 or len(self.after) < 2:
            return "-"
        if max(self.after) < min(self.before):
            return "faster"
        if min(self.after) > max(self.before):
            return "slower"
        return "within spread"

    def cells(self) -> list[str]:
        before = statistics.median(self.before)
        change = f"{self.difference_us:+.1f} us"
        if before > 0:  # (eager - graph may be zero or negative: no share of it)
            change += f" ({self.difference_us / before:+.1%})"
        return [
            self.workload, self.config, self.time, _runs(self.before), _runs(self.after),
            change, self.verdict,
        ]  # fmt: skip


def _runs(values: tuple[float, ...]) -> str:
    """The runs' median, and their range where there are several."""
    median = f"{statistics.median(values):.1f}"
    if len(values) == 1:
        return median
    return f"{median} ({min(values):.1f}-{max(values):.1f})"


def _rows(runs: list[dict[str, Any]]) -> dict[tuple[str, str], list[Row]]:
    """Each (workload, config)'s rows over ``runs`` (``--json`` files' contents), in
    order of appearance; rows that failed are left out."""
    names = [f.name for f in fields(Row)]
    found: dict[tuple[str, str], list[Row]] = {}
    for run in runs:
        for saved in run.get("rows", []):
            row = Row(**{k: saved[k] for k in names if k in saved})
            if not row.error:
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
    """Per time, how many rows got faster, slower or stayed within the runs' spread (and
    how many had one run on a side, without a verdict)."""
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
    "within spread": "within the runs' spread",
    "-": "with one run on a side (no verdict)",
}
