"""Engine: requests in, tokens out; one ``step`` = schedule, run the model, sample, update
(under async scheduling: schedule and launch this step, then append the tokens of the
step before)."""

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
from pagedkv.serving.inputs import TokenFeed
from pagedkv.serving.model import PagedModel
from pagedkv.serving.parallel import TensorParallel
from pagedkv.serving.params import SamplingParams
from pagedkv.serving.runner import ModelRunner
from pagedkv.serving.sampler import sample
from pagedkv.serving.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from pagedkv.serving.sequence import FinishReason
from pagedkv.serving.sequence import Sequence as Seq
from pagedkv.transfer import to_device


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
    Hugging Face models). Call ``step()`` until ``has_unfinished()`` is False, or
    ``generate()``; ``abort()`` between steps. With ``config.async_scheduling`` a step
    is launched before the tokens of the one before reach the host (docs/serving.md,
    "Async scheduling"); the outputs are the same.

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
        if tp is not None and config is not None and config.async_scheduling:
            raise EngineConfigError(
                "async_scheduling under tensor parallelism is not supported: the other "
                "ranks would need each step's sampled tokens on their devices"
            )
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
        self._in_flight: _Launched | None = None  # async scheduling: tokens not on the host
        self._done: list[RequestOutput] = []  # finished in a drain, returned by step()
        self._step_seconds = 0.0
        self._closed = False

    # -- requests ---------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
    ) -> None:
        if not isinstance(request_id, str):
            raise RequestError(f"request_id: expected a str, got {type(request_id).__name__}")
        if isinstance(prompt_token_ids, str) or not isinstance(prompt_token_ids, Sequence):
            raise RequestError(
                f"request {request_id!r}: prompt_token_ids must be a sequence of token ids, "
                f"got {type(prompt_token_ids).__name__} (encode text with a tokenizer first)"
            )
        if params is not None and not isinstance(params, SamplingParams):
            raise RequestError(
                f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}"
            )
        vocab = self.model.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"request {request_id!r}: token ids must be ints in [0, {vocab}), got {bad[:5]}"
            )
        self.scheduler.add_request(request_id, prompt_token_ids, params or SamplingParams())

    def abort(self, request_id: str) -> RequestOutput:
        """Stop the request wherever it is (queued, prefilling, decoding, preempted)."""
        self._drain()
        for k, out in enumerate(self._done):
            if out.request_id == request_id:  # it finished in the step just resolved
                return self._done.pop(k)
        self.scheduler.abort(request_id)
        return self._output(request_id)

    def has_unfinished(self) -> bool:
        """Requests to run, a step in flight, or outputs not yet returned by step()."""
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._done)

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
        self._drain()
        self.runner.switch_backend(backend, _blocks_holding_kv(self.manager))
        self.config = dataclasses.replace(self.config, backend=backend)

    # -- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; returns the requests that finished in it
        (under ``async_scheduling``: whose last tokens reached the host in it)."""
        start = time.perf_counter()
        done, self._done = self._done, []
        output = self.scheduler.schedule()
        if not output.scheduled:
            if self._in_flight is not None:
                done += self._resolve(self._in_flight)
                self._in_flight = None
            elif self.scheduler.has_unfinished():
                self._done = done  # for the step after
                raise RequestError(self._stuck_reason())
            self._step_seconds += time.perf_counter() - start
            return done
        plan = output.plan()
        if self.tp is not None:
            self.tp.broadcast_plan(plan)
        previous, self._in_flight = self._in_flight, None
        try:
            logits = self.runner.execute(plan, None if previous is None else previous.feed())
        except BaseException:
            if previous is not None:  # a failed step runs again on known tokens
                done += self._resolve(previous)
            self._done = done  # returned by the step after
            raise
        launched = self._sample(output, logits)
        if previous is not None:  # its tokens are on their way while this step runs
            done += self._resolve(previous)
        self.scheduler.advance(output)  # after resolve: its stop tokens drop rows here
        if self.config.async_scheduling:
            self._in_flight = launched
        else:
            done += self._resolve(launched)
        self._step_seconds += time.perf_counter() - start
        return done

    def _sample(self, output: SchedulerOutput, logits: torch.Tensor) -> _Launched:
        """Sample the step's rows on the device; start their copy to the host."""
        rows: list[int] = []
        params: list[SamplingParams] = []
        generators: list[torch.Generator | None] = []
        row_ranges: dict[str, tuple[int, int]] = {}
        logit_rows: dict[str, int] = {}
        for k, s in enumerate(output.sampling):
            gens = self.scheduler.sample_generators(s.seq)
            row_ranges[s.seq.seq_id] = (len(rows), len(gens))
            if s.seq.params.return_logits:
                logit_rows[s.seq.seq_id] = k
            rows += [k] * len(gens)
            params += [s.seq.params] * len(gens)
            generators += gens
        device = logits.device
        tokens = (
            sample(logits[_index(rows, device)], params, generators)
            if rows
            else torch.empty(0, dtype=torch.int64, device=device)
        )
        kept = logits[_index(list(logit_rows.values()), device)].float() if logit_rows else None
        return _Launched(output, tokens, row_ranges, list(logit_rows), kept)

    def _resolve(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for a step's tokens on the host; append them, finish what stops."""
        tokens = launched.host_tokens()
        samples = {
            seq_id: tokens[first : first + count]
            for seq_id, (first, count) in launched.row_ranges.items()
        }
        kept_logits = launched.host_logits()
        finished = self.scheduler.resolve(launched.output, samples, kept_logits)
        done = []
        for group_id in dict.fromkeys(seq.group_id for seq in finished):
            if group_id in self.scheduler.groups and self.scheduler.is_finished(group_id):
                done.append(self._output(group_id))
        return done

    def _drain(self) -> None:
        """Resolve the step in flight (async scheduling) before the state changes
        under it; what finishes is returned by the next ``step``."""
        if self._in_flight is not None:
            self._done += self._resolve(self._in_flight)
            self._in_flight = None

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


class _Launched:
    """A step whose tokens were sampled on the device and are being copied to the host
    (non-blocking: a later step can be launched before the host waits for them)."""

    def __init__(
        self,
        output: SchedulerOutput,
        tokens: torch.Tensor,
        row_ranges: dict[str, tuple[int, int]],
        logit_seq_ids: list[str],
        logits: torch.Tensor | None,
    ) -> None:
        self.output = output
        self.tokens = tokens  # [R] int64 on the device, the sampler's rows
        self.row_ranges = row_ranges  # sampled seq id -> (first row, rows: 1 or its n)
        self.logit_seq_ids = logit_seq_ids
        self._host_tokens = _to_host(tokens)
        self._host_logits = None if logits is None else _to_host(logits)
        self._ready = None
        if tokens.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def feed(self) -> TokenFeed:
        """Where the next step finds these tokens: the rows of the sequences that got
        placeholders for them (Scheduler.advance), on the device."""
        targets = self.output.targets or {}
        rows = {}
        for seq_id, seqs in targets.items():
            first, _ = self.row_ranges[seq_id]
            rows.update({seq.seq_id: first + i for i, seq in enumerate(seqs)})
        return TokenFeed(self.tokens, rows)

    def host_tokens(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()  # this step's copies only, not the steps after it
        return self._host_tokens.tolist()

    def host_logits(self) -> dict[str, torch.Tensor] | None:
        if self._host_logits is None:
            return None
        return dict(zip(self.logit_seq_ids, self._host_logits.unbind(0), strict=True))


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy to pinned host memory (a CPU tensor: a copy)."""
    if not t.is_cuda:
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices on the device, copied without waiting for the device's queue."""
    return to_device(rows, device, torch.int64)


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
