"""``pagedkv capacity``: KV bytes per token and block, and what fits a memory budget."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedkv.cli.args import non_negative_float, non_negative_int, positive_float, positive_int
from pagedkv.errors import KVCacheUsageError, UsageError
from pagedkv.kv.capacity import (
    DTYPE_BYTES,
    GiB,
    KVShape,
    dtype_bytes,
    estimate_capacity,
    kv_budget_bytes,
    weights_bytes_per_rank,
)
from pagedkv.kv.presets import PRESETS, get_preset
from pagedkv.textutil import format_table


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "capacity",
        description=(
            "KV-cache bytes per token/block, and the blocks, tokens and requests a budget "
            "holds. Memory figures are binary: --gpu-memory 80 means 80 GiB (80 x 1024^3 "
            "bytes). Bytes are per tensor-parallel rank."
        ),
    )
    model = parser.add_argument_group("model (a preset, or the shape by hand)")
    model.add_argument("--model", choices=sorted(PRESETS), help="A model preset.")
    model.add_argument(
        "--num-layers", type=positive_int, help="Attention layers (overrides the preset)."
    )
    model.add_argument("--num-kv-heads", type=positive_int, help="KV heads per layer.")
    model.add_argument(
        "--head-size", type=positive_int, help="K head size (MLA: the latent row size)."
    )
    model.add_argument(
        "--head-size-v", type=positive_int, help="V head size (default: --head-size)."
    )
    model.add_argument("--mla", action="store_true", help="One latent row per token (MLA).")
    parser.add_argument(
        "--kv-dtype",
        choices=list(DTYPE_BYTES),
        help="Cache dtype (default: the model's, else float16).",
    )
    parser.add_argument(
        "--tp", type=positive_int, default=1, help="Tensor-parallel degree (default 1)."
    )
    parser.add_argument(
        "--block-size", type=positive_int, default=16, help="Tokens per block (default 16)."
    )
    budget = parser.add_argument_group("budget (GiB per GPU)")
    budget.add_argument("--kv-budget", type=positive_float, help="KV bytes available, in GiB.")
    budget.add_argument("--gpu-memory", type=positive_float, help="GPU memory in GiB.")
    budget.add_argument(
        "--weights",
        type=non_negative_float,
        help="Weights per GPU in GiB, with --gpu-memory (default: preset parameters x weight "
        "dtype / tp).",
    )
    budget.add_argument(
        "--overhead",
        type=non_negative_float,
        help="Activations, workspace, CUDA graphs in GiB, with --gpu-memory (default 0).",
    )
    load = parser.add_argument_group("load")
    load.add_argument("--prompt-len", type=positive_int, help="Average prompt tokens per request.")
    load.add_argument(
        "--output-len", type=non_negative_int, help="Average output tokens (with --prompt-len)."
    )
    load.add_argument(
        "--concurrency", type=positive_int, help="Target concurrent requests (with --prompt-len)."
    )
    parser.add_argument("--json", action="store_true", help="Print the figures as JSON.")
    return parser


def check_combination(args: argparse.Namespace) -> None:
    """Raise UsageError for options that make no sense together (each alone is checked
    by its argparse type)."""
    needs = [
        ("--output-len", args.output_len, "--prompt-len", args.prompt_len),
        ("--concurrency", args.concurrency, "--prompt-len", args.prompt_len),
        ("--weights", args.weights, "--gpu-memory", args.gpu_memory),
        ("--overhead", args.overhead, "--gpu-memory", args.gpu_memory),
    ]
    for option, value, needed, given in needs:
        if value is not None and given is None:
            raise UsageError(f"{option} needs {needed}")
    if args.kv_budget is not None and args.gpu_memory is not None:
        raise UsageError("give --kv-budget or --gpu-memory, not both")
    if args.mla and args.model:
        raise UsageError("--mla describes a model by hand: a --model preset says whether it is MLA")


def run(args: argparse.Namespace) -> int:
    check_combination(args)
    preset = get_preset(args.model) if args.model else None
    try:  # every value was given on the command line: what the maths refuses is a usage error
        shape = _shape(args, preset)
        kv_dtype = args.kv_dtype or (preset.dtype if preset else "float16")
        budget, budget_note = _budget(args, preset)
        request_len = None
        if args.prompt_len is not None:
            request_len = args.prompt_len + (args.output_len or 0)
        est = estimate_capacity(
            shape,
            dtype_bytes(kv_dtype),
            tp=args.tp,
            block_size=args.block_size,
            kv_budget=budget,
            request_len=request_len,
            concurrency=args.concurrency,
        )
    except KVCacheUsageError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        record = {"model": args.model, "kv_dtype": kv_dtype, **est.as_dict()}
        print(json.dumps(record, indent=2))
        return 0
    kind = "MLA latent" if shape.is_mla else f"{shape.num_kv_heads} KV heads"
    rows = [
        [
            "model",
            args.model or "custom",
            f"{shape.num_layers} layers, {kind}, head {shape.head_size}",
        ],
        ["kv dtype", kv_dtype, f"{est.kv_dtype_bytes} B per value, tp={args.tp}"],
        ["bytes / token / layer", _b(est.bytes_per_token_per_layer), "per rank"],
        ["bytes / token", _b(est.bytes_per_token), f"x {shape.num_layers} layers"],
        [
            "bytes / block / layer",
            _b(est.bytes_per_block_per_layer),
            f"block_size {est.block_size}",
        ],
        ["bytes / block", _b(est.bytes_per_block), "all layers (a complete block)"],
    ]
    if est.kv_budget_bytes is not None:
        rows += [
            ["kv budget", _b(est.kv_budget_bytes), budget_note],
            ["tokens", f"{est.num_tokens:,}", "budget / bytes per token"],
            ["blocks", f"{est.num_blocks:,}", "budget / bytes per block"],
        ]
    if est.request_len is not None:
        rows.append(
            ["blocks / request", f"{est.blocks_per_request:,}", f"{est.request_len} tokens"]
        )
        if est.max_concurrency is not None:
            rows.append(
                ["max concurrency", f"{est.max_concurrency:,}", "blocks / blocks per request"]
            )
        if est.blocks_for_concurrency is not None:
            verdict = "" if est.fits is None else ("fits" if est.fits else "does NOT fit")
            rows.append(
                [
                    f"blocks for {est.concurrency} requests",
                    f"{est.blocks_for_concurrency:,}",
                    verdict,
                ]
            )
    print(format_table(["quantity", "value", "note"], rows))
    return 0


def _shape(args: argparse.Namespace, preset: Any) -> KVShape:
    by_hand = args.num_layers and args.head_size and (args.num_kv_heads or args.mla)
    if preset is None and not by_hand:
        raise UsageError(
            "give --model, or --num-layers, --num-kv-heads and --head-size "
            "(--mla with --num-layers and --head-size)"
        )
    base = KVShape.from_preset(preset) if preset else None
    mla = args.mla or (base.is_mla if base else False)
    if mla and (args.num_kv_heads is not None or args.head_size_v is not None):
        raise UsageError(
            "an MLA model caches one latent row per token: --num-kv-heads and --head-size-v "
            "do not apply"
        )
    return KVShape(
        num_layers=args.num_layers or (base.num_layers if base else 0),
        num_kv_heads=1 if mla else (args.num_kv_heads or (base.num_kv_heads if base else 0)),
        head_size=args.head_size or (base.head_size if base else 0),
        head_size_v=args.head_size_v,
        is_mla=mla,
    )


def _budget(args: argparse.Namespace, preset: Any) -> tuple[int | None, str]:
    if args.kv_budget is not None:
        return int(args.kv_budget * GiB), "given"
    if args.gpu_memory is None:
        return None, ""
    if args.weights is not None:
        weights = int(args.weights * GiB)
        how = "given"
    elif preset is not None:
        weights = weights_bytes_per_rank(preset, args.tp)
        how = f"{preset.num_params / 1e9:.1f}B params x {preset.weight_dtype} / tp"
    else:
        raise UsageError("--gpu-memory needs --weights (or a --model preset to estimate them)")
    overhead = args.overhead or 0.0
    budget = kv_budget_bytes(int(args.gpu_memory * GiB), weights, int(overhead * GiB))
    note = (
        f"{args.gpu_memory:g} GiB - {weights / GiB:.2f} GiB weights ({how}) - "
        f"{overhead:g} GiB overhead"
    )
    return budget, note


def _b(n: int) -> str:
    """Bytes, with the largest binary unit that keeps the figure >= 1."""
    for unit, size in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n:,} B ({n / size:,.4g} {unit})"
    return f"{n:,} B"
