"""The ``pagedkv`` command line. Each subcommand lives in its own module with
``add_parser(subparsers)`` and ``run(args) -> int``.

Only the subcommand being run is imported: ``pagedkv --version`` and
``pagedkv --help`` import no torch. Exit status: 0 success, 1 the command ran and
failed, 2 a bad command line (``pagedkv: error: <what>, <what was expected>``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import pagedkv
from pagedkv.errors import PagedKVError, UsageError

# name -> the one-line help shown by `pagedkv --help`
SUBCOMMANDS = {
    "backends": "List backends: availability, sizes, devices, features and plugin problems.",
    "demo": "Run attention on a sample mixed batch and print the error vs the float64 reference.",
    "generate": "Generate text with a Hugging Face model served through a pagedkv backend.",
    "capacity": "KV-cache bytes per token/block, and the blocks, tokens and requests a budget "
    "holds.",
    "simulate": "Replay a request trace through contiguous and paged KV allocators; print "
    "utilisation, write a table and a PNG.",
    "conform": "Run the conformance suite on backends and print the scenario matrix.",
    "bench": "Time backend configs on realistic serving steps, next to FlashInfer.",
}


class Parser(argparse.ArgumentParser):
    """Reports a bad command line as ``pagedkv: error: ...`` and exits with status 2.
    Options are matched whole: argparse's prefixes took ``generate --prompt ''`` for
    ``--prompts-file ''`` and served the default prompts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"pagedkv: error: {message}\n  (see '{self.prog} --help')\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported to give its full arguments."""
    parser = Parser(
        prog="pagedkv", description="Paged-attention backends, checked against one reference."
    )
    parser.add_argument("--version", action="version", version=f"pagedkv {pagedkv.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(f"pagedkv.cli.{name}")
        sub_parser = module.add_parser(sub)
        sub_parser.set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # the top-level options take no value: the first other word is the command
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad command line (reported)
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except UsageError as exc:
        print(f"pagedkv: error: {exc}", file=sys.stderr)
        return 2
    except PagedKVError as exc:
        print(f"pagedkv: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `pagedkv backends | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
