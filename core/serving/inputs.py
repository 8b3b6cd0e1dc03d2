"""StepInputs: the model's inputs for one step, in batch order, padded to a size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from pagedkv.errors import MetadataError
from pagedkv.kv import PLACEHOLDER_TOKEN_ID
from pagedkv.serving.plan import PlannedSeq
from pagedkv.slots import token_positions
from pagedkv.transfer import to_device


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


@dataclass(frozen=True)
class TokenFeed:
    """Tokens sampled by the step before, still on the device (async scheduling):
    ``rows[seq_id]`` is the row of ``tokens`` that holds the value of that sequence's
    placeholder."""

    tokens: torch.Tensor  # [R] int64
    rows: Mapping[str, int]


def build_step_inputs(
    scheduled: Sequence[PlannedSeq],
    device: torch.device,
    num_tokens: int | None = None,
    feed: TokenFeed | None = None,
) -> StepInputs:
    """Token ids and positions of every scheduled token (a sequence's tokens
    ``num_computed .. num_computed + num_new``), padded to ``num_tokens`` rows.
    A placeholder (a token sampled by the step before, not on the host yet) is the
    last token of its sequence; its id is copied from ``feed`` on the device.
    Host-to-device copies do not wait for the device's queue."""
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
    fed: list[tuple[int, int]] = []  # (input row, feed row)
    for s, start in zip(scheduled, query_start_loc[:-1], strict=False):
        ids[start : start + s.num_new_tokens] = s.token_ids
        if PLACEHOLDER_TOKEN_ID in s.token_ids:
            fed.append((int(start) + s.num_new_tokens - 1, _feed_row(s, feed)))
    padded_positions = np.zeros(num_tokens, dtype=np.int64)
    padded_positions[:num_actual] = positions
    last_rows = query_start_loc[1:] - 1
    sampled = np.array([s.samples for s in scheduled], dtype=bool)
    input_ids = to_device(ids, device)
    if fed:
        assert feed is not None
        dst, src = to_device(fed, device, torch.int64).unbind(1)
        input_ids.index_copy_(0, dst, feed.tokens.index_select(0, src))
    return StepInputs(
        input_ids=input_ids,
        positions=to_device(padded_positions, device),
        logits_indices=to_device(last_rows[sampled], device),
        num_actual_tokens=num_actual,
    )


def _feed_row(s: PlannedSeq, feed: TokenFeed | None) -> int:
    placeholders = [i for i, t in enumerate(s.token_ids) if t == PLACEHOLDER_TOKEN_ID]
    if placeholders != [s.num_new_tokens - 1] or feed is None or s.seq_id not in feed.rows:
        raise MetadataError(
            f"sequence {s.seq_id!r}: placeholder tokens at {placeholders} of its "
            f"{s.num_new_tokens} step tokens; only its last token may be one, with its "
            "value in the step before's sampled tokens"
        )
    return feed.rows[s.seq_id]
