"""Slot mapping: where each scheduled token's K/V lives in the paged pool.

A token at absolute position ``p`` of request ``r`` lives in physical block
``block_table[r, p // block_size]`` at offset ``p % block_size``, i.e. at slot
``block_table[r, p // block_size] * block_size + p % block_size``. Padding tokens
get slot -1 and are never written.
"""

from __future__ import annotations

import numpy as np

PAD_SLOT_ID = -1


def token_positions(
    query_start_loc: np.ndarray, seq_lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Request index and absolute position of every scheduled token.

    query_start_loc: [B+1] cumulative query lengths. seq_lens: [B] context + query.
    Returns (req_idx [T_actual] int64, positions [T_actual] int64); the queries of a
    request are its last ``query_len`` positions.
    """
    query_start_loc = np.asarray(query_start_loc, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    query_lens = np.diff(query_start_loc)
    req_idx = np.repeat(np.arange(len(seq_lens), dtype=np.int64), query_lens)
    offset_in_query = np.arange(int(query_start_loc[-1]), dtype=np.int64) - query_start_loc[req_idx]
    positions = (seq_lens - query_lens)[req_idx] + offset_in_query
    return req_idx, positions


def compute_slot_mapping(
    block_table: np.ndarray,
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    num_tokens: int | None = None,
) -> np.ndarray:
    """Vectorised slot of every scheduled token, -1 for the padded tail.

    block_table: [B, max_blocks] physical block ids. Returns int64 [num_tokens]
    (num_tokens defaults to the number of scheduled tokens).
    """
    req_idx, positions = token_positions(query_start_loc, seq_lens)
    num_actual = len(positions)
    num_tokens = num_actual if num_tokens is None else num_tokens
    if num_tokens < num_actual:
        raise ValueError(f"num_tokens ({num_tokens}) < number of scheduled tokens ({num_actual})")
    slots = np.full(num_tokens, PAD_SLOT_ID, dtype=np.int64)
    blocks = np.asarray(block_table)[req_idx, positions // block_size].astype(np.int64)
    slots[:num_actual] = blocks * block_size + positions % block_size
    return slots
