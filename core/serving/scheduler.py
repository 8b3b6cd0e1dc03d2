"""Scheduler: which sequences run this step and how many tokens each, under a token budget.

In the spirit of vLLM V1's scheduler: running sequences first (decodes and prefills
in progress, oldest first), then waiting ones in arrival order with prefix-cache hits,
chunking prefills to the budget. When ``allocate_slots`` has no blocks, the newest
running sequence is preempted: its blocks are freed and it goes back to the front
of the queue, to be recomputed from its tokens (its full blocks usually come back as
prefix hits). ``n > 1`` samples fork from sample 0 once its prompt is computed
(``KVCacheManager.fork``): they share its full blocks and each gets a copy of a
partly filled last block, applied to every layer before the next step.

Each step follows the KV manager's life cycle: ``allocate_slots`` and
``take_new_block_ids`` here, the forward in the runner, ``mark_computed`` in
``advance`` once the step is launched (its K/V lands before any later step reads
it), where each sampled sequence also gets a placeholder token; ``resolve`` writes
the sampled values over the placeholders, right away (``update``) or, under async
scheduling, after the next step has been scheduled and launched.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from pagedkv.intmath import cdiv
from pagedkv.kv import BlockCopy, BlockHash, KVCacheManager, Request
from pagedkv.serving.config import EngineConfig
from pagedkv.serving.errors import RequestError
from pagedkv.serving.params import SamplingParams
from pagedkv.serving.plan import PlannedSeq, StepPlan
from pagedkv.serving.sequence import FinishReason, SeqStatus, Sequence, make_generator


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step.

    block_ids: ``KVCacheManager.take_new_block_ids`` after this step's allocation
    (every block the first time the runner sees the sequence, then the new ones).
    samples: this chunk reaches the end of its tokens, so its last row is sampled.
    """

    seq: Sequence
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: tuple[int, ...]
    samples: bool


@dataclass
class SchedulerOutput:
    """One step: the batch (decodes first), rows to drop, copies to apply first."""

    scheduled: list[ScheduledSeq]
    removed_seq_ids: list[str]  # sequences that left since the last step (their rows go)
    copies: list[BlockCopy]  # forks' copy-on-write, applied to every layer before any K/V write
    preempted: list[Sequence] = field(default_factory=list)
    # set by Scheduler.advance: each sampled sequence's id -> the sequences its row's
    # tokens go to (itself, then the samples it forks), in the sampler's row order
    targets: dict[str, list[Sequence]] | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def sampling(self) -> list[ScheduledSeq]:
        return [s for s in self.scheduled if s.samples]

    def plan(self) -> StepPlan:
        """The step as the runner executes it (plain values: every rank gets it)."""
        seqs = []
        for s in self.scheduled:
            end = s.num_computed_tokens + s.num_new_tokens
            tokens = tuple(s.seq.request.all_token_ids[s.num_computed_tokens : end])
            seqs.append(
                PlannedSeq(s.seq.seq_id, s.num_computed_tokens, tokens, s.block_ids, s.samples)
            )
        return StepPlan(tuple(seqs), tuple(self.removed_seq_ids), tuple(self.copies))


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_scheduled_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_forks: int = 0
    num_block_copies: int = 0
    num_partial_prefills: int = 0  # prefill chunks that stopped before the prompt's end
    num_prefix_waits: int = 0  # admissions put off a step for a prefix computed in it
    max_blocks_in_use: int = 0


class Scheduler:
    """Waiting and running sequences over one KVCacheManager."""

    def __init__(self, config: EngineConfig, manager: KVCacheManager, device: torch.device) -> None:
        self.config = config
        self.manager = manager
        self.device = device
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.groups: dict[str, list[Sequence]] = {}  # request id -> its samples
        self.generators: dict[str, list[torch.Generator | None]] = {}
        self.stats = SchedulerStats()
        self._removed: list[str] = []
        self._copies: list[BlockCopy] = []  # forks' copies, for the next step
        self._next_seq = 0

    # -- requests ---------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams
    ) -> None:
        if request_id in self.groups:
            raise RequestError(f"request {request_id!r} already exists")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise RequestError(f"request {request_id!r}: the prompt is empty")
        limit = self.config.max_model_len
        if len(prompt) >= limit:
            raise RequestError(
                f"request {request_id!r}: prompt of {len(prompt)} tokens leaves no room to "
                f"generate within max_model_len {limit}"
            )
        usable = self.manager.block_pool.num_blocks - 1
        needed = cdiv(len(prompt) + 1, self.config.block_size)
        if needed > usable:
            raise RequestError(
                f"request {request_id!r}: prompt of {len(prompt)} tokens needs {needed} blocks "
                f"but the pool has {usable}; it could never run"
            )
        seed = params.seed
        self.generators[request_id] = [
            make_generator(None if seed is None else seed + i, self.device) for i in range(params.n)
        ]
        seq = Sequence(
            Request(self._new_seq_id(), prompt),
            request_id,
            0,
            params,
            self.generators[request_id][0],
            fork_pending=params.n > 1,
        )
        self.groups[request_id] = [seq]
        self.waiting.append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Stop every sample of the request now, wherever it is; returns those stopped."""
        seqs = self.groups.get(request_id)
        if seqs is None:
            raise RequestError(f"abort: unknown request {request_id!r}")
        stopped = []
        for seq in seqs:
            if seq.status is not SeqStatus.FINISHED:
                self._stop(seq, FinishReason.ABORTED)
                stopped.append(seq)
        return stopped

    def pop_group(self, request_id: str) -> list[Sequence]:
        """Forget a finished request (its samples)."""
        self.generators.pop(request_id, None)
        return self.groups.pop(request_id)

    def is_finished(self, request_id: str) -> bool:
        seqs = self.groups[request_id]
        if any(s.status is not SeqStatus.FINISHED for s in seqs):
            return False
        aborted = any(s.finish_reason is FinishReason.ABORTED for s in seqs)
        return aborted or len(seqs) == seqs[0].params.n

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def sample_generators(self, seq: Sequence) -> list[torch.Generator | None]:
        """The generators of the tokens drawn from ``seq``'s row: all n samples' when
        it forks at this step, else its own."""
        if seq.fork_pending:
            return self.generators[seq.group_id]
        return [seq.generator]

    # -- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        fork_blocks = 0  # blocks this step's forks will take in update()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed, budget)
            needs = self._fork_blocks(seq, num_new)
            while not self._fits(seq, num_new, fork_blocks + needs):
                victim = self.running[-1]  # the newest
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # seq itself was preempted, and everything after it before
            scheduled.append(self._schedule_seq(seq, num_new))
            fork_blocks += needs
            budget -= num_new
            i += 1
        if not preempted:  # memory is short when something was preempted: admit nothing
            budget = self._admit(budget, scheduled, fork_blocks)
        scheduled.sort(key=lambda s: s.num_new_tokens > 1)  # decodes first, stable otherwise
        removed: list[str] = []
        copies: list[BlockCopy] = []
        if scheduled:  # an empty step runs nothing: they go with the next one
            removed, self._removed = self._removed, []
            copies, self._copies = self._copies, []
        st = self.stats
        st.num_steps += 1
        st.num_scheduled_tokens += sum(s.num_new_tokens for s in scheduled)
        st.num_block_copies += len(copies)
        st.num_partial_prefills += sum(1 for s in scheduled if not s.samples)
        in_use = self.manager.block_pool.num_blocks - 1 - self.manager.get_num_free_blocks()
        st.max_blocks_in_use = max(st.max_blocks_in_use, in_use)
        return SchedulerOutput(scheduled, removed, copies, preempted)

    def _fits(self, seq: Sequence, num_new: int, reserved: int) -> bool:
        """Room for ``num_new`` more tokens of a running sequence, with ``reserved``
        blocks left free for this step's forks; allocates them when there is."""
        if self.manager.get_num_free_blocks() < reserved:
            return False
        if self.manager.allocate_slots(seq.request, num_new) is None:
            return False
        return self.manager.get_num_free_blocks() >= reserved

    def _fork_blocks(self, seq: Sequence, num_new: int) -> int:
        """Blocks the fork after this chunk will take: one copy of the partly filled
        last block per child (none when the prompt ends on a block boundary)."""
        request = seq.request
        if not seq.fork_pending or request.num_computed_tokens + num_new < request.num_tokens:
            return 0
        return (seq.params.n - 1) if request.num_tokens % self.config.block_size else 0

    def _admit(self, budget: int, scheduled: list[ScheduledSeq], fork_blocks: int) -> int:
        """Waiting sequences in order while the budget, rows and blocks allow.

        A sequence whose prefix includes a block that this step computes for another
        one waits a step (the others behind it go ahead): the KV manager makes a block
        a prefix hit only once its tokens are computed, so admitting both now would
        compute the shared blocks twice.
        """
        max_seqs = self.config.max_num_seqs
        rows_taken = sum(_rows(seq) for seq in self.running)
        in_flight = self._blocks_filled_by(scheduled)
        deferred: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if rows_taken + _rows(seq) > max_seqs:
                break
            request = seq.request
            if self._waits_for_prefix(request, in_flight):
                deferred.append(self.waiting.popleft())
                self.stats.num_prefix_waits += 1
                continue
            hits, num_hit = self.manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if self.manager.allocate_slots(request, num_new, num_hit, hits) is None:
                break
            fork_blocks += self._fork_blocks(seq, num_new)
            if self.manager.get_num_free_blocks() < fork_blocks:
                self.manager.free(request)  # safe right after allocation: nothing computed
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append(self._schedule_seq(seq, num_new))
            in_flight |= self._blocks_filled_by(scheduled[-1:])
            budget -= num_new
            rows_taken += _rows(seq)
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _blocks_filled_by(self, scheduled: Seq[ScheduledSeq]) -> set[BlockHash]:
        """Hashes of the full blocks these chunks complete that are not cached yet."""
        manager = self.manager
        if not manager.enable_caching or not self.waiting:
            return set()
        size = self.config.block_size
        filled: set[BlockHash] = set()
        for s in scheduled:
            first = s.num_computed_tokens // size
            end = (s.num_computed_tokens + s.num_new_tokens) // size
            if end > first:
                hashes = manager.hasher.update(s.seq.request)
                filled.update(
                    h for h in hashes[first:end] if manager.block_pool.get_cached_block(h) is None
                )
        return filled

    def _waits_for_prefix(self, request: Request, in_flight: set[BlockHash]) -> bool:
        if not in_flight:
            return False
        hashes = self.manager.hasher.update(request)
        num_hittable = (request.num_tokens - 1) // self.config.block_size
        return any(h in in_flight for h in hashes[:num_hittable])

    def _schedule_seq(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        request = seq.request
        num_computed = request.num_computed_tokens  # prefix hits included
        block_ids = tuple(self.manager.take_new_block_ids(seq.seq_id))
        samples = num_computed + num_new == request.num_tokens
        return ScheduledSeq(seq, num_computed, num_new, block_ids, samples)

    def update(
        self,
        output: SchedulerOutput,
        samples: Mapping[str, Seq[int]],
        logits: Mapping[str, torch.Tensor] | None = None,
    ) -> list[Sequence]:
        """The step ran and its tokens are known: ``advance`` then ``resolve``.
        ``samples[seq_id]``: n tokens for a sequence that forks now, else one.
        Returns the sequences that finished."""
        self.advance(output)
        return self.resolve(output, samples, logits)

    def advance(self, output: SchedulerOutput) -> None:
        """The step's K/V is in the cache, or will be before any later step reads it
        (stream order): ``mark_computed``, which also makes its full blocks of known
        tokens prefix-cache hits. Every sampled sequence (and the samples it forks now)
        gets a placeholder for its token, so the next step can be scheduled before the
        token's value is known; a sequence that reaches ``max_tokens`` or
        ``max_model_len`` with it finishes now (reported by ``resolve``).

        A sequence that finished since the step was scheduled (a stop token found by
        ``resolve`` of the step before) is skipped: its blocks are free already and
        this step's row of it is dropped."""
        targets: dict[str, list[Sequence]] = {}
        for s in output.scheduled:
            seq = s.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            self.manager.mark_computed(seq.request, s.num_new_tokens)
            if not s.samples:
                continue
            targets[seq.seq_id] = [seq, *self._fork(seq)] if seq.fork_pending else [seq]
            for target in targets[seq.seq_id]:
                target.request.append_placeholder()
                reason = self._length_reason(target)
                if reason is not None:
                    self._finish(target, reason)
        output.targets = targets

    def resolve(
        self,
        output: SchedulerOutput,
        samples: Mapping[str, Seq[int]],
        logits: Mapping[str, torch.Tensor] | None = None,
    ) -> list[Sequence]:
        """The values of the tokens ``advance`` gave placeholders: appended for good,
        stop tokens finish their sequences. Returns the sequences that finished with
        this step's tokens (those ``advance`` finished by length included)."""
        if output.targets is None:
            raise RequestError("resolve() before advance() of the same step")
        finished = []
        for seq_id, targets in output.targets.items():
            tokens = samples[seq_id]
            if len(tokens) != len(targets):
                raise RequestError(
                    f"sequence {seq_id!r}: {len(tokens)} sampled tokens for {len(targets)} samples"
                )
            row = None if logits is None else logits.get(seq_id)
            for target, token in zip(targets, tokens, strict=True):
                target.request.resolve_placeholder(int(token))
                if target.finish_reason is FinishReason.ABORTED:
                    continue  # aborted while the step ran: reported by abort()
                if row is not None:
                    target.logits.append(row)
                self.stats.num_generated_tokens += 1
                stops = int(token) in target.params.stop_token_ids
                if target.status is SeqStatus.FINISHED:  # by advance (length)
                    if stops:  # a stop token is the reason first
                        target.finish_reason = FinishReason.STOP
                    finished.append(target)
                elif stops:  # running, or preempted while this token was in flight
                    self._stop(target, FinishReason.STOP)
                    finished.append(target)
        output.targets = {}  # resolved: a second resolve finds nothing to do
        return finished

    # -- transitions ------------------------------------------------------------------

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Samples 1..n-1 of the parent's request (its prompt is computed, no token of
        its own yet): they share its full blocks; their copies of a partly filled last
        block go to every layer before the next step. schedule() kept the blocks free."""
        children = []
        at = self.running.index(parent)
        for index in range(1, parent.params.n):
            fork = self.manager.fork(parent.request, self._new_seq_id())
            if fork is None:
                raise AssertionError("schedule() reserves the blocks of every fork")
            self._copies += fork.copies
            child = Sequence(
                fork.child,
                parent.group_id,
                index,
                parent.params,
                self.generators[parent.group_id][index],
                status=SeqStatus.RUNNING,
            )
            children.append(child)
        self.running[at + 1 : at + 1] = children
        self.groups[parent.group_id].extend(children)
        parent.fork_pending = False
        self.stats.num_forks += len(children)
        return children

    def _length_reason(self, seq: Sequence) -> FinishReason | None:
        """The reason a sequence stops after its last token, whatever that token is."""
        if seq.num_output_tokens >= seq.params.max_tokens:
            return FinishReason.LENGTH
        if seq.request.num_tokens >= self.config.max_model_len:
            return FinishReason.MAX_MODEL_LEN
        return None

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.manager.free(seq.request)
        self._removed.append(seq.seq_id)
        # a fork aborted before its first step: its copy's destination is free again
        self._copies = [c for c in self._copies if c.request_id != seq.seq_id]

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._release(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    def _stop(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a running or waiting (queued, preempted) sequence."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)  # it holds no blocks
            seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        else:
            self._finish(seq, reason)

    def _preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV; it will be recomputed from its tokens."""
        self._release(seq)
        seq.request.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1

    def _new_seq_id(self) -> str:
        self._next_seq += 1
        return f"seq{self._next_seq}"


def _rows(seq: Sequence) -> int:
    """Block-table rows a sequence takes, or will once its samples fork from it."""
    return seq.params.n if seq.fork_pending else 1
