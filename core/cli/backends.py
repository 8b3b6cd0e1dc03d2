"""``pagedkv backends``: every registered backend, whether it can run here, and why not."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedkv.registry import list_backends
from pagedkv.textutil import format_table


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser("backends", help="List backends: availability, layout, features.")
    parser.add_argument("--json", action="store_true", help="Print the records as JSON.")
    return parser


def run(args: argparse.Namespace) -> int:
    records = list_backends()
    if args.json:
        print(json.dumps([r.__dict__ for r in records], indent=2))
        return 0
    rows = []
    for r in records:
        caps = r.capabilities or {}
        rows.append(
            [
                r.name,
                "yes" if r.available else f"no: {r.reason}",
                r.layout,
                ",".join(caps.get("dtypes", [])),
                ",".join(caps.get("features", [])) or "-",
                r.distribution,
            ]
        )
    print(format_table(["backend", "available", "layout", "dtypes", "features", "from"], rows))
    return 0
