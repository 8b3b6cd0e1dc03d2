"""A backend builder's decisions over drawn steps, written down so that two trees can be
compared: a rewrite of a tile, split or work-list rule that should change no plan (a
faster ``build``) changes no line of the digest.

    TRITON_INTERPRET=1 python benchmarks/plan_digest.py OUT.json [--backend triton|mla]
        [--seed S] [--sms N]
    python benchmarks/plan_digest.py --compare BEFORE.json AFTER.json

For each layer of the backend (triton: D 64 to 256, GQA 1 to 8, a sliding window; mla:
128 and 16 heads of a 512+64 latent): 60 eager steps (decodes with long-tailed
contexts, speculative, mixed, prefill) and 30 steps under each of three CUDA-graph
reservations (pure decode, speculative, chunked). Each step's record is what its
launches are made of: grids, tiles and splits, ints, the contents of the step's small
tensors (split counts, range and work lists, token slots), the shapes of its scratch
(uninitialised: split partials, a staged block table's padding). ``--sms`` plans for
that many SMs (default: the device's; the CPU stands in 4, which rarely splits; 132 is
an H200's). Runs on a CPU: nothing is launched.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
from typing import Any

import pagedkv
import torch
from pagedkv import AttentionSpec, CommonAttentionMetadata
from pagedkv.graph import GraphBounds

LAYERS = {
    "triton": [
        AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.float16, block_size=16),
        AttentionSpec(num_heads=8, num_kv_heads=8, head_size=64, dtype=torch.float16, block_size=32),
        AttentionSpec(num_heads=64, num_kv_heads=8, head_size=128, dtype=torch.float16, block_size=16),
        AttentionSpec(num_heads=16, num_kv_heads=2, head_size=256, dtype=torch.float16, block_size=64),
        AttentionSpec(
            num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.float16, block_size=16,
            sliding_window=1024,
        ),
    ],
    "mla": [
        AttentionSpec(
            num_heads=heads, num_kv_heads=1, head_size=576, dtype=torch.float16,
            block_size=64, scale=0.1, kv_lora_rank=512, qk_rope_head_dim=64,
        )
        for heads in (128, 16)
    ],
}  # fmt: skip
# arguments whose contents are not the plan's: scratch the kernels write, and the staged
# block table (its padding rows are whatever an earlier step left)
UNREAD = ("PartAcc", "PartMax", "PartSum", "BlockTable", "MidO", "MidLse")
MAX_CONTEXT = 40000


def _value(name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if name.startswith(UNREAD) or value.is_floating_point():
            return ["tensor", list(value.shape), str(value.dtype)]
        return ["tensor", list(value.shape), str(value.dtype), value.flatten().tolist()]
    if value is None or isinstance(value, (int, float, str, bool)):
        return value
    return repr(value)


def _launch(launch: Any) -> Any:
    if launch is None:
        return None
    return [list(launch.grid), {k: _value(k, v) for k, v in sorted(launch.kwargs.items())}]


def digest(metadata: Any) -> list[Any]:
    """One step's plan: the triton backend's split choice and each part's launches; the
    MLA backend's work list, token slots, merges and launches."""
    if hasattr(metadata, "parts"):
        parts = [
            [p.first, p.end, repr(p.plan), p.role, _launch(p.attention), _launch(p.reduce),
             None if p.gluon is None else {k: _value(k, v) for k, v in sorted(p.gluon.kwargs.items())}]
            for p in metadata.parts
        ]  # fmt: skip
        return [repr(metadata.step_choice), *parts]
    plan = metadata.plan
    return [
        _value("items", metadata.items), _value("token_ranges", metadata.token_ranges),
        _value("merges", metadata.merges), metadata.num_splits, metadata.kv_per_split,
        metadata.num_items, plan.kind, _launch(plan.attention), _launch(plan.reduce),
    ]  # fmt: skip


def _common(seq_lens: list[int], query_lens: list[int], block_size: int) -> CommonAttentionMetadata:
    tables, first = [], 1
    for n in seq_lens:
        tables.append(list(range(first, first + -(-n // block_size))))
        first += len(tables[-1])
    return CommonAttentionMetadata.from_requests(seq_lens, query_lens, tables, block_size)


def draw(rng: random.Random, kind: str) -> tuple[list[int], list[int]]:
    """(seq_lens, query_lens) of one step of ``kind``."""
    n = rng.choice([1, 2, 3, 7, 16, 33, 64, 128, 200, 512])
    scale = rng.choice([50, 300, 1000])
    seq = [int(min(MAX_CONTEXT, max(1, rng.paretovariate(1.2) * scale))) for _ in range(n)]
    if kind == "decode":
        query = [1] * n
    elif kind == "spec":
        query = [rng.randint(2, 8)] * n
    elif kind == "mixed":
        query = [1] * n
        for i in rng.sample(range(n), min(n, rng.randint(1, 3))):
            query[i] = rng.choice([17, 64, 256, 1000, 2048])
    else:  # prefill
        query = [rng.choice([100, 512, 2048]) for _ in range(min(n, 8))]
        seq = seq[: len(query)]
    return [max(s, q) for s, q in zip(seq, query, strict=True)], query


def record(backend_name: str, seed: int, gluon: bool = False) -> list[Any]:
    rng = random.Random(seed)
    backend = pagedkv.get_backend(backend_name)
    rows: list[Any] = []

    def builder_for(spec: Any) -> Any:
        builder = backend.make_builder(spec, "cpu")
        if gluon and backend_name == "triton":
            from pagedkv.backends.triton.gluon_plan import gluon_prefill_problem

            # as on an H200: the layer's other limits (a window, fp32) still apply
            builder.gluon_problem = gluon_prefill_problem(spec, "cpu", capability=(9, 0))
        return builder

    def step(layer: int, label: str, builder: Any, seq: list[int], query: list[int]) -> None:
        try:
            plan: Any = digest(builder.build(_common(seq, query, builder.spec.block_size)))
        except Exception as e:  # a refusal is a decision too
            plan = f"error {type(e).__name__}: {e}"
        rows.append([layer, label, seq, query, plan])

    for index, spec in enumerate(LAYERS[backend_name]):
        eager = builder_for(spec)
        for _ in range(60):
            kind = rng.choice(["decode", "decode", "spec", "mixed", "prefill"])
            step(index, "eager", eager, *draw(rng, kind))
        for max_query_len in (1, 8, 512):
            graph = builder_for(spec)
            max_reqs = 256
            tokens = 2048 if max_query_len == 512 else max_reqs * min(max_query_len, 4)
            width = MAX_CONTEXT // spec.block_size + 2
            graph.reserve_cuda_graph(GraphBounds(max_reqs, tokens, width, max_query_len))
            for _ in range(30):
                kind = "decode" if max_query_len == 1 else rng.choice(["decode", "spec", "mixed"])
                seq, query = draw(rng, kind)
                seq, query = seq[:max_reqs], [min(q, max_query_len) for q in query[:max_reqs]]
                while sum(query) > tokens:
                    query.pop()
                    seq.pop()
                step(index, f"graph {max_query_len}", graph, seq, query)
    return rows


def compare(before: str, after: str) -> int:
    with open(before) as f:
        a = json.load(f)
    with open(after) as f:
        b = json.load(f)
    if len(a) != len(b):
        print(f"{len(a)} steps against {len(b)}: not the same draw")
        return 1
    differ = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    for i in differ[:10]:
        layer, label, seq = a[i][:3]
        print(f"step {i} (layer {layer}, {label}, {len(seq)} requests) differs")
    print(f"{len(a) - len(differ)} of {len(a)} steps planned alike")
    return 1 if differ else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="write the digest here")
    p.add_argument("--backend", choices=sorted(LAYERS), default="triton")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sms", type=int, help="plan for this many SMs")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    p.add_argument(
        "--gluon",
        action="store_true",
        help="triton: plan the Gluon sm_90 prefill where an H200 would (a mixed step's chunk)",
    )
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        p.error("give OUT.json, or --compare BEFORE AFTER")
    if args.sms:  # the builder's module reads the SM count at construction
        module = importlib.import_module(f"pagedkv.backends.{args.backend}.builder")
        module.num_sms = lambda device: args.sms
    rows = record(args.backend, args.seed, args.gluon)
    with open(args.out, "w") as f:
        json.dump(rows, f)
    errors = sum(isinstance(r[4], str) for r in rows)
    print(f"{len(rows)} steps ({errors} refused) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
