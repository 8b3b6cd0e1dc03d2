"""StepInputs: the model's inputs for one step, in batch order, padded to a size."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from pagedkv.errors import MetadataError
from pagedkv.serving.plan import PlannedSeq
from pagedkv.slots import token_positions


@dataclass(frozen=True)
class StepInputs:
    """input_ids, positions: [T] int64 on the device (T = padded token count; padding
    rows are token 0 at position 0, their slots are -1 so they write nothing).
    logits_indices: [S] int64, the row of the last token of each sampled sequence,
    in batch order. num_actual_tokens: the scheduled (unpadded) tokens."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    num_actual_tokens: int


def build_step_inputs(
    scheduled: Sequence[PlannedSeq], device: torch.device, num_tokens: int | None = None
) -> StepInputs:
    """Token ids and positions of every scheduled token (a sequence's tokens
    ``num_computed .. num_computed + num_new``), padded to ``num_tokens`` rows."""
    query_lens = np.array([s.num_new_tokens for s in scheduled], dtype=np.int64)
    seq_lens = np.array([s.num_computed_tokens + s.num_new_tokens for s in scheduled], np.int64)
    query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_actual = int(query_start_loc[-1])
    num_tokens = num_actual if num_tokens is None else num_tokens
    if num_tokens < num_actual:
        raise MetadataError(f"num_tokens ({num_tokens}) < scheduled tokens ({num_actual})")
    _, positions = token_positions(query_start_loc, seq_lens)
    ids = np.zeros(num_tokens, dtype=np.int64)
    for s, start in zip(scheduled, query_start_loc[:-1], strict=False):
        ids[start : start + s.num_new_tokens] = s.token_ids
    padded_positions = np.zeros(num_tokens, dtype=np.int64)
    padded_positions[:num_actual] = positions
    last_rows = query_start_loc[1:] - 1
    sampled = np.array([s.samples for s in scheduled], dtype=bool)
    return StepInputs(
        input_ids=torch.from_numpy(ids).to(device),
        positions=torch.from_numpy(padded_positions).to(device),
        logits_indices=torch.from_numpy(last_rows[sampled]).to(device),
        num_actual_tokens=num_actual,
    )
