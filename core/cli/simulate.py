"""``pagedkv simulate``: KV utilisation of contiguous and paged allocators on one trace."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pagedkv.cli.args import (
    check_writable,
    existing_file,
    non_negative_int,
    positive_int,
    positive_int_list,
)
from pagedkv.errors import KVCacheUsageError, TraceFormatError, UsageError
from pagedkv.kv.capacity import GiB, KVShape, estimate_capacity
from pagedkv.kv.presets import get_preset
from pagedkv.kv.simulate import TABLE_HEADERS, markdown_table, plot, simulate, table_rows
from pagedkv.kv.trace import load_trace, sharegpt_like
from pagedkv.textutil import format_table


def default_pool_tokens() -> int:
    """The chapter's example pool: Llama-3-70B, TP=2, a 6 GiB KV budget per GPU."""
    shape = KVShape.from_preset(get_preset("llama-3-70b"))
    est = estimate_capacity(shape, 2, tp=2, kv_budget=6 * GiB)
    assert est.num_tokens is not None
    return est.num_tokens


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "simulate",
        description="Replay a request trace through contiguous and paged KV allocators; "
        "print utilisation, write a table and a PNG.",
    )
    parser.add_argument(
        "--trace",
        type=existing_file,
        help="CSV (header) or JSONL of prompt_len/output_len (default: synthetic).",
    )
    parser.add_argument(
        "--num-requests", type=positive_int, default=1000, help="Synthetic ShareGPT-like requests."
    )
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="Seed of the synthetic trace."
    )
    parser.add_argument("--max-model-len", type=positive_int, default=2048, help="Longest request.")
    parser.add_argument(
        "--pool-tokens",
        type=positive_int,
        default=None,
        help="Token slots in the KV pool (default: the chapter's Llama-3-70B TP=2 6 GiB pool).",
    )
    parser.add_argument(
        "--granule", type=positive_int, default=64, help="Rounding of the grow allocator."
    )
    parser.add_argument(
        "--block-sizes",
        type=positive_int_list,
        default=[8, 16, 32, 128],
        help="Paged block sizes, comma-separated (default 8,16,32,128).",
    )
    parser.add_argument("--max-num-seqs", type=positive_int, default=256, help="Batch size limit.")
    parser.add_argument(
        "--output",
        default="kv-simulation",
        help="Path prefix of the outputs: PREFIX.md (table) and PREFIX.png (plot).",
    )
    parser.add_argument("--no-plot", action="store_true", help="Skip the PNG.")
    return parser


def run(args: argparse.Namespace) -> int:
    prefix = Path(args.output)
    table_path = prefix.with_name(prefix.name + ".md")
    png_path = prefix.with_name(prefix.name + ".png")
    check_writable("--output", [table_path] + ([] if args.no_plot else [png_path]))
    try:  # every input came from the command line: what the simulation refuses is a usage error
        if args.trace:
            trace = load_trace(args.trace, max_model_len=args.max_model_len)
            source = f"trace {args.trace}"
        else:
            trace = sharegpt_like(
                args.num_requests, max_model_len=args.max_model_len, seed=args.seed
            )
            source = f"synthetic ShareGPT-like trace, seed {args.seed}"
        pool = args.pool_tokens if args.pool_tokens is not None else default_pool_tokens()
        mean_prompt = sum(r.prompt_len for r in trace) / len(trace)
        mean_output = sum(r.output_len for r in trace) / len(trace)
        header = (
            f"{len(trace)} requests ({source}; mean prompt {mean_prompt:.1f}, mean output "
            f"{mean_output:.1f} tokens), pool {pool:,} token slots, max_model_len "
            f"{args.max_model_len}"
        )
        print(header)
        results = simulate(
            trace,
            pool,
            args.max_model_len,
            granule=args.granule,
            block_sizes=args.block_sizes,
            max_num_seqs=args.max_num_seqs,
        )
    except (KVCacheUsageError, TraceFormatError) as exc:
        raise UsageError(str(exc)) from None
    print(format_table(TABLE_HEADERS, table_rows(results)))
    table_path.write_text(header + "\n\n" + markdown_table(results))
    print(f"table: {table_path}")
    if not args.no_plot:
        title = f"KV pool use: {len(trace)} requests, {pool:,} token slots"
        png = plot(results, png_path, title=title)
        print(f"plot: {png}")
    return 0
