"""Sequence: one sample of one request, as the scheduler tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from pagedkv.kv import Request
from pagedkv.serving.params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its KV dropped, to be recomputed)
    RUNNING = "running"  # holds blocks; scheduled every step the budget allows
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # a stop token was sampled
    MAX_MODEL_LEN = "max_model_len"  # the sequence filled max_model_len
    ABORTED = "aborted"

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False)
class Sequence:
    """Sample ``index`` of request ``group_id``: its tokens and progress (``request``,
    the KV manager's view) plus what the scheduler and sampler need.

    ``fork_pending``: sample 0 of an ``n > 1`` request before its prompt is computed;
    the other samples are forked from it (sharing its blocks) when it first samples.
    """

    request: Request
    group_id: str
    index: int
    params: SamplingParams
    generator: torch.Generator | None
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    fork_pending: bool = False
    num_preemptions: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # when params.return_logits

    @property
    def seq_id(self) -> str:
        return self.request.request_id

    @property
    def output_token_ids(self) -> list[int]:
        return list(self.request.all_token_ids[self.request.num_prompt_tokens :])

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_tokens - self.request.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V are not in the cache yet (the prompt, or the last sample)."""
        return self.request.num_tokens - self.request.num_computed_tokens


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator of its own for a seeded sample (None: the global RNG)."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
