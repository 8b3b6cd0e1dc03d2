"""Operations per second of the KV-cache core (CPU; pure Python / numpy).

    python benchmarks/kv_manager.py [--num-blocks 1000000] [--repeat 5]

Each figure is the best of ``--repeat`` timed runs. Times are process CPU time by
default (``--clock wall`` for wall-clock): on a shared machine, time spent waiting
for a core is not the code's cost.
torch runs single-threaded: the only torch work is the block-table commit, a copy
of a few hundred KiB that a thread pool slows down on a small, shared CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import random
import time
from collections.abc import Callable

import numpy as np
import torch
from pagedkv.kv import BlockPool, KVCacheManager, Request, ScheduledRequest, StepAssembler
from pagedkv.slots import compute_slot_mapping
from pagedkv.textutil import format_table

CLOCK = time.process_time


def best_of(repeat: int, fn: Callable[[], int]) -> tuple[float, int]:
    """(best seconds, operations per run) over ``repeat`` runs of ``fn``."""
    times, ops = [], 0
    for _ in range(repeat):
        t0 = CLOCK()
        ops = fn()
        times.append(CLOCK() - t0)
    return min(times), ops


def bench_pool(num_blocks: int, repeat: int, rows: list[list[str]]) -> None:
    t0 = CLOCK()
    pool = BlockPool(num_blocks)
    rows.append(["BlockPool init", f"{num_blocks:,} blocks", f"{CLOCK() - t0:.2f} s", ""])
    n = min(100_000, num_blocks - 1)

    def alloc_free_1() -> int:
        for _ in range(n):
            pool.free_blocks(pool.get_new_blocks(1))
        return n

    def alloc_free_16() -> int:
        for _ in range(n // 16):
            pool.free_blocks(pool.get_new_blocks(16))
        return n // 16 * 16

    # cached blocks freed to the queue: a prefix hit takes them out of the middle
    held = pool.get_new_blocks(n)
    pool.cache_full_blocks(held, [i.to_bytes(8, "little") for i in range(n)], 0, n)
    pool.free_blocks(held)
    order = list(held)
    random.Random(0).shuffle(order)

    def touch_free() -> int:
        pool.touch(order)  # ref_cnt 0 -> 1: removed from the free queue
        pool.free_blocks(order)  # back to the queue tail
        return len(order)

    for name, fn in (
        ("get_new_blocks(1) + free_blocks", alloc_free_1),
        ("get_new_blocks(16) + free_blocks", alloc_free_16),
        ("touch (revive) + free_blocks", touch_free),
    ):
        secs, ops = best_of(repeat, fn)
        rows.append(
            [name, f"{ops:,} blocks", f"{secs * 1e9 / ops:.0f} ns/block", f"{ops / secs:,.0f}"]
        )


def bench_prefix_lookup(repeat: int, rows: list[list[str]]) -> None:
    tokens = [random.Random(1).randrange(128_000) for _ in range(32 * 1024)]
    algos = ["sha256"] + (["xxhash"] if importlib.util.find_spec("xxhash") else [])
    for algo in algos:
        manager = KVCacheManager(4096, 16, 32 * 1024 + 16, hash_algo=algo)
        first = Request("warm", tokens)
        assert manager.allocate_slots(first, len(tokens)) is not None
        manager.mark_computed(first, len(tokens))  # caches 2048 blocks

        def lookup_cold(manager: KVCacheManager = manager) -> int:
            # hashing 2048 blocks + 2047 hash-map hits
            blocks, _ = manager.get_computed_blocks(Request("q", tokens))
            assert len(blocks) == 2047
            return 1

        secs, _ = best_of(repeat, lookup_cold)
        rows.append(
            [
                f"prefix lookup 32k tokens ({algo})",
                "2,047 blocks hit",
                f"{secs * 1e3:.2f} ms",
                f"{1 / secs:,.0f}",
            ]
        )
    hashed = Request("h", tokens)
    manager.get_computed_blocks(hashed)  # hashes now cached on the request

    def lookup_warm() -> int:
        manager.get_computed_blocks(hashed)
        return 1

    secs, _ = best_of(repeat, lookup_warm)
    rows.append(
        [
            "prefix lookup 32k, hashes known",
            "2,047 blocks hit",
            f"{secs * 1e3:.2f} ms",
            f"{1 / secs:,.0f}",
        ]
    )


def bench_decode_step(repeat: int, rows: list[list[str]]) -> None:
    manager = KVCacheManager(100_000, 16, 8192, enable_prefix_caching=True)
    reqs = [Request(f"r{i}", list(range(i, i + 1000))) for i in range(256)]
    for r in reqs:
        assert manager.allocate_slots(r, r.num_tokens) is not None
        manager.mark_computed(r, r.num_tokens)

    def one_step() -> int:  # 256 requests x 16 decode tokens: allocate, then mark computed
        for _ in range(16):
            for r in reqs:
                r.append_output_token_ids(7)
                manager.allocate_slots(r, 1)
                manager.mark_computed(r, 1)
        return 16 * len(reqs)

    secs, ops = best_of(repeat, one_step)
    rows.append(
        [
            "allocate_slots + mark_computed",
            f"{ops:,} calls",
            f"{secs * 1e6 / ops:.2f} us/call",
            f"{ops / secs:,.0f}",
        ]
    )


def bench_slot_mapping(repeat: int, rows: list[list[str]]) -> None:
    # 8192 tokens over 256 requests: 224 decodes + 32 chunks of 249 prefill tokens
    rng = np.random.default_rng(0)
    query_lens = np.array([1] * 224 + [249] * 32)
    assert query_lens.sum() == 8192
    seq_lens = query_lens + rng.integers(0, 3000, 256)
    block_size, max_blocks = 16, 512
    table = rng.integers(1, 100_000, (256, max_blocks)).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq32 = seq_lens.astype(np.int32)

    def slots() -> int:
        for _ in range(100):
            compute_slot_mapping(table, qsl, seq32, block_size)
        return 100

    secs, ops = best_of(repeat, slots)
    rows.append(
        [
            "compute_slot_mapping 8k tok/256 req",
            "8,192 slots",
            f"{secs * 1e6 / ops:.0f} us",
            f"{ops / secs:,.0f}",
        ]
    )

    asm = StepAssembler(block_size, 256, max_blocks * block_size)
    scheduled = [
        ScheduledRequest(
            f"r{i}",
            int(seq_lens[i] - query_lens[i]),
            int(query_lens[i]),
            table[i, : -(-seq_lens[i] // block_size)].tolist(),
        )
        for i in range(256)
    ]
    asm.build(scheduled)  # rows now resident
    steady = [
        ScheduledRequest(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in scheduled
    ]

    def build() -> int:
        for _ in range(20):
            asm.build(steady)
        return 20

    secs, ops = best_of(repeat, build)
    rows.append(
        [
            "StepAssembler.build 8k tok/256 req",
            "metadata (cpu)",
            f"{secs * 1e6 / ops:.0f} us",
            f"{ops / secs:,.0f}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--clock", choices=["process", "wall"], default="process")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "process" else time.perf_counter
    torch.set_num_threads(1)
    rows: list[list[str]] = []
    bench_pool(args.num_blocks, args.repeat, rows)
    bench_prefix_lookup(args.repeat, rows)
    bench_decode_step(args.repeat, rows)
    bench_slot_mapping(args.repeat, rows)
    machine = platform.processor() or platform.machine()
    print(
        f"{args.clock} time; python {platform.python_version()}, numpy {np.__version__}, {machine}"
    )
    print(format_table(["operation", "size", "time", "ops/s"], rows))


if __name__ == "__main__":
    main()
