"""``pagedkv backends``: every registered backend, whether it can run here and why not,
what it declares, and the problems found in the installed plugins.

The table fits the terminal: long cells wrap onto more lines; so do the reasons,
notes and problems below it; nothing is cut. ``--wide`` prints one line per backend
(with the layout and the distribution), ``--json`` the records themselves.
"""

from __future__ import annotations

import argparse
import json
import shutil
import textwrap
import warnings
from collections.abc import Sequence
from typing import Any

from pagedkv.registry import BackendRecord, PluginLoadWarning, get_registry
from pagedkv.textutil import format_table

HEADERS = ["backend", "available", "devices", "dtypes", "head size", "block size", "features"]
HEADERS_WIDE = [*HEADERS, "layout", "from"]
# the columns wrapped first (widest first) when the table is wider than the terminal
WRAPPABLE = {"devices", "dtypes", "head size", "block size", "features"}
DTYPE_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "backends",
        description="List the registered backends: availability here (and why not), "
        "declared devices, dtypes, head and block sizes, features and notes, and the "
        "problems found in the installed plugins.",
    )
    parser.add_argument("--json", action="store_true", help="Print the records as JSON.")
    parser.add_argument(
        "--wide", action="store_true", help="Do not fit the table to the terminal width."
    )
    return parser


def run(args: argparse.Namespace) -> int:
    with warnings.catch_warnings():
        # every plugin problem is printed below: no second copy as a Python warning
        warnings.simplefilter("ignore", PluginLoadWarning)
        registry = get_registry()
        records = registry.records()
    if args.json:
        print(json.dumps([r.__dict__ for r in records], indent=2))
        return 0
    width = None if args.wide else shutil.get_terminal_size((80, 24)).columns
    print(render(records, [str(w) for w in registry.warnings], width))
    return 0


def render(records: Sequence[BackendRecord], problems: Sequence[str], width: int | None) -> str:
    """The table, then the reasons, notes and problems; ``width`` None: no limit (and
    the layout and distribution as columns)."""
    headers = HEADERS if width is not None else HEADERS_WIDE
    rows = [_row(r)[: len(headers)] for r in records]
    out = [format_table(headers, _fit(headers, rows, width))]
    unavailable = [(f"{r.name} ({r.distribution})", r.reason) for r in records if not r.available]
    notes = [(r.name, "; ".join(r.notes)) for r in records if r.notes]
    for title, items in (("unavailable", unavailable), ("notes", notes)):
        if items:
            out.append(f"\n{title}:")
            out += [_wrap(f"{name}: {text}", width) for name, text in items]
    if problems:
        out.append("\nplugin problems:")
        out += [_wrap(problem, width) for problem in problems]
    return "\n".join(out)


def _row(r: BackendRecord) -> list[str]:
    caps = r.capabilities or {}
    return [
        r.name,
        "yes" if r.available else "no",
        ", ".join(caps.get("devices", [])) or "?",
        ", ".join(DTYPE_SHORT.get(d, d) for d in caps.get("dtypes", [])) or "?",
        str(caps.get("head_sizes", "?")),
        str(caps.get("block_sizes", "?")),
        ", ".join(
            [*caps.get("features", []), f"cuda_graph: {caps.get('cuda_graph', 'never')}"]
            + (["batch_invariant"] if caps.get("batch_invariant") else [])
        ),
        r.layout,
        r.distribution,
    ]


def _fit(headers: list[str], rows: list[list[str]], width: int | None) -> list[list[str]]:
    """The rows, with the widest columns narrowed until the table fits ``width``
    characters: a row whose cells wrap becomes several lines (continuation lines leave
    the other cells empty). The wrappable columns go first, down to their longest
    word; on a very narrow terminal every column goes down to its header's width."""
    if width is None or not rows:
        return rows
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    longest_word = [
        max(len(h), *(len(word) for row in rows for word in row[i].split()))
        for i, h in enumerate(headers)
    ]
    for floor, columns in (
        (longest_word, [i for i, h in enumerate(headers) if h in WRAPPABLE]),
        ([len(h) for h in headers], range(len(headers))),
    ):
        while sum(widths) + 2 * (len(widths) - 1) > width:
            candidates = [i for i in columns if widths[i] > floor[i]]
            if not candidates:
                break
            widest = max(candidates, key=lambda i: widths[i])
            widths[widest] -= 1
    out = []
    for row in rows:
        cells = [textwrap.wrap(c, w) or [""] for c, w in zip(row, widths, strict=True)]
        height = max(len(c) for c in cells)
        out += [[c[line] if line < len(c) else "" for c in cells] for line in range(height)]
    return out


def _wrap(text: str, width: int | None) -> str:
    if width is None:
        return f"  {text}"
    return textwrap.fill(
        text, width, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False
    )
