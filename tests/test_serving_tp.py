"""Tensor-parallel serving on gloo: a tiny Hugging Face Llama sharded over CPU
processes gives the TP=1 tokens and logits; every rank runs the same block tables
and slot mappings each step, and a rank that would not is caught. One spawn per TP
size does all of it (starting the processes is most of the time)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs pagedkv[models] (transformers)")

import torch.distributed as dist
from pagedkv.errors import PagedKVError
from pagedkv.models import ModelSupportError, load_model
from pagedkv.serving import (
    Engine,
    EngineConfig,
    RankDivergenceError,
    SamplingParams,
    TensorParallel,
    Worker,
    run_tensor_parallel,
)
from serving_model import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

# logits, TP vs TP=1: the all-reduce sums the projections in another order. float32
# (CPU): summation order only. float16 (GPU): conformance/models.py's model tolerance.
TOLERANCES = {torch.float32: (1e-4, 0.0), torch.float16: (2e-2, 5e-3)}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 256, (16,), generator=g).tolist()  # one full block, shared
    return [
        prefix + torch.randint(0, 256, (5,), generator=g).tolist(),
        prefix + torch.randint(0, 256, (9,), generator=g).tolist(),
        torch.randint(0, 256, (40,), generator=g).tolist(),  # chunked (budget 32)
    ]


PARAMS = [
    SamplingParams(max_tokens=4, return_logits=True),
    SamplingParams(max_tokens=4, return_logits=True),
    SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=5, return_logits=True),
]


def _config(num_blocks: int, backend: str = "torch", device: str = "cpu") -> EngineConfig:
    return EngineConfig(
        backend=backend,
        device=device,
        num_blocks=num_blocks,
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        block_order_seed=4,
    )


def _tokens_and_logits(outputs) -> list[list[tuple[list[int], list[torch.Tensor]]]]:
    return [[(s.token_ids, s.logits) for s in out.samples] for out in outputs]


def _serve(
    tp: TensorParallel,
    model_name: str,
    backend: str = "torch",
    device_type: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Every rank: its shard of the model; rank 0 the Engine, the others a Worker.
    The pools differ on purpose (rank r offers 40 - 8r blocks): they must agree.
    Then once more with rank 1 off by one block in its table: every rank refuses."""
    torch.set_num_threads(1)
    device = f"cuda:{tp.rank}" if device_type == "cuda" else "cpu"
    model = load_model(model_name, tp=tp, device=device, dtype=dtype)
    config = _config(40 - 8 * tp.rank, backend, device)
    summary: dict = {}
    if tp.is_driver:
        with Engine(model, config, tp=tp) as engine:
            summary["outputs"] = _tokens_and_logits(engine.generate(_prompts(), PARAMS))
            summary["stats"] = engine.stats
        runner = engine.runner
    else:
        worker = Worker(model, config, tp)
        worker.run()
        runner = worker.runner
    mine = {
        "num_blocks": runner.kv.num_blocks,
        "checked": tp.num_checked_steps,
        "heads": [(layer.spec.num_heads, layer.spec.num_kv_heads) for layer in runner.kv.layers],
        "refused": _diverge(tp, model, _config(24, backend, device)),
    }
    summary["ranks"] = [None] * tp.size
    dist.all_gather_object(summary["ranks"], mine, group=tp.control_group)
    return summary


def _diverge(tp: TensorParallel, model, config: EngineConfig) -> str:
    """Rank 1 changes one entry of its block table; returns this rank's refusal."""
    if tp.is_driver:
        with Engine(model, config, tp=tp) as engine:
            try:
                engine.generate(_prompts()[:1], SamplingParams(max_tokens=2))
            except RankDivergenceError as exc:
                return str(exc)
        return ""
    worker = Worker(model, config, tp)
    if tp.rank == 1:
        build = worker.runner.assembler.build

        def off_by_one_block(*args, **kwargs):
            common = build(*args, **kwargs)
            common.block_table[0, 0] += 1
            return common

        worker.runner.assembler.build = off_by_one_block
    try:
        worker.run()
    except RankDivergenceError as exc:
        worker.run()  # until the Engine closes
        return str(exc)
    return ""


def _check_against_tp1(expected, got, dtype: torch.dtype) -> None:
    """Tokens and logits equal TP=1's. In 16-bit a sample may part at a token whose
    logits still agree within the tolerance (a near tie rounded the other way); it
    is compared up to there."""
    atol, rtol = TOLERANCES[dtype]
    for want_samples, got_samples in zip(expected, got, strict=True):
        for (want_tokens, want_logits), (got_tokens, got_logits) in zip(
            want_samples, got_samples, strict=True
        ):
            for step, (a, b) in enumerate(zip(got_logits, want_logits, strict=True)):
                torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
                if got_tokens[step] != want_tokens[step]:
                    assert dtype != torch.float32, f"token {step}: {got_tokens} != {want_tokens}"
                    break
            else:
                assert got_tokens == want_tokens


def _run_and_check(tp_size: int, backend: str, device_type: str, dtype: torch.dtype) -> None:
    device = "cuda:0" if device_type == "cuda" else "cpu"
    model = load_model("tiny-llama", device=device, dtype=dtype)
    reference = Engine(model, _config(40 - 8 * (tp_size - 1), backend, device))
    expected = _tokens_and_logits(reference.generate(_prompts(), PARAMS))
    del reference, model
    got = run_tensor_parallel(
        _serve, tp_size, device_type, "tiny-llama", backend, device_type, dtype,
        check_every_step=True,
    )  # fmt: skip
    stats = got["stats"].scheduler
    assert stats.num_partial_prefills > 0 and stats.num_forks == 1
    assert got["stats"].prefix_hit_rate > 0
    _check_against_tp1(expected, got["outputs"], dtype)
    ranks = got["ranks"]
    # every rank checked every step of the run: identical tables and slots on all ranks
    assert {r["checked"] for r in ranks} == {stats.num_steps}
    assert {r["num_blocks"] for r in ranks} == {40 - 8 * (tp_size - 1)}  # the smallest pool
    # tiny-llama: 4 query heads, 2 KV heads
    assert all(r["heads"] == [(4 // tp_size, max(1, 2 // tp_size))] * 2 for r in ranks)
    # a rank with another block table: every rank refuses the step
    for rank, r in enumerate(ranks):
        assert r["refused"] == f"rank {rank} of {tp_size}: block_table differ between ranks"


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_serving_matches_tp1(tp_size):
    """TP=4: one query head per rank, each of the 2 KV heads replicated on two ranks."""
    _run_and_check(tp_size, "torch", "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)")
@pytest.mark.parametrize("backend", ["triton", "flashinfer", "flash_attn"])
def test_tensor_parallel_serving_on_two_gpus(backend):
    """NCCL, CUDA-graph decode where the backend has it, float16."""
    import pagedkv

    available, why = pagedkv.get_backend(backend).is_available()
    if not available:
        pytest.skip(f"{backend}: {why}")
    _run_and_check(2, backend, "cuda", torch.float16)


def _fails_on_rank_1(tp: TensorParallel) -> None:
    if tp.rank == 1:
        raise ModelSupportError("rank 1 cannot load its shard")
    dist.barrier()  # rank 0 waits for the others, as in a collective


def test_a_rank_error_reaches_the_caller_as_itself():
    with pytest.raises(ModelSupportError, match="rank 1 cannot load its shard"):
        run_tensor_parallel(_fails_on_rank_1, 2, "cpu")


def test_models_that_cannot_be_sharded_are_refused():
    tp = TensorParallel(rank=0, size=3)
    with pytest.raises(ModelSupportError, match="num_heads 4 is not divisible by tp_size 3"):
        load_model("tiny-llama", tp=tp)
    with pytest.raises(ModelSupportError, match="tensor parallelism of MLA attention"):
        load_model("tiny-deepseek-v3", tp=TensorParallel(rank=0, size=2))
    with pytest.raises(ModelSupportError, match="layer 0 MLP .* missing gate_proj"):
        load_model("tiny-gpt-oss", tp=TensorParallel(rank=0, size=2))
    if torch.cuda.device_count() < 2:
        with pytest.raises(PagedKVError, match="needs 2 GPUs"):
            run_tensor_parallel(_serve, 2, "cuda", "tiny-llama")
