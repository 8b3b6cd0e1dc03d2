"""The ``pagedkv`` command line. Each subcommand lives in its own module with
``add_parser(subparsers)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import pagedkv

SUBCOMMANDS = ["backends", "demo", "generate", "capacity", "simulate", "conform"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv", description="Paged-attention backends, checked against one reference."
    )
    parser.add_argument("--version", action="version", version=f"pagedkv {pagedkv.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"pagedkv.cli.{name}")
        sub_parser = module.add_parser(sub)
        sub_parser.set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except pagedkv.PagedKVError as exc:
        print(f"pagedkv: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
