"""StepPlan: one step as the worker side runs it, in plain values.

The scheduler's output holds its own state (sequences, generators); the runner needs
only what it computes: for each scheduled sequence its progress, the tokens of this
step, the block ids it has not seen, and whether its last row is sampled; plus the
rows to drop and the forks' copies. Being plain values, a plan is what rank 0
broadcasts to the other tensor-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.kv import BlockCopy, ScheduledRequest


@dataclass(frozen=True)
class PlannedSeq:
    """One sequence's share of a step: ``token_ids`` are its tokens at positions
    ``num_computed_tokens ..`` (the query), ``new_block_ids`` what
    ``KVCacheManager.take_new_block_ids`` gave for this step."""

    seq_id: str
    num_computed_tokens: int
    token_ids: tuple[int, ...]
    new_block_ids: tuple[int, ...]
    samples: bool  # the chunk reaches the end of the sequence's tokens: its last row

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    """A step for the runner: sequences in batch order (decodes first), the sequences
    that left since the last step, the copies to apply before any K/V is written."""

    seqs: tuple[PlannedSeq, ...]
    removed_seq_ids: tuple[str, ...] = ()
    copies: tuple[BlockCopy, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_pure_decode(self) -> bool:
        return bool(self.seqs) and all(s.num_new_tokens == 1 for s in self.seqs)

    def kv_requests(self) -> list[ScheduledRequest]:
        """The batch as the StepAssembler takes it."""
        return [
            ScheduledRequest(s.seq_id, s.num_computed_tokens, s.num_new_tokens, s.new_block_ids)
            for s in self.seqs
        ]
