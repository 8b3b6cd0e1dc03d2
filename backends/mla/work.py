"""A step's programs: each query tile's key ranges (split-KV) as a list of work items, and
where the rows of a request cut into several ranges keep their partial results.

A request whose keys fit one range (``keys_per_split``) is one program per tile that
writes its output directly; a longer one is cut into ``cdiv(seq_len, keys_per_split)``
ranges, each tile's ranges being programs of their own whose partial results (one slot
of ``[H, L]`` per token and range) ``_mla_reduce`` merges. So a ragged batch splits only
its long requests, and only their rows are merged: the way FlashInfer balances one.

Ranges are counted from the request's whole sequence (not a causal tile's horizon), so
the list and the reduction do not depend on a layer's causality: a causal tile's ranges
past its last query see no key and leave a partial of weight 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from pagedkv.backends.mla.configs import (
    GRAPH_PARTIAL_BYTES,
    GRAPH_SPLIT_PROGRAMS_PER_SM,
    PROGRAM_OVERHEAD_KEYS,
    SPLIT_POLICY,
)
from pagedkv.intmath import cdiv
from pagedkv.toolkit import split_kv
from pagedkv.toolkit.split_kv import SplitChoice


@dataclass(frozen=True)
class WorkList:
    """The programs of a step and its tokens' partial slots (host arrays)."""

    # [4, n] int32: request, first row (tile_table's), key range and the keys of its
    # request's ranges (one count for the step: the kernels read it per item, so a CUDA
    # graph's captured launches take each step's own ranges)
    items: np.ndarray
    # [2, T] int32: each token's ranges (1: its output is written directly) and the first
    # of its partial slots (its request's slots, token after token, range after range)
    token_ranges: np.ndarray
    num_partials: int  # partial slots the step writes
    num_splits: int  # the most ranges of a request (1: no partials at all)
    merges: np.ndarray  # [M] int32: the tokens of cut requests (the reduction's list)
    keys_per_split: int  # the keys of a range (every item's row 3)


def request_ranges(seq_lens: np.ndarray, keys_per_split: int) -> np.ndarray:
    """Key ranges of each request: one for a sequence within one range (or none)."""
    return np.maximum(1, -(-seq_lens.astype(np.int64) // keys_per_split))


def work_list(
    tiles: np.ndarray,
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    keys_per_split: int,
    num_tokens: int,
) -> WorkList:
    """Every tile's ranges as work items, the longest first (a range of a cut request is
    ``keys_per_split`` keys, the others shorter: the longest-first order lets the short
    ones fill the last wave), ties range after range, in tile order (a request's tiles
    of one range read the same latent rows: adjacent, they share them in L2).
    ``tiles``: ``tile_table``'s; ``num_tokens``: the token rows the reduction covers
    (padding tokens have one range: nothing to merge)."""
    ranges = request_ranges(seq_lens, keys_per_split)
    requests = tiles[0]
    per_tile = ranges[requests]
    tile_of = np.repeat(np.arange(tiles.shape[1]), per_tile)
    first = np.cumsum(per_tile) - per_tile
    split = np.arange(len(tile_of)) - np.repeat(first, per_tile)
    keys = np.minimum(keys_per_split, seq_lens[requests[tile_of]] - split * keys_per_split)
    order = np.lexsort((tile_of, split, -keys))  # longest, then range, then tile
    # (C order: the kernels read each row with a unit stride; np.take, not tiles[:, i]:
    # numpy's mixed indexing took 5x as long, a sixth of a 256-request step's build)
    items = np.empty((4, len(order)), dtype=np.int32)
    items[:2] = np.take(tiles, tile_of[order], axis=1)
    items[2] = split[order]
    items[3] = keys_per_split

    token_ranges = np.ones((2, num_tokens), dtype=np.int64)
    live = int(query_lens.sum())
    token_ranges[0, :live] = np.repeat(ranges, query_lens)
    slots = np.where(token_ranges[0] > 1, token_ranges[0], 0)
    token_ranges[1] = np.cumsum(slots) - slots
    merges = np.flatnonzero(token_ranges[0] > 1).astype(np.int32)
    return WorkList(
        items,
        token_ranges.astype(np.int32),
        int(slots.sum()),
        int(ranges.max(initial=1)),
        merges,
        keys_per_split,
    )


def choose_ranges(
    tile_keys: np.ndarray,
    num_sms: int,
    granule: int,
    partial_bytes_per_split: int,
    latent_bytes: int,
    grid: GraphGrid | None = None,
    copies: int = 1,
) -> SplitChoice:
    """An eager step's key ranges by the toolkit's makespan rule: even shares of every
    tile or fixed ranges (cutting only the long requests: a ragged batch), one program
    per SM (the kernels' shared memory), each program paying ``PROGRAM_OVERHEAD_KEYS``;
    only cut requests are merged. ``tile_keys``: each tile's keys (a causal tile's
    horizon); ``partial_bytes_per_split``: every token row's partial results for one
    range; ``latent_bytes``: one cached latent row; ``grid``: a CUDA-graph reservation's
    (no choice past its items or its ranges a request); ``copies``: the tiles each entry
    of ``tile_keys`` stands for (``decode_tiles``)."""
    # the reduction writes and reads a range's partials once, in the time the SMs'
    # programs stream that many bytes of latent rows (the toolkit's merge_keys_per_split
    # for a key of K and V)
    merge = 2 * partial_bytes_per_split / (num_sms * latent_bytes)
    return SPLIT_POLICY.choose_by_makespan(
        tile_keys, num_sms, granule=granule, overhead_keys=PROGRAM_OVERHEAD_KEYS,
        merge_keys_per_split=merge, key_ranges=True, listed=True, merge_split_only=True,
        max_programs=None if grid is None else grid.items / copies,
        max_splits=None if grid is None else grid.splits, copies=copies,
    )  # fmt: skip


def decode_tiles(query_lens: np.ndarray, num_heads: int, block_m: int) -> int:
    """The tiles of each request with a query in a decode step (one query token each:
    its tiles all visit the request's every key; a CUDA graph's padding requests have
    none), or 0 for another step (``tile_table``'s tiles)."""
    if len(query_lens) and query_lens.max() == 1:
        return cdiv(num_heads, block_m)
    return 0


def tile_keys(tiles: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray, num_heads: int,
              block_m: int, causal: bool) -> np.ndarray:  # fmt: skip
    """The keys each tile visits: the toolkit's ``tile_keys`` over the query tokens of
    its rows (``block_m`` rows from ``row0``, each a token x one of ``num_heads`` heads)."""
    req, row0 = tiles[0], tiles[1].astype(np.int64)
    q = query_lens[req].astype(np.int64)
    first = row0 // num_heads
    end = np.minimum(row0 + block_m - 1, q * num_heads - 1) // num_heads + 1
    return split_kv.tile_keys(seq_lens[req], q, first, end, causal=causal)


@dataclass(frozen=True)
class GraphGrid:
    """A CUDA-graph reservation's launch sizes, from its bounds alone: every step within
    them lists its own work items (its own ranges, ``choose_ranges``) inside these."""

    items: int  # the attention grid: work items, padded
    splits: int  # the most ranges a request takes (1: no partials, no reduction)
    partials: int  # partial slots
    merges: int  # tokens the reduction merges (each has at least two slots)


def graph_grid(
    num_tiles: int,
    max_seq_len: int,
    reduce_rows: int,
    slot_bytes: int,
    num_sms: int,
    forced: int | None = None,
) -> GraphGrid:
    """The sizes of a reservation whose steps have at most ``num_tiles`` tiles, sequences
    of at most ``max_seq_len`` keys and ``reduce_rows`` token rows; ``slot_bytes``: a
    token's partial results for one range; ``forced``: the ``num_splits`` option (every
    request up to that many ranges: all of them may be listed).

    The rule's ranges keep at least ``min_keys_per_split`` keys; the grid holds the
    tiles plus ``GRAPH_SPLIT_PROGRAMS_PER_SM`` programs an SM for the ranges a step cuts
    (the extra items a ragged batch's long requests take); its partials fit in
    ``GRAPH_PARTIAL_BYTES``. A step whose choice exceeds them takes longer ranges
    (``fit_graph``)."""
    if forced:
        splits = forced
        items = num_tiles * splits
        partials = reduce_rows * splits
    else:
        floor = SPLIT_POLICY.min_keys_per_split
        splits = max(1, min(SPLIT_POLICY.max_splits, cdiv(max_seq_len, floor)))
        items = min(num_tiles * splits, num_tiles + GRAPH_SPLIT_PROGRAMS_PER_SM * num_sms)
        partials = min(reduce_rows * splits, GRAPH_PARTIAL_BYTES // slot_bytes)
    if splits == 1 or partials < 2:
        return GraphGrid(num_tiles, 1, 0, 0)
    return GraphGrid(items, splits, partials, min(reduce_rows, partials // 2))


def fit_graph(work: WorkList, grid: GraphGrid, relist: Callable[[int], WorkList]) -> WorkList:
    """``work``, or, past the grid's items, ranges or partials, the list of ranges twice as
    long (``relist(keys_per_split)``), until it fits: one range a request at the latest
    (the tiles, within the grid by its bounds)."""
    while (
        work.items.shape[1] > grid.items
        or work.num_splits > grid.splits
        or work.num_partials > grid.partials
    ):
        if work.num_splits == 1:
            raise RuntimeError(
                f"the step lists {work.items.shape[1]} work items, more than the "
                f"CUDA-graph grid's {grid.items}"
            )
        work = relist(2 * work.keys_per_split)
    return work


def pad_items(items: np.ndarray, capacity: int, pad_row: int) -> np.ndarray:
    """``items`` followed by padding items up to ``capacity``: no keys (the kernels'
    programs end at their first test), and request 0 from row ``pad_row``, past any
    request's rows (were a program to go on, it would find no row)."""
    if items.shape[1] > capacity:
        raise RuntimeError(
            f"the step lists {items.shape[1]} work items, more than the CUDA-graph bound {capacity}"
        )
    padded = np.zeros((items.shape[0], capacity), dtype=np.int32)
    padded[:, : items.shape[1]] = items
    padded[1, items.shape[1] :] = pad_row
    return padded


def merge_list(merges: np.ndarray, token_ranges: np.ndarray, capacity: int) -> np.ndarray:
    """The reduction's ``Merges``: the count, then each merged token's (token, ranges,
    first slot) from ``token_ranges`` (one load a unit), then room up to ``capacity``."""
    listed = np.zeros(1 + 3 * capacity, dtype=np.int32)
    listed[0] = len(merges)
    entries = listed[1 : 1 + 3 * len(merges)].reshape(-1, 3)
    entries[:, 0] = merges
    entries[:, 1:] = token_ranges[:, merges].T
    return listed
