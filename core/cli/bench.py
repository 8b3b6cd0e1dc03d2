"""``pagedkv bench``: time backend configs on a matrix of serving steps (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any


def split_configs(text: str) -> list[str]:
    """Split "a,b(x=1,y=2),split(decode=a,prefill=b)" on the commas outside parentheses."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [c.strip() for c in out if c.strip()]


def check_names(configs: list[str]) -> None:
    """Raise before anything is timed where a config is malformed or names a backend no
    plugin registered (a typo would time as ERROR rows, found at the end of a GPU run);
    a registered backend that cannot run here still times as its rows' ERROR, saying why."""
    from pagedkv.config import AUTO, parse_config
    from pagedkv.registry import get_registry

    registry = get_registry()
    for config in configs:
        for choice in parse_config(config):
            if choice.name != AUTO and registry.failure_for(choice.name) is None:
                registry.backend_class(choice.name)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "bench",
        help="Time backend configs on realistic serving steps, next to FlashInfer.",
        description=(
            "Time each backend config (eager and CUDA-graph through the contract) on a matrix "
            "of serving steps: uniform, ragged and speculative decodes, mixed decode+chunk "
            "steps, GQA 1/4/8/16, head sizes 64/128/256, block sizes 16/32/64, fp8 caches and "
            "prefills. Prints a table; --json/--markdown/--plot write files."
        ),
    )
    parser.add_argument(
        "--backends",
        default="triton",
        help="Backend configs to time, comma-separated (parentheses group options), "
        "e.g. 'triton,triton(num_splits=1),flashinfer'.",
    )
    parser.add_argument(
        "--matrix", default=None, help="Workload matrix: core, standard or tiny; short "
        "(decode steps far shorter than a graph's reservation: with --graph-context); mla "
        "or tiny-mla for MLA layers (default: standard on a GPU, tiny on a CPU)."
    )  # fmt: skip
    parser.add_argument(
        "--workloads",
        default="",
        help="Only workloads whose names match these globs (comma-separated).",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help="Raw library to compare with: flashinfer or none (default: flashinfer when installed).",
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present).")
    parser.add_argument("--no-graph", action="store_true", help="Skip the CUDA-graph timings.")
    parser.add_argument("--no-check", action="store_true", help="Skip the torch-backend check.")
    parser.add_argument(
        "--graph-context",
        type=int,
        default=None,
        metavar="TOKENS",
        help="Reserve each CUDA graph for contexts of up to TOKENS tokens, as an engine "
        "reserves its graphs for the model's longest context and replays them on shorter "
        "steps (default: each step's own longest context).",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="Also run N eager calls per row under torch.profiler and print each kernel's "
        "device time per call (where a step's time goes).",
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random data.")
    parser.add_argument("--json", metavar="PATH", help="Write rows and environment as JSON.")
    parser.add_argument("--markdown", metavar="PATH", help="Write a markdown report.")
    parser.add_argument("--plot", metavar="PATH", help="Write a PNG of speed vs the baseline.")
    parser.add_argument("--list", action="store_true", help="List the matrix's workloads and exit.")
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="Time nothing: one table of earlier --json runs (a row per workload, per config "
        "its eager / graph time and its speed against --reference); --markdown writes it.",
    )
    parser.add_argument(
        "--reference", default="flashinfer", help="The config --merge compares with."
    )
    parser.add_argument(
        "--before",
        nargs="+",
        metavar="JSON",
        help="Time nothing: compare these --json runs (the tree before a change) with "
        "--after's, row by row and time by time; a change is 'faster' or 'slower' where "
        "the runs' ranks pass a Mann-Whitney test at p <= 0.1 (three runs a side at least) "
        "and it is at least 1%% of the before median.",
    )
    parser.add_argument(
        "--after", nargs="+", metavar="JSON", help="The runs --before is compared with."
    )
    parser.add_argument(
        "--fail-on-slower",
        action="store_true",
        help="With --before/--after, exit 1 when a time got slower (as `asv continuous` "
        "does on a regression), e.g. in a GPU runner's CI.",
    )
    parser.add_argument(
        "--times",
        default="",
        help="With --before/--after, only these times (comma-separated): "
        "eager, graph, host, launch, layer, write, build (default: every one measured).",
    )
    return parser


def load_runs(paths: list[str], option: str) -> list[tuple[str, dict[str, Any]]]:
    """Earlier ``--json`` runs, by path; ``option`` names the flag in errors."""
    import json

    from pagedkv.errors import ConfigError

    runs = []
    for path in paths:
        try:
            with open(path) as f:
                runs.append((path, json.load(f)))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{option} {path}: not a pagedkv bench --json file ({exc})") from exc
    return runs


def merge(args: argparse.Namespace) -> int:
    from pagedkv.bench.report import merged_markdown, merged_matrix
    from pagedkv.textutil import format_table

    runs = load_runs(args.merge, "--merge")
    headers, table, sources = merged_matrix(runs, args.reference)
    print(format_table(headers, table))
    print("\n".join(sources))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(merged_markdown(runs, args.reference))
    return 0


def compare(args: argparse.Namespace) -> int:
    from pagedkv.bench.compare import HEADERS, TIMES, compare_runs, summary
    from pagedkv.bench.report import run_source
    from pagedkv.errors import ConfigError
    from pagedkv.textutil import format_table, markdown_table

    if not (args.before and args.after):
        raise ConfigError("--before and --after: expected both, each with --json runs")
    times = tuple(t.strip() for t in args.times.split(",") if t.strip())
    unknown = [t for t in times if t not in TIMES]
    if unknown:
        raise ConfigError(f"--times {','.join(unknown)}: expected some of {', '.join(TIMES)}")
    before, after = load_runs(args.before, "--before"), load_runs(args.after, "--after")
    changes, unmatched = compare_runs([r for _, r in before], [r for _, r in after], times)
    if not changes:
        raise ConfigError("--before/--after: no (workload, config) with a time on both sides")
    table = [c.cells() for c in changes]
    print(format_table(HEADERS, table))
    print("\n".join(["", summary(changes), *unmatched]))
    sources = [f"before: {run_source(*r)}" for r in before]
    sources += [f"after: {run_source(*r)}" for r in after]
    print("\n".join(sources))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(
                "\n".join([
                    markdown_table(HEADERS, table),
                    "",
                    *(f"- {line}" for line in summary(changes).splitlines()),
                    *(f"- {line}" for line in unmatched),
                    "",
                    "Runs:",
                    "",
                    *(f"- {s}" for s in sources),
                ]) + "\n"
            )  # fmt: skip
    return 1 if args.fail_on_slower and any(c.verdict == "slower" for c in changes) else 0


def run(args: argparse.Namespace) -> int:
    if args.merge:
        return merge(args)
    if args.before or args.after:
        return compare(args)
    import torch
    from pagedkv.bench import run_bench, select_workloads
    from pagedkv.bench.report import host_floor, markdown, plot, text_table, write_json
    from pagedkv.errors import ConfigError

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    matrix = args.matrix or ("standard" if device.startswith("cuda") else "tiny")
    patterns = [p for p in args.workloads.split(",") if p.strip()]
    workloads = select_workloads(matrix, patterns)
    if args.list:
        for w in workloads:
            print(f"{w.name:<28} {w.describe()}; {w.layer.describe()}")
        return 0
    baseline = args.baseline
    if baseline is None:
        has_fi = device.startswith("cuda") and importlib.util.find_spec("flashinfer") is not None
        baseline = "flashinfer" if has_fi else None
    elif baseline == "none":
        baseline = None
    elif baseline != "flashinfer":
        raise ConfigError(f"--baseline {baseline!r}: expected flashinfer or none")
    if args.graph_context is not None and args.graph_context < 1:
        raise ConfigError(f"--graph-context {args.graph_context}: expected a positive token count")
    configs = split_configs(args.backends)
    if not configs:
        raise ConfigError("--backends: expected at least one backend config")
    check_names(configs)
    rows, env = run_bench(
        configs,
        workloads,
        device=device,
        baseline=baseline,
        graph=not args.no_graph,
        check=not args.no_check,
        seed=args.seed,
        profile=args.profile,
        graph_context=args.graph_context,
    )
    print(
        f"\n{env.get('gpu') or env['device']}: copy bandwidth (read + write, measured now) "
        f"{env['copy_bandwidth'] / 1e12:.3f} TB/s; host: {host_floor(env)}"
    )
    print(text_table(rows, env.get("host_floor_us")))
    if args.json:
        write_json(args.json, rows, env)
    if args.markdown:
        described = {w.name: f"{w.describe()} | {w.layer.describe()}" for w in workloads}
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, env, described))
    if args.plot:
        plot(args.plot, rows, f"raw:{baseline}" if baseline else None)
    return 1 if any(r.error for r in rows if not r.error.startswith("NoUsableBackendError")) else 0
