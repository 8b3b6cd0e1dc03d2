"""Throughput of live KV-cache conversion (``pagedkv.convert_kv_cache``) between the
installed backends' layouts, against a device copy of the same bytes in the same run.

For each ordered pair of layouts it converts a cache of ``--gib`` GiB (bf16, Hkv 8,
D 128, block 16 by default) whole and, with ``blocks=``, a quarter of its blocks in
random order, and prints GB/s of cache converted (source bytes / time) and the time
against ``dst.copy_(src)`` of the same bytes (the ceiling: conversion reads and
writes each byte once, plus its bounded chunk buffer's round trip). Pairs that share
their bytes are zero-copy and are listed as such.

    python benchmarks/convert_throughput.py                  # every installed layout pair
    python benchmarks/convert_throughput.py --gib 1 --backends 'torch;pallas'
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch
from pagedkv import convert_kv_cache
from pagedkv.bench.timing import time_us
from pagedkv.errors import PagedKVError
from pagedkv.selection import select_backend
from pagedkv.spec import AttentionSpec
from pagedkv.textutil import format_table

# one backend per standard layout (the rest share one of these layouts' bytes)
DEFAULT_BACKENDS = "torch;flashinfer;flashinfer(kv_layout=HND);pallas"


def _backends(configs: str, spec: AttentionSpec, device: torch.device) -> list[tuple[str, object]]:
    """(config, backend) for each config string that selects here."""
    out = []
    for config in configs.split(";"):
        try:
            out.append((config, select_backend(config, spec, device)))
        except PagedKVError as e:
            print(f"skip {config}: {e}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--backends", default=DEFAULT_BACKENDS, help="Backend configs, separated by ';'."
    )
    p.add_argument("--gib", type=float, default=4.0, help="Cache size in GiB.")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("convert_throughput: needs a CUDA device")
    device = torch.device("cuda")
    spec = AttentionSpec(
        num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=16
    )
    block_bytes = spec.kv_bytes_per_token() * spec.block_size
    num_blocks = int(args.gib * (1 << 30)) // block_bytes
    backends = _backends(args.backends, spec, device)
    gen = torch.Generator(device=device).manual_seed(0)
    some = torch.randperm(num_blocks - 1, generator=gen, device=device)[: num_blocks // 4] + 1

    rows, results = [], []
    for src_name, src in backends:
        src_cache = src.allocate_kv_cache(num_blocks, spec, device)
        src_cache.normal_(generator=gen)  # never time on zeros
        nbytes = src_cache.numel() * src_cache.element_size()
        copy_us = time_us(partial(torch.empty_like(src_cache).copy_, src_cache), device)
        for dst_name, dst in backends:
            if dst_name == src_name:
                continue
            out = dst.allocate_kv_cache(num_blocks, spec, device)
            converted = convert_kv_cache(src, src_cache, dst, spec, out=out)
            if converted is src_cache:
                rows.append([src_name, dst_name, "zero-copy", "", "", ""])
                results.append(dict(src=src_name, dst=dst_name, zero_copy=True))
                continue
            convert = partial(convert_kv_cache, src, src_cache, dst, spec, out=out)
            whole_us = time_us(convert, device)
            part_us = time_us(partial(convert, blocks=some), device)
            gbps = nbytes / whole_us / 1e3
            part_gbps = nbytes / 4 / part_us / 1e3
            rows.append(
                [
                    src_name,
                    dst_name,
                    f"{whole_us:.0f}",
                    f"{gbps:.0f}",
                    f"{copy_us / whole_us:.2f}",
                    f"{part_gbps:.0f}",
                ]
            )
            results.append(
                dict(
                    src=src_name,
                    dst=dst_name,
                    bytes=nbytes,
                    us=whole_us,
                    gbps=gbps,
                    copy_us=copy_us,
                    vs_copy=copy_us / whole_us,
                    quarter_blocks_gbps=part_gbps,
                )
            )
            out = converted = convert = None  # free the destination before the next one
        src_cache = None
        torch.cuda.empty_cache()
    print(
        f"{torch.cuda.get_device_name()}: bf16 Hkv 8 D 128 block 16, {num_blocks} blocks "
        f"({args.gib:g} GiB)"
    )
    headers = ["from", "to", "us", "GB/s", "vs copy", "GB/s (1/4 of blocks)"]
    print(format_table(headers, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
