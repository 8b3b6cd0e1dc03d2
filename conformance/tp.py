"""Conformance under tensor parallelism: every scenario sharded over ``tp`` ranks.

    python -m pagedkv.conformance.tp --backend triton --tp 2 [--level full] [--device cuda]

Each rank (a process; gloo on CPUs, NCCL on GPUs) builds the same seeded problem,
keeps its query and KV heads (``pagedkv.distributed.shard_spec``: KV heads replicated
when tp > num_kv_heads, the MLA latent always), runs the backend over its own cache
with the same block tables — checked identical on every rank — and the heads are
all-gathered; rank 0 compares the whole output with the unsharded float64 reference,
with the tolerances of the single-GPU suite. Scenarios whose layer cannot be split
over ``tp`` ranks are reported as not applicable, with the reason. Exit code 0 only
when every applicable scenario passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import sys
import tempfile
from typing import Any

import torch


def _run_scenario(backend, scenario, shard_of, device: str, group_rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    from pagedkv.conformance.check import ScenarioResult, _check_output, _context_rows
    from pagedkv.conformance.problem import build_problem, poison_cache
    from pagedkv.distributed import same_on_every_rank

    problem = build_problem(scenario, device)
    spec = problem.spec
    shard = shard_of(spec)
    local = dataclasses.replace(problem, spec=shard.spec)
    record: dict[str, Any] = {"scenario": scenario.name, "failures": []}
    for name in ("block_table", "slot_mapping", "seq_lens", "query_start_loc"):
        if not same_on_every_rank(getattr(problem.common, name)):
            record["failures"].append(f"{name} differs between ranks")
    cache = backend.allocate_kv_cache(problem.num_blocks, shard.spec, device)
    poison_cache(backend, cache, local)
    sinks = None if problem.sinks is None else shard.query_slice(problem.sinks, dim=0).contiguous()
    builder = backend.make_builder(shard.spec, device)
    impl = backend.make_impl(shard.spec, sinks=sinks)
    if problem.context.num_actual_tokens:
        key, value = _context_rows(problem)
        impl.write_kv(
            shard.kv_slice(key).contiguous(),
            None if value is None else shard.kv_slice(value).contiguous(),
            cache,
            builder.build(problem.context),
        )
    out = impl.forward(
        shard.query_slice(problem.query).contiguous(),
        shard.kv_slice(problem.new_key).contiguous(),
        None if problem.new_value is None else shard.kv_slice(problem.new_value).contiguous(),
        cache,
        builder.build(problem.common),
    )
    # gather the heads (float32: every backend's dtype travels through gloo and NCCL)
    parts = [torch.empty_like(out, dtype=torch.float32) for _ in range(shard.tp_size)]
    dist.all_gather(parts, out.float().contiguous())
    if group_rank == 0:
        full = torch.cat(parts, dim=1).to(spec.dtype)
        result = ScenarioResult(f"{backend!r} tp={shard.tp_size}", scenario, device=device)
        _check_output(result, problem, full)
        record["failures"] += [str(f) for f in result.failures]
        record["max_abs_error"] = result.max_abs_error
    return record


def _worker(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    import torch.distributed as dist
    from pagedkv.conformance.design import design_scenarios
    from pagedkv.distributed import shard_problems, shard_spec
    from pagedkv.registry import get_backend
    from pagedkv.selection import parse_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.tp)
    device = f"cuda:{rank}" if cuda else "cpu"
    choice = parse_config(args.backend)[0]
    backend = get_backend(choice.name, **choice.options)
    plan = design_scenarios(backend, args.level, device)
    records = []
    for scenario in plan.scenarios:
        if args.scenarios and not any(fnmatch.fnmatch(scenario.name, p) for p in args.scenarios):
            continue
        why = shard_problems(scenario.spec(), args.tp)
        if why:
            records.append({"scenario": scenario.name, "not_applicable": "; ".join(why)})
            continue
        try:
            record = _run_scenario(
                backend, scenario, lambda s: shard_spec(s, args.tp, rank), device, rank
            )
        except Exception as exc:  # one rank's failure must not hang the others' collectives
            record = {
                "scenario": scenario.name,
                "failures": [f"raised {type(exc).__name__}: {exc}"],
            }
            dist.destroy_process_group()
            if rank == 0:
                records.append(record)
                with open(out_path, "w") as f:
                    json.dump(records, f)
            raise
        records.append(record)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(records, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv.conformance.tp", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--backend", required=True, help="one backend config, e.g. 'triton'")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    parser.add_argument("--level", default="quick", choices=["quick", "full"])
    parser.add_argument(
        "--device", default=None, help="cpu (gloo) or cuda (NCCL, one GPU per rank)"
    )
    parser.add_argument(
        "--scenarios", default="", help="only these scenario names (globs, comma-separated)"
    )
    args = parser.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.scenarios = [p for p in args.scenarios.split(",") if p]
    if args.tp < 1:
        parser.error(f"--tp {args.tp}: expected a positive number of ranks")
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        parser.error(
            f"--tp {args.tp} on cuda needs {args.tp} GPUs, this host has {torch.cuda.device_count()}"
        )
    import torch.multiprocessing as mp
    from pagedkv.distributed import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.json")
        mp.spawn(_worker, args=(args, free_port(), out_path), nprocs=args.tp, join=True)
        with open(out_path) as f:
            records = json.load(f)
    failed = [r for r in records if r.get("failures")]
    skipped = [r for r in records if "not_applicable" in r]
    passed = len(records) - len(failed) - len(skipped)
    for r in records:
        if "not_applicable" in r:
            print(f"  n/a   {r['scenario']}: {r['not_applicable']}")
        elif r["failures"]:
            print(
                f"  FAIL  {r['scenario']}:\n" + "\n".join(f"        - {x}" for x in r["failures"])
            )
        else:
            print(f"  pass  {r['scenario']} (max abs error {r['max_abs_error']:.3g})")
    print(
        f"pagedkv conformance under tp={args.tp} ({args.level} level, {args.device}), backend "
        f"{args.backend}: {passed} passed, {len(failed)} failed, {len(skipped)} not applicable"
    )
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main())
