"""Model-level conformance: tiny random-weight Hugging Face models served through a
backend and pagedkv's serving layer, compared with transformers' own results.

One workload per model drives the scheduler through every path that moves KV
blocks: shuffled physical blocks, a shared prefix (prefix-cache hits), a prompt
longer than the step budget (chunked prefill), a pool too small for everything at
once (preemption and recompute), and two sampled continuations of one prompt (fork
and copy-on-write). Checks, per request and sample:

- greedy requests: tokens equal ``generate(do_sample=False)``'s, and each step's
  logits equal generate's within the dtype's tolerance. Where the tokens part, HF's
  own top two logits must lie within the tolerance (a tie the two can break either
  way); otherwise it is a failure.
- every sequence, sampled ones included: each step's logits equal HF's
  (cache-free) forward over the finished sequence at that position.
- the workload did what it is for: hits, a partial prefill, a preemption, a fork
  whose samples differ (else copy-on-write went unobserved) and block copies.

The reference is the same model (same weights, same dtype) on HF's eager attention.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.conformance.check import Tolerance

MODELS = ("tiny-llama", "tiny-qwen3", "tiny-gemma2", "tiny-gpt-oss", "tiny-deepseek-v3")

# On the logits (magnitude ~3) of the whole model, pagedkv's attention against HF's
# eager attention, both in the model dtype (docs/serving.md). float32: the two differ
# by summation order only, measured <= 3e-6 on the CPU backends; 1e-4 leaves ~30x
# headroom, while a dropped window, soft cap or sink, or a scale 5% off, moves logits
# by 0.04 to 2 (tests/test_models_conformance.py breaks each on purpose). 16-bit:
# measured on the CPU (torch backend; mla in fp16), seeds 0-2, at most 0.006 (fp16) and
# 0.043 (bf16, 2-3 units in the last place of a logit near 3); the tolerances leave
# ~4x of that.
MODEL_TOLERANCES = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=2e-2, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=1e-1, rtol=2e-2),
}

BLOCK_SIZE = 16  # the smallest every CPU-runnable backend takes (Triton, MLA: multiples of 16)
MAX_TOKENS = 10


@dataclass(frozen=True)
class Workload:
    """Prompts and sizes that exercise hits, chunking, preemption and a fork."""

    prompts: tuple[tuple[int, ...], ...]
    sampled: int  # index of the prompt sampled twice (n=2, temperature 1)
    num_blocks: int  # per layer, null block included: too few for all at once
    max_num_batched_tokens: int  # below the longest prompt: it is chunked
    block_order_seed: int


def workload(vocab_size: int, seed: int = 0) -> Workload:
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, vocab_size, (n,), generator=g).tolist())

    prefix = tokens(2 * BLOCK_SIZE)  # two full blocks shared by the first two prompts
    return Workload(
        prompts=(
            prefix + tokens(6),
            prefix + tokens(10),
            tokens(20),  # sampled twice: its third block is shared and partly filled
            tokens(50),  # longer than the step budget
        ),
        sampled=2,
        num_blocks=11,
        max_num_batched_tokens=32,
        block_order_seed=seed + 1,
    )


@dataclass
class ModelResult:
    model: str
    backend: str
    dtype: torch.dtype
    device: str
    problems: list[str] = field(default_factory=list)
    max_abs_error: float = 0.0  # logits, over every compared step
    stats: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # near ties, timings
    skipped: str | None = None  # why the backend cannot run this model

    @property
    def passed(self) -> bool:
        return not self.problems and self.skipped is None

    def report(self) -> str:
        verdict = "SKIP" if self.skipped else "PASS" if self.passed else "FAIL"
        dtype = str(self.dtype).removeprefix("torch.")
        lines = [f"[{self.backend}] {self.model} ({dtype}, {self.device}): {verdict}"]
        if self.skipped:
            lines.append(f"  {self.skipped}")
        else:
            lines.append(f"  max |logit error| {self.max_abs_error:.3g}; {self.stats}")
        lines += [f"  - {p}" for p in self.problems]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def run_model_check(
    model_name: str,
    backend: str | AttentionBackend,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    async_scheduling: bool = False,
) -> ModelResult:
    """Serve ``model_name`` (a built-in tiny config) through ``backend`` and judge it
    (``async_scheduling``: the engine's, docs/serving.md)."""
    from pagedkv.errors import NoUsableBackendError, UnsupportedError
    from pagedkv.models import HFModel, builtin_config, random_model
    from pagedkv.serving import Engine, EngineConfig, SamplingParams

    result = ModelResult(model_name, _label(backend), dtype, device)
    hf = random_model(builtin_config(model_name), dtype=dtype, device=device, seed=seed)
    reference = copy.deepcopy(hf)  # HF's eager attention on the same weights
    reference.set_attn_implementation("eager")
    model = HFModel(hf)
    work = workload(model.vocab_size, seed)
    config = EngineConfig(
        backend=backend,
        device=device,
        block_size=BLOCK_SIZE,
        num_blocks=work.num_blocks,
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=work.max_num_batched_tokens,
        cuda_graph=False,
        block_order_seed=work.block_order_seed,
        async_scheduling=async_scheduling,
    )
    try:
        engine = Engine(model, config)
    except (NoUsableBackendError, UnsupportedError) as exc:
        result.skipped = f"the backend cannot run this model's layers: {exc}"
        return result
    greedy = SamplingParams(max_tokens=MAX_TOKENS, return_logits=True)
    sampled = SamplingParams(
        n=2, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed + 7, return_logits=True
    )
    params = [sampled if i == work.sampled else greedy for i in range(len(work.prompts))]
    start = time.perf_counter()
    outputs = engine.generate([list(p) for p in work.prompts], params)
    result.notes.append(f"engine {time.perf_counter() - start:.1f} s")
    tol = MODEL_TOLERANCES[dtype]
    for i, (prompt, out) in enumerate(zip(work.prompts, outputs, strict=True)):
        for sample in out.samples:
            name = f"prompt {i} sample {sample.index}"
            if params[i].greedy:
                _check_greedy(reference, prompt, sample, tol, name, result)
            _check_forward(reference, prompt, sample, tol, name, result)
    _check_workload(engine, outputs[work.sampled], result)
    return result


def _label(backend: str | AttentionBackend) -> str:
    return backend if isinstance(backend, str) else repr(backend)


def _compare(
    ours: torch.Tensor, ref: torch.Tensor, tol: Tolerance, where: str, result: ModelResult
) -> bool:
    ours, ref = ours.float().cpu(), ref.float().cpu()
    err = (ours - ref).abs()
    worst = float(err.max()) if torch.isfinite(err).all() else math.inf
    result.max_abs_error = max(result.max_abs_error, worst)
    bad = ~(err <= tol.atol + tol.rtol * ref.abs())
    if bad.any():
        token = int(bad.nonzero()[0, 0])
        result.problems.append(
            f"{where}: logits differ by {worst:.3g} (tolerance {tol.atol:g} + {tol.rtol:g}"
            f"*|ref|), first at vocabulary entry {token}: ours {float(ours[token]):.6g}, "
            f"HF {float(ref[token]):.6g}"
        )
        return False
    return True


@torch.inference_mode()
def _check_greedy(
    reference: Any,
    prompt: tuple[int, ...],
    sample: Any,
    tol: Tolerance,
    name: str,
    result: ModelResult,
) -> None:
    device = next(reference.parameters()).device
    gen = reference.generate(
        torch.tensor([prompt], device=device),
        max_new_tokens=len(sample.token_ids),
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    expected = gen.sequences[0, len(prompt) :].tolist()
    for step, (ours, theirs) in enumerate(zip(sample.token_ids, expected, strict=True)):
        ref_logits = gen.logits[step][0]
        if not _compare(sample.logits[step], ref_logits, tol, f"{name} step {step}", result):
            return
        if ours != theirs:
            gap = float(ref_logits[theirs] - ref_logits[ours])
            if gap <= tol.atol + tol.rtol * float(ref_logits[theirs].abs()):
                result.notes.append(
                    f"{name}: token {step} is a near tie (HF's top two {gap:.2g} apart); "
                    "compared up to it"
                )
                return
            result.problems.append(
                f"{name}: greedy token {step} is {ours}, HF generate's is {theirs} "
                f"(HF prefers it by {gap:.3g})"
            )
            return


@torch.inference_mode()
def _check_forward(
    reference: Any,
    prompt: tuple[int, ...],
    sample: Any,
    tol: Tolerance,
    name: str,
    result: ModelResult,
) -> None:
    device = next(reference.parameters()).device
    tokens = list(prompt) + sample.token_ids[:-1]
    logits = reference(torch.tensor([tokens], device=device), use_cache=False).logits[0]
    for step, ours in enumerate(sample.logits):
        if not _compare(
            ours, logits[len(prompt) - 1 + step], tol, f"{name} step {step} (forward)", result
        ):
            return


def _check_workload(engine: Any, forked: Any, result: ModelResult) -> None:
    stats = engine.stats
    s = stats.scheduler
    result.stats = {
        "steps": s.num_steps,
        "prefix_hit_rate": round(stats.prefix_hit_rate, 3),
        "partial_prefills": s.num_partial_prefills,
        "preemptions": s.num_preemptions,
        "forks": s.num_forks,
        "block_copies": s.num_block_copies,
    }
    missing = [
        what
        for what, happened in (
            ("a prefix-cache hit", stats.prefix_hit_rate > 0),
            ("a chunked prefill", s.num_partial_prefills > 0),
            ("a preemption", s.num_preemptions > 0),
            ("a fork", s.num_forks > 0),
            ("a copy-on-write block copy", s.num_block_copies > 0),
            (
                "two different samples of the forked prompt",
                forked.samples[0].token_ids != forked.samples[1].token_ids,
            ),
        )
        if not happened
    ]
    if missing:
        result.problems.append("the workload did not exercise " + ", ".join(missing))
    if stats.blocks_in_use:
        result.problems.append(f"{stats.blocks_in_use} blocks still in use after every request")
