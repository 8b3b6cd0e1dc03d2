"""``pagedkv generate``: a Hugging Face model served through a pagedkv backend.

By default a built-in tiny model (random weights, no download) on the CPU through
the torch backend; ``--model`` also takes a local model directory (its tokenizer
and weights).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pagedkv.cli.args import (
    backend_config,
    device,
    fraction,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from pagedkv.errors import PagedKVError, UsageError

if TYPE_CHECKING:
    from pagedkv.serving import TensorParallel

DEFAULT_MODEL = "tiny-llama"
SYSTEM_PROMPT = "You are a paged KV cache. Blocks are pages, block tables are page tables. "
DEFAULT_PROMPTS = (
    SYSTEM_PROMPT + "What does a block table map?",
    SYSTEM_PROMPT + "Why do requests share their prefix blocks?",
    "Copy-on-write lets parallel samples",
)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PROGRESS_EVERY_S = 2.0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "generate",
        help="Generate text with a Hugging Face model served through a pagedkv backend.",
        description=(
            "Serve prompts through pagedkv's engine (scheduler, paged KV cache, prefix "
            "caching, parallel sampling) on a backend, and print the tokens, the speed, "
            "the KV blocks used and the prefix-cache hit rate. Default: a built-in tiny "
            "model with random weights, so the text is noise; the machinery is real."
        ),
    )
    parser.add_argument("prompts", nargs="*", metavar="PROMPT", help="Prompts (default: three).")
    parser.add_argument("--prompts-file", help="A file with one prompt per line.")
    parser.add_argument(
        "--token-ids",
        action="store_true",
        help="Prompts are token ids (comma- or space-separated), not text.",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"A built-in tiny model (default {DEFAULT_MODEL}; see --list-models) or a local "
        "Hugging Face model directory.",
    )
    parser.add_argument("--list-models", action="store_true", help="List the built-in models.")
    parser.add_argument(
        "--backend",
        type=backend_config,
        default=None,
        help="Backend config string, e.g. 'triton,torch' (default: $PAGEDKV_BACKEND, else "
        "torch on a CPU and auto on a GPU).",
    )
    parser.add_argument(
        "--device", type=device, default=None, help="cpu or cuda (default: cuda when present)."
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), help="Model dtype (default: float32 on CPU, else bf16)."
    )
    parser.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="Sampling seed; also the random weights' seed.",
    )
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--n", type=positive_int, default=1, help="Samples per prompt.")
    sampling.add_argument(
        "--max-tokens", type=positive_int, default=24, help="Tokens per sample (default 24)."
    )
    sampling.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="0 = greedy (default).",
    )
    sampling.add_argument(
        "--top-k", type=non_negative_int, default=0, help="Keep the k likeliest tokens (0 = all)."
    )
    sampling.add_argument(
        "--top-p",
        type=fraction,
        default=1.0,
        help="Keep the likeliest tokens up to this probability mass (1 = all).",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--block-size", type=positive_int, default=16)
    engine.add_argument(
        "--num-blocks", type=positive_int, default=None, help="KV blocks per layer."
    )
    engine.add_argument("--max-model-len", type=positive_int, default=512)
    engine.add_argument("--max-num-seqs", type=positive_int, default=32)
    engine.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=256,
        help="Token budget of one step (longer prompts are chunked).",
    )
    engine.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="Tensor-parallel ranks: one process each (gloo on a CPU, NCCL with one GPU per "
        "rank); the model's heads and MLP are sharded, rank 0 schedules and prints.",
    )
    engine.add_argument(
        "--async-scheduling",
        action="store_true",
        help="Schedule and launch each step before the last one's tokens reach the host "
        "(the same tokens; the host's work overlaps the device's).",
    )
    engine.add_argument(
        "--compile",
        metavar="BACKEND",
        default=None,
        help="torch.compile the model's layers with this backend (e.g. inductor): fused "
        "norms, rotary embeddings and activations around pagedkv's attention.",
    )
    engine.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Replay decode steps as CUDA graphs (default: when the device and backend allow).",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    from pagedkv.models import builtin_names

    if args.list_models:
        print("\n".join(builtin_names()))
        return 0
    try:
        texts, prompts = _prompts(args)
    except PagedKVError as exc:  # a model, file or prompt that cannot be used
        raise UsageError(str(exc)) from None
    if args.tp == 1:
        return _serve(None, args, texts, prompts)
    from pagedkv.serving import run_tensor_parallel

    device_type = torch.device(_device(args)).type
    return int(run_tensor_parallel(_serve, args.tp, device_type, args, texts, prompts))


def _device(args: argparse.Namespace) -> str:
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _tokenizer(args: argparse.Namespace) -> Any:
    """Bytes for the built-in models, else the model directory's own (None: prompts are
    token ids and the model has no tokenizer to decode with)."""
    from pagedkv.models import ByteTokenizer, load_tokenizer
    from pagedkv.models.loader import model_directory

    path = model_directory(args.model)
    if path is None:
        return ByteTokenizer()
    return None if args.token_ids else load_tokenizer(path)


def _prompts(args: argparse.Namespace) -> tuple[list[str], list[list[int]]]:
    texts = list(args.prompts)
    if args.prompts_file:
        try:
            lines = Path(args.prompts_file).read_text().splitlines()
        except OSError as exc:
            raise UsageError(f"--prompts-file {args.prompts_file}: {exc.strerror}") from None
        texts += [line for line in lines if line.strip()]
    if not texts:
        texts = list(DEFAULT_PROMPTS)
    tokenizer = None if args.token_ids else _tokenizer(args)
    return texts, [_token_ids(t) if args.token_ids else tokenizer.encode(t) for t in texts]


def _serve(
    tp: TensorParallel | None, args: argparse.Namespace, texts: list[str], prompts: list[list[int]]
) -> int:
    """One process's part: the whole run, or one tensor-parallel rank (rank 0 the
    engine and the printing, the others a Worker)."""
    from pagedkv.serving import Worker

    try:
        engine, model, config = _setup(tp, args, prompts)
    except PagedKVError as exc:  # a model or backend that cannot be used
        raise UsageError(str(exc)) from None
    if engine is None:
        Worker(model, config, tp).run()
        return 0
    with engine:
        return _generate(args, engine, texts, _tokenizer(args), _header(args, tp, engine))


def _setup(tp: TensorParallel | None, args: argparse.Namespace, prompts: list[list[int]]) -> Any:
    from pagedkv.config import CONFIG_ENV
    from pagedkv.models import load_model
    from pagedkv.serving import Engine, EngineConfig, SamplingParams

    device = _device(args)
    device_type = torch.device(device).type
    if tp is not None and device_type == "cuda":
        device = f"cuda:{tp.rank}"
    dtype = (
        DTYPES[args.dtype]
        if args.dtype
        else (torch.float32 if device_type == "cpu" else torch.bfloat16)
    )
    model = load_model(
        args.model, dtype=dtype, device=device, seed=args.seed, tp=tp, compile=args.compile
    )
    backend = (
        args.backend or os.environ.get(CONFIG_ENV) or ("torch" if device_type == "cpu" else "auto")
    )
    config = EngineConfig(
        backend=backend,
        device=device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cuda_graph=args.cuda_graph,
        async_scheduling=args.async_scheduling,
    )
    if tp is not None and not tp.is_driver:
        return None, model, config
    engine = Engine(model, config, tp=tp)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            n=args.n,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed + i * args.n,  # samples of every prompt draw their own streams
        )
        engine.add_request(f"prompt{i}", prompt, params)
    return engine, model, config


def _header(args: argparse.Namespace, tp: TensorParallel | None, engine: Any) -> list[str]:
    from pagedkv.models import builtin_names

    model, config = engine.model, engine.config
    builtin = args.model in builtin_names()
    parallel = ""
    if tp is not None:
        parallel = f", tensor parallel over {tp.size} ranks (rank 0's heads below)"
    return [
        f"model {args.model} ({model.config.model_type}, {model.config.num_hidden_layers} layers"
        + (f", random weights seed {args.seed}" if builtin else "")
        + f") on {config.device}, {str(model.dtype).removeprefix('torch.')}{parallel}",
        *(f"  {line}" for line in engine.runner.kv.describe()),
        f"engine: {config.block_size}-token blocks, {engine.runner.kv.num_blocks - 1} usable "
        f"per layer, {config.max_num_batched_tokens} tokens per step, cuda graphs "
        + ("on" if engine.runner.graphs else "off"),
    ]


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UsageError(f"--token-ids: {text!r} is not a list of integers") from None


def _generate(
    args: argparse.Namespace, engine: Any, texts: list[str], tokenizer: Any, header: list[str]
) -> int:
    print("\n".join(header))
    last_report = time.perf_counter()
    outputs: dict[str, Any] = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
        if time.perf_counter() - last_report > PROGRESS_EVERY_S:
            last_report = time.perf_counter()
            s = engine.scheduler
            print(
                f"  ... step {s.stats.num_steps}: {len(s.running)} running, {len(s.waiting)} "
                f"waiting, {s.stats.num_generated_tokens} tokens",
                file=sys.stderr,
                flush=True,
            )
    elapsed = time.perf_counter() - start
    for i, text in enumerate(texts):
        out = outputs[f"prompt{i}"]
        print(f"\nprompt {i}: {text!r} ({len(out.prompt_token_ids)} tokens)")
        for sample in out.samples:
            shown = tokenizer.decode(sample.token_ids) if tokenizer else ""
            print(f"  sample {sample.index} [{sample.finish_reason}] {sample.token_ids}")
            if shown:
                print(f"    {shown!r}")
    stats = engine.stats
    s = stats.scheduler
    print(
        f"\n{s.num_generated_tokens} tokens in {s.num_steps} steps, {elapsed:.2f} s: "
        f"{s.num_generated_tokens / elapsed:.1f} tokens/s"
    )
    print(
        f"KV blocks: peak {s.max_blocks_in_use} of {stats.num_blocks} in use; prefix-cache "
        f"hit rate {stats.prefix_hit_rate:.0%}; {s.num_forks} forks, {s.num_block_copies} "
        f"copy-on-write block copies, {s.num_preemptions} preemptions"
    )
    return 0
