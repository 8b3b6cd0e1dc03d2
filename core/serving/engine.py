"""Engine: requests in, tokens out; one ``step`` = schedule, run the model, sample, update."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.kv import KVCacheManager
from pagedkv.serving.config import EngineConfig
from pagedkv.serving.errors import EngineConfigError, RequestError
from pagedkv.serving.model import PagedModel
from pagedkv.serving.parallel import TensorParallel
from pagedkv.serving.params import SamplingParams
from pagedkv.serving.runner import ModelRunner
from pagedkv.serving.sampler import sample
from pagedkv.serving.scheduler import Scheduler, SchedulerStats
from pagedkv.serving.sequence import FinishReason
from pagedkv.serving.sequence import Sequence as Seq


@dataclass(frozen=True)
class SampleOutput:
    """One sample of a request. logits: float32 [vocab] rows (CPU), one per token,
    when the request asked for them."""

    index: int
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_preemptions: int
    logits: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    samples: list[SampleOutput]  # by sample index


@dataclass(frozen=True)
class EngineStats:
    scheduler: SchedulerStats
    prefix_hit_rate: float  # prefix-cache hit tokens / looked-up tokens (KVCacheManager)
    num_blocks: int  # usable blocks per layer (the null block excluded)
    blocks_in_use: int
    step_seconds: float  # wall time spent in step()


class Engine:
    """A paged serving engine over one PagedModel (``pagedkv.models.HFModel`` for
    Hugging Face models). Synchronous: call ``step()`` until ``has_unfinished()`` is
    False, or ``generate()``; ``abort()`` between steps.

    Under tensor parallelism (``tp``, rank 0 only) each step's plan is broadcast to
    the other ranks' ``Worker`` before it runs; ``close()`` (or leaving a ``with``
    block) releases them.
    """

    def __init__(
        self,
        model: PagedModel,
        config: EngineConfig | None = None,
        *,
        tp: TensorParallel | None = None,
    ) -> None:
        if tp is not None and not tp.is_driver:
            raise EngineConfigError(
                f"rank {tp.rank}: the Engine (scheduler, sampler) runs on rank 0; the other "
                "ranks run a pagedkv.serving.Worker"
            )
        self.config = config = config or EngineConfig()
        self.model = model
        self.tp = tp
        self.runner = ModelRunner(model, config, tp)
        self.manager = KVCacheManager(
            self.runner.kv.num_blocks,  # agreed by every tensor-parallel rank
            config.block_size,
            config.max_model_len,
            config.enable_prefix_caching,
            hash_seed=config.hash_seed,
        )
        if config.block_order_seed is not None:
            self.manager.shuffle_free_blocks(config.block_order_seed)
        self.scheduler = Scheduler(config, self.manager, self.runner.device)
        self._step_seconds = 0.0
        self._closed = False

    # -- requests ---------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
    ) -> None:
        vocab = self.model.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"request {request_id!r}: token ids must be ints in [0, {vocab}), got {bad[:5]}"
            )
        self.scheduler.add_request(request_id, prompt_token_ids, params or SamplingParams())

    def abort(self, request_id: str) -> RequestOutput:
        """Stop the request wherever it is (queued, prefilling, decoding, preempted)."""
        self.scheduler.abort(request_id)
        return self._output(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def switch_backend(self, backend: str | AttentionBackend | None) -> None:
        """Run the model on ``backend`` (a config string or a backend object) from the
        next step on, between steps, without dropping any K/V.

        Every layer's cache moves into the new backend's layout
        (``pagedkv.convert_kv_cache``: zero-copy where the layouts share their bytes,
        else the blocks holding K/V, in bounded chunks); the KV manager — running
        sequences' blocks and the prefix cache — is kept as it is, so generation
        continues where it was and later requests still hit the cached prefixes.
        Raises (changing nothing) when the backend cannot run a layer.
        """
        if self.tp is not None:
            raise EngineConfigError(
                "switch_backend under tensor parallelism is not supported: every rank's "
                "caches would have to switch together"
            )
        self.runner.switch_backend(backend, _blocks_holding_kv(self.manager))
        self.config = dataclasses.replace(self.config, backend=backend)

    # -- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; returns the requests that finished in it."""
        start = time.perf_counter()
        output = self.scheduler.schedule()
        if not output.scheduled:
            if self.scheduler.has_unfinished():
                raise RequestError(self._stuck_reason())
            return []
        plan = output.plan()
        if self.tp is not None:
            self.tp.broadcast_plan(plan)
        logits = self.runner.execute(plan)
        rows: list[int] = []
        params: list[SamplingParams] = []
        generators: list[torch.Generator | None] = []
        for k, s in enumerate(output.sampling):
            gens = self.scheduler.sample_generators(s.seq)
            rows += [k] * len(gens)
            params += [s.seq.params] * len(gens)
            generators += gens
        tokens = sample(logits[rows], params, generators).tolist() if rows else []
        samples: dict[str, list[int]] = {}
        kept_logits: dict[str, torch.Tensor] = {}
        for row, token in zip(rows, tokens, strict=True):
            s = output.sampling[row]
            samples.setdefault(s.seq.seq_id, []).append(token)
            if s.seq.params.return_logits:
                kept_logits[s.seq.seq_id] = logits[row].float().cpu()
        finished = self.scheduler.update(output, samples, kept_logits)
        done = []
        for group_id in dict.fromkeys(seq.group_id for seq in finished):
            if self.scheduler.is_finished(group_id):
                done.append(self._output(group_id))
        self._step_seconds += time.perf_counter() - start
        return done

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_step: Callable[[Engine], None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order. ``on_step`` is called
        after every step (progress)."""
        per_prompt = (
            list(params)
            if isinstance(params, Sequence)
            else [params or SamplingParams()] * len(prompts)
        )
        if len(per_prompt) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        ids = [f"prompt{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, per_prompt, strict=True):
            self.add_request(request_id, prompt, p)
        outputs: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                outputs[out.request_id] = out
            if on_step is not None:
                on_step(self)
        return [outputs[i] for i in ids]

    def close(self) -> None:
        """Release the tensor-parallel workers (their ``run`` returns); idempotent."""
        if self.tp is not None and not self._closed:
            self.tp.broadcast_plan(None)
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reporting ----------------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        usable = self.manager.block_pool.num_blocks - 1
        return EngineStats(
            scheduler=self.scheduler.stats,
            prefix_hit_rate=self.manager.prefix_cache_stats.hit_rate,
            num_blocks=usable,
            blocks_in_use=usable - self.manager.get_num_free_blocks(),
            step_seconds=self._step_seconds,
        )

    def _output(self, group_id: str) -> RequestOutput:
        seqs = self.scheduler.pop_group(group_id)
        return RequestOutput(
            group_id,
            list(seqs[0].request.all_token_ids[: seqs[0].request.num_prompt_tokens]),
            [_sample_output(seq) for seq in sorted(seqs, key=lambda s: s.index)],
        )

    def _stuck_reason(self) -> str:
        seq = self.scheduler.waiting[0]
        usable = self.manager.block_pool.num_blocks - 1
        need = -(-seq.request.num_tokens // self.config.block_size)
        return (
            f"request {seq.group_id!r} (sample {seq.index}, {seq.request.num_tokens} tokens) "
            f"cannot be scheduled: it needs {need} blocks and the pool has {usable}, with "
            f"max_num_seqs {self.config.max_num_seqs}; give more num_blocks"
        )


def _blocks_holding_kv(manager: KVCacheManager) -> list[int]:
    """Blocks whose contents matter: held by a sequence, or cached for prefix hits."""
    return [
        b.block_id
        for b in manager.block_pool.blocks
        if not b.is_null and (b.ref_cnt > 0 or b.block_hash is not None)
    ]


def _sample_output(seq: Seq) -> SampleOutput:
    return SampleOutput(
        seq.index,
        seq.output_token_ids,
        seq.finish_reason,
        seq.num_preemptions,
        seq.logits if seq.params.return_logits else None,
    )
