"""Tables, markdown, JSON and a plot of ``pagedkv bench`` results."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields
from typing import Any

from pagedkv.bench.profile import describe_kernels
from pagedkv.bench.runners import STEP_LAYERS, Row
from pagedkv.textutil import format_table, markdown_table

HEADERS = [
    "workload", "impl", "eager us", "steady us", "graph us", "flushed us", "host us", "launch us", "layer us", "write us", "build us", "GB/s", "%copy",
    "TFLOP/s", "vs base", "max|diff|", "config",
]  # fmt: skip


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def row_cells(r: Row, floor_us: float | None = None) -> list[str]:
    """A row's cells; ``floor_us``: the run's host floor (``host_floor_us``), which the
    ``launch`` cell is also given as a multiple of (``79.5 (7.4x)``): our launches are
    Python and slow down with the host, so that multiple compares across machines where
    the microseconds do not (on the H200 hosts an MLA row's launch moved 2x between
    sessions with nothing changed in its path)."""
    if r.error:
        error = " ".join(r.error.split())[:100]
        return [r.workload, r.impl, "ERROR", error, *[""] * (len(HEADERS) - 4)]
    config = " ".join(f"{k}={v}" for k, v in r.config.items() if k != "backend")
    return [
        r.workload, r.impl, _fmt(r.eager_us, ".1f"), _fmt(r.steady_us, ".1f"), _fmt(r.graph_us, ".1f"),
        _fmt(r.graph_flushed_us, ".1f"), _fmt(r.host_us, ".1f"), _launch_cell(r.launch_us, floor_us), _fmt(r.layer_us, ".1f"), _fmt(r.write_us, ".1f"), _fmt(r.build_us, ".1f"),
        _fmt(r.gbps, ".0f"),
        _fmt(r.pct_copy, ".1f"), _fmt(r.tflops, ".1f"), _fmt(r.vs_baseline, ".2f"),
        _fmt(r.max_abs_diff, ".1e"), config,
    ]  # fmt: skip


def _launch_cell(launch_us: float | None, floor_us: float | None) -> str:
    if launch_us is None or not floor_us:
        return _fmt(launch_us, ".1f")
    return f"{launch_us:.1f} ({launch_us / floor_us:.1f}x)"


def host_floor(env: dict[str, Any]) -> str:
    """The run's host speed in words (earlier runs' JSON has none)."""
    floor = env.get("host_floor_us")
    if floor is None:
        return "not measured"
    return f"{floor:.1f} us to enqueue a one-element torch op"


def run_source(name: str, run: dict[str, Any]) -> str:
    """One line on where a ``--json`` run came from: its device, versions, host speed and
    command."""
    env = run.get("environment", {})
    return (
        f"{name}: {env.get('gpu') or env.get('device')}, torch {env.get('torch')}, "
        f"triton {env.get('triton')}, flashinfer {env.get('flashinfer')}; host: "
        f"{host_floor(env)}; `{env.get('command')}`"
    )


def text_table(rows: list[Row], floor_us: float | None = None) -> str:
    return format_table(HEADERS, [row_cells(r, floor_us) for r in rows])


def markdown(rows: list[Row], env: dict[str, Any], workloads: dict[str, str]) -> str:
    lines = [
        "# pagedkv bench",
        "",
        f"{env.get('gpu') or env.get('device')}; copy bandwidth (read + write, measured in this "
        f"run) {env['copy_bandwidth'] / 1e12:.3f} TB/s; host: {host_floor(env)}; torch "
        f"{env['torch']}, triton "
        f"{env.get('triton')}, flashinfer {env.get('flashinfer')}; command `{env['command']}`",
        "",
        "| workload | step | layer |",
        "|---|---|---|",
        *(f"| {name} | {text} |" for name, text in workloads.items()),
        "",
        markdown_table(HEADERS, [row_cells(r, env.get("host_floor_us")) for r in rows]),
        "",
        "Times are medians (`eager`: triton.testing.do_bench with L2 flushed; `steady`: eager "
        "calls back to back, no flush or sync (the longer of host and GPU work); `graph`: the same "
        "call replayed from a CUDA graph captured through `reserve_cuda_graph`; `flushed`: "
        "those replays with the L2 flushed before each, as eager calls); `host` = eager - "
        "graph; `launch` = the host's time to enqueue one eager call (in brackets: as a multiple of "
        "the host floor, comparable across machines); `layer` = the host's time to enqueue a layer's "
        f"eager call in a step of {STEP_LAYERS} layers, a new build each step (what an eager step pays a layer, "
        "where `launch` repeats one layer over one step); `vs base` = the baseline's best time / this row's best time (> 1: faster); "
        "`max|diff|` against the torch backend (fp32 maths; MLA layers: the float64 reference "
        "over the latent rows).",
    ]
    profiled = [r for r in rows if r.kernels]
    if profiled:
        lines += [
            "",
            "Kernels of one eager call (`--profile`, device time, in launch order on a GPU):",
            "",
        ]
        for r in profiled:
            lines += [f"- {r.workload}, {r.impl}:", "", "```", *describe_kernels(r.kernels)]
            if r.host_functions:
                lines += ["host, by own time:", *describe_kernels(r.host_functions)]
            lines += ["```"]
    return "\n".join(lines) + "\n"


def merged_matrix(
    runs: list[tuple[str, dict[str, Any]]], reference: str = "flashinfer"
) -> tuple[list[str], list[list[str]], list[str]]:
    """One table of several ``--json`` runs: a row per workload, per backend config its
    ``eager / graph`` µs (and % of the copy bandwidth) and its speed against
    ``reference`` (the reference's best time / its best time, > 1: faster). A later run's row replaces an earlier one of the same
    (workload, config). The ratio takes the reference from the same run where that run
    measured it (the same machine and moment), else from the latest run that did, marked
    ``*``. Returns (headers, rows, the runs' sources, one line each)."""
    cells: dict[tuple[str, str], tuple[int, Row]] = {}
    references: dict[str, dict[int, Row]] = {}  # every run's, by workload
    sources = []
    for index, (name, run) in enumerate(runs):
        sources.append(run_source(name, run))
        for row in saved_rows(run):
            cells[(row.workload, row.impl)] = (index, row)
            if row.impl == reference:
                references.setdefault(row.workload, {})[index] = row
    workloads = list(dict.fromkeys(w for w, _ in cells))
    impls = list(dict.fromkeys(i for _, i in cells))

    headers = ["workload"]
    for impl in impls:
        headers.append(f"{impl} eager / graph us (%copy)")
        if impl != reference:
            headers.append(f"{impl} vs {reference}")
    table = []
    for workload in workloads:
        ref_runs = references.get(workload, {})
        line = [workload]
        for impl in impls:
            hit = cells.get((workload, impl))
            if hit is None:
                line += ["-"] if impl == reference else ["-", "-"]
                continue
            index, row = hit
            line.append(
                f"{_fmt(row.eager_us, '.1f')} / {_fmt(row.graph_us, '.1f')} "
                f"({_fmt(row.pct_copy, '.0f')}%)"
            )
            if impl == reference:
                continue
            ref = ref_runs.get(index)
            mark = ""
            if ref is None and ref_runs:
                ref, mark = ref_runs[max(ref_runs)], "*"
            ratio = None
            if ref is not None and ref.best_us and row.best_us:
                ratio = ref.best_us / row.best_us
            line.append("-" if ratio is None else f"{ratio:.2f}x{mark}")
        table.append(line)
    return headers, table, sources


def merged_markdown(runs: list[tuple[str, dict[str, Any]]], reference: str = "flashinfer") -> str:
    headers, table, sources = merged_matrix(runs, reference)
    return "\n".join([
        markdown_table(headers, table),
        "",
        f"`vs {reference}`: its best time (eager or graph) / the row's (> 1: faster), from the "
        "same run; `*`: from another run. Runs:",
        "",
        *(f"- {s}" for s in sources),
    ]) + "\n"  # fmt: skip


def saved_rows(run: dict[str, Any]) -> list[Row]:
    """The rows of a ``--json`` run (``write_json``'s, of this version or an earlier one:
    fields it lacks keep their defaults) that did not fail."""
    names = [f.name for f in fields(Row)]
    rows = (Row(**{k: saved[k] for k in names if k in saved}) for saved in run.get("rows", []))
    return [row for row in rows if not row.error]


def write_json(path: str, rows: list[Row], env: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(
            {"environment": env, "rows": [asdict(r) | {"host_us": r.host_us} for r in rows]},
            f,
            indent=1,
        )


def plot(path: str, rows: list[Row], baseline: str | None) -> None:
    """Speed relative to the baseline (or to the first impl), one bar group per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = [i for i in dict.fromkeys(r.impl for r in rows) if i != baseline]
    workloads = list(dict.fromkeys(r.workload for r in rows))
    best = {(r.workload, r.impl): r.best_us for r in rows if r.best_us}
    ref = baseline or impls[0]
    fig, ax = plt.subplots(figsize=(max(8, len(workloads) * 0.7), 4.5))
    width = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        ys = [
            best[(w, ref)] / best[(w, impl)] if (w, ref) in best and (w, impl) in best else 0.0
            for w in workloads
        ]
        ax.bar([i + k * width for i in range(len(workloads))], ys, width, label=impl)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))])
    ax.set_xticklabels(workloads, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(f"speed vs {ref} (best of eager/graph)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
