"""What the always-on step checks cost: CPU time of ``check_step`` and of a whole
``builder.build()`` for 1, 64 and 512 requests (decode steps, 4k-token contexts).

    python benchmarks/build_overhead.py [--backends torch,triton] [--device cpu|cuda]

Host time only: the checks read the metadata's CPU copies and never sync the device.
Medians of repeated calls (``time.thread_time``, so other processes on the machine
count less); the figure to compare with is a model step's time, milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import pagedkv
import torch
from pagedkv import AttentionSpec, CommonAttentionMetadata
from pagedkv.step_check import check_step

SPEC = AttentionSpec(
    num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.float16, block_size=16
)


def step(num_reqs: int, device: str) -> CommonAttentionMetadata:
    blocks_per_req = 4096 // 16 + 1
    blocks = [
        list(range(1 + i * blocks_per_req, 1 + (i + 1) * blocks_per_req)) for i in range(num_reqs)
    ]
    return CommonAttentionMetadata.from_requests(
        [4096] * num_reqs, [1] * num_reqs, blocks, 16, device
    )


def median_us(fn, repeats: int = 2000) -> float:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(repeats // 100):
        start = time.thread_time()
        for _ in range(100):
            fn()
        samples.append((time.thread_time() - start) / 100)
    return 1e6 * statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="torch")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    print(
        f"{'requests':>8}  {'check_step us':>13}  "
        + "  ".join(f"{b + ' build us':>16}" for b in args.backends.split(","))
    )
    for n in (1, 64, 512):
        common = step(n, args.device)
        row = [f"{n:>8}", f"{median_us(lambda c=common: check_step(c, 16)):>13.1f}"]
        for config in args.backends.split(","):
            builder = pagedkv.select_backend(config, SPEC, args.device).make_builder(
                SPEC, args.device
            )
            row.append(f"{median_us(lambda c=common, b=builder: b.build(c), 500):>16.1f}")
        print("  ".join(row))


if __name__ == "__main__":
    main()
