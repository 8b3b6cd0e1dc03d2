"""Serving throughput of a Llama-3-8B-shaped model on pagedkv's engine, against
transformers' continuous batching (``generate_batch``) and static ``generate``.

Random bf16 weights, all 32 layers. Requests: prompts of 512-2048 tokens built on a
few shared prefixes, 128-256 output tokens each, all submitted at once; decode
steps replay CUDA graphs when the backend supports them. Printed per request count:
output tokens/s, time per decode step against the physical floor (weights and the
step's KV read once at the measured copy bandwidth), the share of step time in
attention (a separate eager pass with CUDA events around every attention call), and
the same prompts with one fixed output length through pagedkv, ``generate_batch``
(sdpa) and static ``generate`` (sdpa), in this process.

    python benchmarks/serving_throughput.py --backend triton --requests 64 256
    python benchmarks/serving_throughput.py --backend flashinfer --requests 64
    python benchmarks/serving_throughput.py --tiny      # CPU smoke: a tiny model, seconds
    python benchmarks/serving_throughput.py --requests 64 --kernel-profile 5   # + where the
        # decode step's device time goes: kernels by kind (matmul, attention, other), top 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from pagedkv.bench.profile import KernelProfile
from pagedkv.intmath import cdiv
from pagedkv.models import HFModel, builtin_config, random_model, reference_attention
from pagedkv.serving import Engine, EngineConfig, ModelKVCache, SamplingParams, StepAttention
from pagedkv.textutil import format_table

LLAMA_3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
)


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num_requests: int,
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
    num_prefixes: int,
    prefix_len: int,
    vocab_size: int,
    seed: int,
) -> Workload:
    """Prompts of prompt_lens[0]..[1] tokens, request i starting with prefix i % num_prefixes."""
    g = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int, n: int = 1) -> list[int]:
        return torch.randint(low, high + 1, (n,), generator=g).tolist()

    prefixes = [randint(0, vocab_size - 1, prefix_len) for _ in range(num_prefixes)]
    prompts, outs = [], []
    for i in range(num_requests):
        length = randint(*prompt_lens)[0]
        prompts.append(prefixes[i % num_prefixes] + randint(0, vocab_size - 1, length - prefix_len))
        outs.append(randint(*output_lens)[0])
    return Workload(prompts, outs)


@dataclass
class StepRecord:
    seconds: float
    pure_decode: bool
    num_seqs: int
    context_tokens: int  # tokens whose K/V the step reads
    replay: Any = None  # (start, end) CUDA events around the step's graph replay


class TimedGraph:
    """A captured CUDA graph whose replays record CUDA events: the GPU time of a
    decode step, apart from the host work around it (schedule, metadata, sampling)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, events: list[Any]) -> None:
        self.graph, self.events = graph, events

    def replay(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.events.append((start, end))

    def pool(self) -> Any:
        return self.graph.pool()


@dataclass
class EngineRun:
    seconds: float
    output_tokens: int
    steps: list[StepRecord] = field(default_factory=list)
    prefix_hit_rate: float = 0.0
    graph_replays: int = 0

    @property
    def decode_steps(self) -> list[StepRecord]:
        return [s for s in self.steps if s.pure_decode]


def engine_config(
    args: argparse.Namespace,
    device: str,
    work: Workload,
    cuda_graph: bool,
    async_scheduling: bool = False,
) -> EngineConfig:
    max_len = max(len(p) + o for p, o in zip(work.prompts, work.output_lens, strict=True))
    block = args.block_size
    # every request resident at once (no preemption): sum of their blocks, plus the null block
    blocks = sum(
        cdiv(len(p) + o, block) for p, o in zip(work.prompts, work.output_lens, strict=True)
    )
    return EngineConfig(
        backend=args.backend,
        device=device,
        block_size=block,
        num_blocks=blocks + 1,
        max_model_len=cdiv(max_len, block) * block,
        max_num_seqs=len(work.prompts),
        max_num_batched_tokens=args.max_num_batched_tokens,
        cuda_graph=cuda_graph,
        async_scheduling=async_scheduling,
    )


def run_engine(engine: Engine, work: Workload, sync: Callable[[], None]) -> EngineRun:
    """All requests at once; one StepRecord per step (each step ends in a host sync:
    the sampled tokens come back to the host)."""
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n))
    records: list[StepRecord] = []
    execute = engine.runner.execute
    replays: list[Any] = []
    graphs = engine.runner.graphs
    for captured in graphs.graphs.values() if graphs is not None else ():
        if isinstance(captured.graph, TimedGraph):
            captured.graph.events = replays  # wrapped by an earlier run: this run's list
        elif captured.graph is not None:
            captured.graph = TimedGraph(captured.graph, replays)  # type: ignore[assignment]

    def recorded(plan: Any, feed: Any = None) -> torch.Tensor:
        record = StepRecord(
            0.0,
            plan.is_pure_decode,
            len(plan.seqs),
            sum(s.num_computed_tokens + s.num_new_tokens for s in plan.seqs),
        )
        records.append(record)
        before = len(replays)
        logits = execute(plan, feed)
        if len(replays) > before:
            record.replay = replays[-1]
        return logits

    engine.runner.execute = recorded  # type: ignore[method-assign]
    sync()
    start = time.perf_counter()
    produced = 0
    try:
        while engine.has_unfinished():
            t0 = time.perf_counter()
            before = len(records)
            for out in engine.step():
                produced += sum(len(s.token_ids) for s in out.samples)
            if len(records) > before:  # not the drain of an async engine's last step
                records[-1].seconds = time.perf_counter() - t0
    finally:
        engine.runner.execute = execute  # type: ignore[method-assign]
    seconds = time.perf_counter() - start
    graphs = engine.runner.graphs
    return EngineRun(
        seconds,
        produced,
        records,
        engine.stats.prefix_hit_rate,
        graphs.num_replays if graphs is not None else 0,
    )


@contextmanager
def attention_timer(device: str) -> Iterator[list[Any]]:
    """Time every StepAttention.forward: CUDA event pairs on a GPU, host time on a CPU."""
    pairs: list[Any] = []
    original = StepAttention.forward

    def timed(self: StepAttention, *args: Any, **kwargs: Any) -> torch.Tensor:
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = original(self, *args, **kwargs)
            end.record()
            pairs.append((start, end))
        else:
            t0 = time.perf_counter()
            out = original(self, *args, **kwargs)
            pairs.append(time.perf_counter() - t0)
        return out

    StepAttention.forward = timed  # type: ignore[method-assign]
    try:
        yield pairs
    finally:
        StepAttention.forward = original  # type: ignore[method-assign]


def attention_share(
    model: HFModel, args: argparse.Namespace, device: str, work: Workload, sync: Callable[[], None]
) -> tuple[float, float]:
    """(share of decode-step time in attention, mean eager decode step s), eager pass."""
    engine = Engine(model, engine_config(args, device, work, cuda_graph=False))
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=n))
    scheduler = engine.scheduler
    while scheduler.waiting or any(seq.num_uncomputed > 1 for seq in scheduler.running):
        engine.step()  # every prompt computed: the timed steps are pure decodes
    step_s, attn_s = [], []
    for _ in range(args.profile_steps):
        if not engine.has_unfinished():
            break
        with attention_timer(device) as pairs:
            sync()
            t0 = time.perf_counter()
            engine.step()
            sync()
            step_s.append(time.perf_counter() - t0)
        if device == "cuda":
            attn_s.append(sum(a.elapsed_time(b) for a, b in pairs) / 1e3)
        else:
            attn_s.append(sum(pairs))
    del engine
    _free(device)
    if not step_s:
        return float("nan"), float("nan")
    return sum(attn_s) / sum(step_s), statistics.mean(step_s)


# kernel names by what they compute; a name matching none is "other" (norms, rotary
# embeddings, activations, residual adds, copies: what a compiler would fuse)
KERNEL_KINDS = (
    # GPU kernels (cuBLAS, CUTLASS), then the CPU's operators
    (
        "matmul",
        ("gemm", "gemv", "cutlass", "cublas", "nvjet", "xmma", "splitk", "::mm", "addmm", "bmm"),
    ),
    (
        "attention",
        ("attention", "attn", "flashinfer", "flash", "reduce_splits", "write_kv", "merge_by_lse"),
    ),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, words in KERNEL_KINDS:
        if any(w in lowered for w in words):
            return kind
    return "other"


def kernel_profile(
    model: HFModel,
    args: argparse.Namespace,
    device: str,
    work: Workload,
    cuda_graph: bool,
    async_scheduling: bool,
) -> tuple[list[list[str]], list[list[str]]]:
    """Where a pure decode step's device time goes: ``args.kernel_profile`` steps (CUDA
    graph replays when ``cuda_graph``) under torch.profiler, every GPU kernel (or on a
    CPU, every operator's self time) summed per name. Returns (by kind, top kernels):
    rows of name, launches per step, microseconds per step, share of the step."""
    engine = Engine(model, engine_config(args, device, work, cuda_graph, async_scheduling))
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        engine.add_request(f"k{i}", prompt, SamplingParams(max_tokens=n))
    scheduler = engine.scheduler
    while scheduler.waiting or any(seq.num_uncomputed > 1 for seq in scheduler.running):
        engine.step()  # every prompt computed: the profiled steps are pure decodes
    for _ in range(2):
        engine.step()  # the decode graphs of this batch size captured
    steps = 0
    with KernelProfile(device) as prof:
        for _ in range(args.kernel_profile):
            if not engine.has_unfinished():
                break
            engine.step()  # launches one step (async: and takes the previous one's tokens)
            steps += 1
    del engine
    _free(device)
    totals = prof.totals()
    steps = max(1, steps)
    whole = sum(t for _, t in totals.values()) or 1.0
    kinds: dict[str, list[float]] = {}
    for name, (count, us) in totals.items():
        entry = kinds.setdefault(kernel_kind(name), [0, 0.0])
        entry[0] += count
        entry[1] += us

    def row(name: str, count: float, us: float) -> list[str]:
        return [name[:72], f"{count / steps:.0f}", f"{us / steps:,.1f}", f"{us / whole:.1%}"]

    by_kind = [row(k, c, us) for k, (c, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1])]
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[: args.kernel_profile_top]
    return by_kind, [row(name, c, us) for name, (c, us) in ranked]


def copy_bandwidth(device: str) -> float:
    """Bytes moved (read + written) per second by a large device-to-device copy."""
    if device != "cuda":
        return float("nan")
    n = 1 << 30  # 2 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * n * 2 / best


def run_generate_batch(
    model: HFModel, work: Workload, max_new: int, device: str
) -> tuple[float, int]:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with reference_attention(model, "sdpa") as hf:
        start = time.perf_counter()
        results = hf.generate_batch(work.prompts, generation_config=config, progress_bar=False)
        seconds = time.perf_counter() - start
    return seconds, sum(len(r.generated_tokens) for r in results.values())


def run_static_generate(
    model: HFModel, work: Workload, max_new: int, batch: int, device: str
) -> tuple[float, int]:
    produced = 0
    with reference_attention(model, "sdpa") as hf:
        start = time.perf_counter()
        for b in range(0, len(work.prompts), batch):
            chunk = work.prompts[b : b + batch]
            width = max(len(p) for p in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):  # left padding
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            out = hf.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            produced += (out.shape[1] - width) * len(chunk)
        seconds = time.perf_counter() - start
    return seconds, produced


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--backend", default=None, help="Config string (default: triton on a GPU, torch on a CPU)."
    )
    p.add_argument(
        "--requests", type=int, nargs="+", default=None, help="Request counts (default 64 256)."
    )
    p.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--prefixes", type=int, default=4, help="Distinct shared prefixes.")
    p.add_argument(
        "--prefix-len", type=int, default=None, help="Tokens per shared prefix (default 384)."
    )
    p.add_argument(
        "--compare-output-len",
        type=int,
        default=None,
        help="Fixed output length of the comparison (default 128).",
    )
    p.add_argument(
        "--static-batch", type=int, default=64, help="Requests per static generate call."
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="Step token budget (default 8192)."
    )
    p.add_argument(
        "--profile-steps", type=int, default=20, help="Decode steps timed in the attention pass."
    )
    p.add_argument(
        "--kernel-profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="Profile this many decode steps per request count (torch.profiler): device time "
        "per step by kind (matmul, attention, other) and the top kernels.",
    )
    p.add_argument("--kernel-profile-top", type=int, default=20, help="Kernels listed.")
    p.add_argument("--no-compare", action="store_true", help="Skip the transformers baselines.")
    p.add_argument("--no-cuda-graph", action="store_true", help="Eager decode steps.")
    p.add_argument(
        "--compile",
        metavar="BACKEND",
        default=None,
        help="torch.compile the model's layers with this backend (HFModel(compile=...)).",
    )
    p.add_argument(
        "--scheduling",
        nargs="+",
        choices=("sync", "async"),
        default=["sync"],
        help="Engine scheduling, each timed in turn (async: EngineConfig.async_scheduling).",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tiny", action="store_true", help="A tiny model and workload (CPU smoke test)."
    )
    args = p.parse_args(argv)
    tiny = args.tiny
    defaults = dict(
        requests=[4, 8] if tiny else [64, 256],
        prompt_len=(24, 48) if tiny else (512, 2048),
        output_len=(4, 8) if tiny else (128, 256),
        prefix_len=16 if tiny else 384,
        compare_output_len=6 if tiny else 128,
        max_num_batched_tokens=64 if tiny else 8192,
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tiny:
        args.profile_steps = min(args.profile_steps, 3)
    return args


def decode_figures(
    run: EngineRun, read_per_step: int, kv_per_token: int, bandwidth: float
) -> list[str | int]:
    """Throughput, then the decode steps against their floor: the step on the host
    (median), the floor, the GPU time of the graph replay (median)."""
    decode = run.decode_steps
    step = statistics.median(s.seconds for s in decode) if decode else float("nan")
    floors = [(read_per_step + s.context_tokens * kv_per_token) / bandwidth for s in decode]
    floor = statistics.median(floors) if floors else float("nan")
    # GPU time of the decode graphs' replays: what the step costs on the device; the
    # rest of a synchronous step is host work that the device waits for
    replay_ms = [s.replay[0].elapsed_time(s.replay[1]) for s in decode if s.replay]
    replay = statistics.median(replay_ms) / 1e3 if replay_ms else float("nan")
    known = bool(floors) and bandwidth == bandwidth
    return [
        f"{run.output_tokens / run.seconds:,.0f}",
        f"{run.seconds:.1f}",
        len(run.steps),
        f"{step * 1e3:.2f}",
        f"{floor * 1e3:.2f}" if known else "-",
        f"{step / floor:.2f}x" if known else "-",
        f"{replay * 1e3:.2f}" if replay_ms else "-",
        f"{replay / floor:.2f}x" if replay_ms and known else "-",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)  # tiny tensors: threads only add synchronisation
    args.backend = args.backend or ("triton" if device == "cuda" else "torch")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if args.tiny:
        config, dtype = builtin_config("tiny-llama"), torch.float32
    else:
        from transformers import LlamaConfig

        config, dtype = LlamaConfig(**LLAMA_3_8B), torch.bfloat16
    t0 = time.perf_counter()
    model = HFModel(
        random_model(config, dtype=dtype, device=device, seed=args.seed), compile=args.compile
    )
    weights = sum(p.numel() * p.element_size() for p in model.model.parameters())
    embedding = model.model.get_input_embeddings().weight
    read_per_step = weights - embedding.numel() * embedding.element_size()  # rows only
    layers = model.attention_layers(args.block_size)
    kv_per_token = ModelKVCache.bytes_per_block(layers) // args.block_size
    bandwidth = copy_bandwidth(device)
    print(
        f"model: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{weights / 1e9:.2f} GB {str(dtype).removeprefix('torch.')} random weights "
        f"({time.perf_counter() - t0:.0f} s to build); KV {kv_per_token / 1024:.0f} KiB/token; "
        f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; copy "
        f"bandwidth {bandwidth / 1e12:.2f} TB/s; backend {args.backend}; "
        f"compile {args.compile or 'off'}"
    )
    rows, compare_rows = [], []
    for n in args.requests:
        work = make_workload(
            n, tuple(args.prompt_len), tuple(args.output_len), args.prefixes, args.prefix_len,
            config.vocab_size, args.seed + n,
        )  # fmt: skip
        cuda_graph = device == "cuda" and not args.no_cuda_graph
        for mode in args.scheduling:
            engine = Engine(model, engine_config(args, device, work, cuda_graph, mode == "async"))
            print(f"\n{n} requests, {mode}: " + "; ".join(engine.runner.kv.describe()), flush=True)
            warm = make_workload(
                2, tuple(args.prompt_len), (2, 2), 1, args.prefix_len, config.vocab_size, 99
            )
            run_engine(engine, warm, sync)  # compile kernels, fill allocator pools
            run = run_engine(engine, work, sync)
            del engine
            _free(device)
            rows.append([n, mode, *decode_figures(run, read_per_step, kv_per_token, bandwidth)])
            if mode == args.scheduling[0]:
                share, eager_step = attention_share(model, args, device, work, sync)
                rows[-1] += [f"{share:.0%}", f"{eager_step * 1e3:.2f}"]
            else:
                rows[-1] += ["", ""]
            rows[-1] += [f"{run.prefix_hit_rate:.0%}", run.graph_replays]
            print(format_table(HEADERS, rows[-1:]), flush=True)
        if args.kernel_profile:
            mode = args.scheduling[-1]
            by_kind, top = kernel_profile(model, args, device, work, cuda_graph, mode == "async")
            unit = "GPU kernels" if device == "cuda" else "CPU operators (self time)"
            print(f"\n{n} requests, {mode}: {unit} per decode step, by kind", flush=True)
            print(format_table(PROFILE_HEADERS, by_kind))
            print(f"\ntop {len(top)}")
            print(format_table(PROFILE_HEADERS, top), flush=True)
        if args.no_compare:
            continue
        fixed = Workload(work.prompts, [args.compare_output_len] * n)
        async_scheduling = args.scheduling[-1] == "async"
        engine = Engine(model, engine_config(args, device, fixed, cuda_graph, async_scheduling))
        warm = make_workload(
            2, tuple(args.prompt_len), (2, 2), 1, args.prefix_len, config.vocab_size, 99
        )
        run_engine(engine, warm, sync)
        ours = run_engine(engine, fixed, sync)
        del engine
        _free(device)
        line = [n, args.compare_output_len, f"{ours.output_tokens / ours.seconds:,.0f}"]
        baselines = (
            partial(run_generate_batch, model, fixed, args.compare_output_len, device),
            partial(
                run_static_generate,
                model,
                fixed,
                args.compare_output_len,
                args.static_batch,
                device,
            ),
        )
        for i, baseline in enumerate(baselines):
            if i == 0 and device != "cuda":
                line.append("needs a GPU")  # its memory probe finds no CPU memory
                continue
            try:
                seconds, produced = baseline()
                line.append(f"{produced / seconds:,.0f}")
                _free(device)
            except Exception as exc:  # report the baseline's failure, keep the others
                line.append(f"failed: {type(exc).__name__}: {str(exc)[:60]}")
        compare_rows.append(line)
        print(format_table(COMPARE_HEADERS, compare_rows[-1:]), flush=True)
    print("\n" + format_table(HEADERS, rows))
    if compare_rows:
        print("\n" + format_table(COMPARE_HEADERS, compare_rows))
    return 0


HEADERS = [
    "requests",
    "scheduling",
    "output tok/s",
    "wall s",
    "steps",
    "decode step ms (median)",
    "floor ms",
    "step/floor",
    "graph replay ms (GPU)",
    "replay/floor",
    "attention share (eager)",
    "eager decode step ms",
    "prefix hits",
    "graph replays",
]
PROFILE_HEADERS = ["kernel", "launches/step", "us/step", "share"]
COMPARE_HEADERS = [
    "requests",
    "output len",
    "pagedkv tok/s",
    "generate_batch tok/s",
    "static generate tok/s",
]


if __name__ == "__main__":
    sys.exit(main())
