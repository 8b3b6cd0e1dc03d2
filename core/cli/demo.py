"""``pagedkv demo``: one mixed batch through the default backend, checked against the reference."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from pagedkv.cli.args import backend_config, device
from pagedkv.selection import default_config, select_backend
from pagedkv.textutil import format_table


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "demo",
        description="Run attention on a sample mixed batch and print the error vs the float64 "
        "reference.",
    )
    parser.add_argument(
        "--backend",
        type=backend_config,
        default=None,
        help="Config string (default: $PAGEDKV_BACKEND or auto).",
    )
    parser.add_argument(
        "--device", type=device, default=None, help="cpu or cuda (default: cuda when present)."
    )
    parser.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    return parser


def run(args: argparse.Namespace) -> int:
    from pagedkv.conformance import Scenario, run_scenario

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # decodes, a chunked prefill with context, a speculative step and a fresh prefill
    scenario = Scenario(
        "demo-mixed",
        seq_lens=(37, 129, 300, 64, 80),
        query_lens=(1, 1, 48, 4, 80),
        num_heads=8,
        num_kv_heads=2,
        head_size=64,
        dtype=getattr(torch, args.dtype),
        block_size=16,
        num_padding_tokens=2,
    )
    config = args.backend or default_config()
    backend = select_backend(config, scenario.spec(), device)
    print(f"config {config!r} -> backend {backend!r} on {device}")
    print(f"layer: {scenario.spec()}")
    rows = [
        [i, s, q, "decode" if q == 1 else ("prefill" if q == s else "chunked/spec")]
        for i, (s, q) in enumerate(zip(scenario.seq_lens, scenario.query_lens, strict=True))
    ]
    print(format_table(["request", "seq_len", "query_len", "kind"], rows))
    result = run_scenario(backend, scenario, device, backend_label=repr(backend))
    print(result.report())
    return 0 if result.passed else 1
