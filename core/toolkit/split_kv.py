"""Split-KV (flash-decoding): when few query tiles would leave SMs idle, several programs
share one sequence's keys and a reduction merges their partial results.

One rule for every backend; each backend keeps its own ``SplitPolicy`` numbers (its
programs differ in size), and every backend names the forcing option ``num_splits``.

For backends whose kernels cannot split one sequence, the combinator below splits at
the pagedkv level: slices of a long decode request become extra requests of one
backend call, merged by log-sum-exp (``SplitKVCombinator``; the pieces
``plan_decode_slices``, ``attend_sliced`` and ``merge_by_lse`` for a backend that
integrates them in its own builder and impl).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from pagedkv.errors import MetadataError, UnsupportedError
from pagedkv.intmath import cdiv, prev_power_of_2
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.transfer import to_device

if TYPE_CHECKING:
    from pagedkv.backend import AttentionImpl, AttentionMetadataBuilder
    from pagedkv.graph import GraphBounds
    from pagedkv.spec import AttentionSpec

# Without a GPU (Triton's interpreter, Pallas interpret mode) there is no SM count; this
# stands in for it, small enough that only few-sequence, long-context batches split,
# so CPU tests still cover the split path.
CPU_SM_COUNT = 4

# the ufuncs' reductions, called directly (ndarray.max and .sum add a Python frame:
# the rule runs a few dozen of them on every step's build)
_max, _min, _sum = np.maximum.reduce, np.minimum.reduce, np.add.reduce


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device | str) -> int:
    """Streaming multiprocessors of ``device``; CPU_SM_COUNT for a CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class SplitChoice:
    num_splits: int  # programs per query tile along the keys
    keys_per_split: int  # a multiple of the caller's granule; the last split may be shorter
    # split s takes keys [s, s + 1) * keys_per_split of every sequence (a short one's
    # last splits are empty), not an even share of each sequence's keys
    fixed_ranges: bool = False


@dataclass(frozen=True)
class SplitPolicy:
    """When and how far to split.

    A batch splits when its longest query has at most ``max_query_len`` tokens (None:
    any) and its grid has fewer than ``split_below_programs_per_sm`` programs per SM;
    it then gets enough splits for ``target_programs_per_sm``, each split keeping at
    least ``min_keys_per_split`` keys, at most ``max_splits``. The makespan rule
    (``choose_by_makespan``) lets a grid of fewer unsplit programs than the GPU has SMs
    split down to ``sparse_grid_min_keys_per_split`` keys (None: no lower; ``key_floor``).
    """

    max_query_len: int | None = 8
    split_below_programs_per_sm: float = 2.0
    target_programs_per_sm: float = 4.0
    min_keys_per_split: int = 512
    max_splits: int = 64
    sparse_grid_min_keys_per_split: int | None = None

    def key_floor(self, programs: int, num_sms: int | None) -> int:
        """The fewest keys a split of a grid of ``programs`` unsplit programs keeps.
        A grid that leaves SMs idle unsplit is latency-bound: its splits' start-up and
        merge cost little beside the idle SMs they fill, so they may be short
        (``sparse_grid_min_keys_per_split``); a grid that fills every SM gains only the
        last wave's balance from a split, which short ranges' merge traffic outweighs
        (``min_keys_per_split``)."""
        sparse = self.sparse_grid_min_keys_per_split
        if sparse is None or num_sms is None or programs >= num_sms:
            return self.min_keys_per_split
        return min(sparse, self.min_keys_per_split)

    def choose(
        self,
        num_programs: int,
        max_query_len: int,
        max_seq_len: int,
        num_sms: int,
        *,
        forced: int | None = None,
        granule: int = 1,
    ) -> SplitChoice:
        """Splits for a grid of ``num_programs`` (query tiles x heads it runs in parallel)
        over sequences of at most ``max_seq_len`` keys. ``forced`` (the backend's
        ``num_splits`` option; 0 or None = choose) overrides the rule; ``granule``
        (keys per inner-loop step) divides every split but the last."""
        if forced:
            splits = max(1, min(forced, self.max_splits))
        elif (
            num_programs <= 0
            or max_seq_len <= 0
            or (self.max_query_len is not None and max_query_len > self.max_query_len)
            or num_programs >= self.split_below_programs_per_sm * num_sms
        ):
            splits = 1
        else:
            by_occupancy = int(self.target_programs_per_sm * num_sms // num_programs)
            by_length = max_seq_len // self.min_keys_per_split
            splits = max(1, min(self.max_splits, by_occupancy, by_length))
        return self._choice(splits, max_seq_len, granule)

    def choose_by_makespan(
        self,
        keys: np.ndarray,
        slots: int,
        *,
        granule: int,
        overhead_keys: float,
        merge_keys_per_split: float = 0.0,
        max_splits: int | None = None,
        copies: int = 1,
        split_slots: int | None = None,
        range_slots: int | None = None,
        key_ranges: bool = False,
        listed: bool = False,
        max_programs: float | None = None,
        range_multiples: tuple[float, ...] = (1.0,),
        merge_split_only: bool = False,
        min_keys_per_split: int | None = None,
        free_share: float = 1.0,
    ) -> SplitChoice:
        """Splits that minimise the estimated time of a grid whose programs stream
        ``keys[i]`` keys each (one entry per program before splitting: query tiles x
        heads; each entry stands for ``copies`` programs, e.g. one per KV head), on a GPU
        that runs ``slots`` programs at once (``split_slots`` of a split launch, whose
        kernel may hold more or fewer programs per SM; default ``slots``; ``range_slots``
        of a launch of fixed key ranges, default ``split_slots``). ``merge_keys_per_split``
        is in the unit of the ``split_slots`` grid (``merge_keys_per_split()``), rescaled
        for ``range_slots``.

        Split ``s`` cuts every program into ``s`` programs of ceil(keys / s) keys (in
        whole ``granule`` steps), each also paying ``overhead_keys`` (start-up, epilogue).
        The grid's time is estimated as list scheduling bounds it: the total work spread
        over the slots, or the longest program if that is longer; a grid whose programs
        all start at once takes just that. A grid of several waves adds a tail, the
        larger of: the idle share of a thin last wave times the longest program (a
        uniform grid), and ``RAGGED_TAIL_SHARE`` times the longest program's excess
        over the mean one (a long program of a ragged grid may start late and end
        alone). A split grid also pays ``merge_keys_per_split`` per split for the
        reduction. So a uniform grid splits until it fits in one wave or its last wave
        is full, a ragged one until its longest request is no longer the critical path,
        and a full one does not split. The fewest splits within ``MAKESPAN_TIE`` of the
        best win.
        Candidates keep at least ``min_keys_per_split`` keys per split of the longest
        program (default: the policy's; ``key_floor`` gives a grid's), and at most
        ``max_splits`` (default: the policy's).

        ``key_ranges``: splits may also be fixed key ranges, the way FlashInfer balances
        a ragged batch: every program takes ``keys_per_split`` keys of its sequence (the
        last of a sequence fewer), so a long sequence gets many programs and a short one
        few; the grid's split axis is the longest sequence's count, and the other
        sequences' programs past their keys exit at once (each still costs
        ``overhead_keys``), unless the launch is ``listed``: one program per range that
        holds keys. Ranges are powers of two times ``granule`` times each of
        ``range_multiples`` (whole steps), of at least ``min_keys_per_split`` keys, at most
        ``max_splits`` per sequence. The best of them is taken
        (``SplitChoice.fixed_ranges``) when its estimate beats even shares' by more than
        ``MAKESPAN_TIE``: the longest power of two within ``RANGE_TIE`` of the best
        estimate (the fewest splits, as among even shares), a multiple of one only where
        it beats them all by more than that.

        ``max_programs``: the most programs (per copy) the launch's grid holds, e.g. a
        CUDA-graph grid sized once for every step; choices past it are not taken (one
        program per entry always fits). Per copy, it may be a fraction (a grid of 100
        programs for entries of 8 copies each holds 12.5 an entry's worth). ``merge_split_only``: the kernel writes the
        output of a sequence its ranges do not cut directly, so fixed ranges pay the
        reduction only for the programs they cut (``merge_keys_per_split`` being every
        program's share of it, once per range). ``free_share``: the share of the slots
        free when the grid launches, another launch holding the rest for a while (a
        two-part step's other part beside it): the work still spreads over every slot,
        but a grid of more programs than the free slots does not start at once, so it
        pays the tail of several waves."""
        keys = np.asarray(keys, dtype=np.float64)
        limit = min(max_splits or self.max_splits, self.max_splits)
        even_limit = limit  # even shares split every entry alike
        if max_programs is not None:
            even_limit = max(1, min(limit, int(max_programs // max(1, len(keys)))))
        split_slots = split_slots or slots
        floor = min_keys_per_split or self.min_keys_per_split
        costs = (granule, overhead_keys, merge_keys_per_split, copies)
        steps = np.ceil(keys / granule)  # [P] inner steps per unsplit program
        even, even_time = self._even_shares(
            keys, steps, slots, split_slots, even_limit, floor, *costs, free_share
        )
        if key_ranges and limit > 1:
            range_slots = range_slots or split_slots
            merge = _merge_on(range_slots, merge_keys_per_split, split_slots)
            ranged, ranged_time = self._key_ranges(
                steps, range_slots, limit, floor, granule, overhead_keys, merge, copies,
                listed, max_programs, range_multiples, merge_split_only, free_share,
            )  # fmt: skip
            if ranged_time < even_time * (1 - MAKESPAN_TIE):
                return ranged
        return even

    def _even_shares(
        self,
        keys: np.ndarray,
        steps: np.ndarray,
        slots: int,
        split_slots: int,
        limit: int,
        floor: int,
        granule: int,
        overhead_keys: float,
        merge_keys_per_split: float,
        copies: int,
        free_share: float = 1.0,
    ) -> tuple[SplitChoice, float]:
        """``choose_by_makespan``'s even shares of at least ``floor`` keys and their
        estimated time (in keys); ``steps``: each program's keys in ``granule`` steps."""
        longest = float(_max(keys, initial=0.0))
        limit = max(1, min(limit, int(longest) // floor))
        candidates, merges, grid_slots = _even_candidates(limit, slots, split_slots)
        per_program = (
            np.ceil(steps[None, :] / candidates[:, None]) * granule + overhead_keys
        )  # [S, P]
        estimate = _grid_time(
            _sum(per_program, axis=1) * candidates * copies,
            _max(per_program, axis=1, initial=0.0),
            len(keys) * candidates * copies,
            grid_slots,
            free_share,
        )
        estimate += merges * merge_keys_per_split
        best = _min(estimate)
        pick = int(np.argmax(estimate <= best * (1 + MAKESPAN_TIE)))
        return self._choice(int(candidates[pick]), int(longest), granule), float(estimate[pick])

    def _key_ranges(
        self,
        steps: np.ndarray,
        slots: int,
        limit: int,
        floor: int,
        granule: int,
        overhead_keys: float,
        merge_keys_per_split: float,
        copies: int,
        listed: bool,
        max_programs: float | None = None,
        range_multiples: tuple[float, ...] = (1.0,),
        merge_split_only: bool = False,
        free_share: float = 1.0,
    ) -> tuple[SplitChoice, float]:
        """``choose_by_makespan``'s fixed key range of at least ``floor`` keys (on a split
        grid of ``slots``) over programs of ``steps`` inner steps (of ``granule`` keys)
        and its estimated time (in keys); an infinite time when none applies (or none
        launches within ``max_programs`` programs per copy)."""
        most = float(_max(steps, initial=0.0))
        longest = most * granule
        ranges = [
            k // granule
            for k in self.key_range_candidates(longest, granule, limit, range_multiples, floor)
        ]
        if not ranges:
            return SplitChoice(1, int(most * granule)), float("inf")
        estimate, splits, programs = _range_estimates(
            steps, np.array(ranges, dtype=np.float64), slots, granule, overhead_keys,
            merge_keys_per_split, copies, listed, merge_split_only, free_share,
        )  # fmt: skip
        if max_programs is not None:  # the grid's programs, per copy
            estimate[programs / copies > max_programs] = np.inf
        pick = key_range_pick(np.asarray(ranges), estimate)
        return (
            SplitChoice(int(splits[pick]), int(ranges[pick] * granule), fixed_ranges=True),
            float(estimate[pick]),
        )

    def key_range_candidates(
        self,
        longest: float,
        granule: int,
        limit: int,
        range_multiples: tuple[float, ...] = (1.0,),
        floor: int | None = None,
    ) -> list[int]:
        """The fixed key ranges (in keys) ``choose_by_makespan`` compares for a longest
        program of ``longest`` keys: powers of two of ``granule`` times each of
        ``range_multiples``, in whole granules, at least ``floor`` (default
        ``min_keys_per_split``), at most ``limit`` of them in the longest program,
        shorter than it; none unless it holds two minimal ranges (as even shares)."""
        floor = floor or self.min_keys_per_split
        most = math.ceil(longest / granule)
        return list(_key_range_candidates(most, granule, limit, tuple(range_multiples), floor))

    def key_range_estimates(
        self,
        keys: np.ndarray,
        slots: int,
        keys_per_split: list[int],
        *,
        granule: int,
        overhead_keys: float,
        merge_keys_per_split: float = 0.0,
        copies: int = 1,
        listed: bool = False,
        split_slots: int | None = None,
    ) -> np.ndarray:
        """``choose_by_makespan``'s estimate (in keys) of fixed key ranges of each of
        ``keys_per_split`` keys (whole ``granule`` steps) on a split grid of ``slots``
        (``merge_keys_per_split`` in the unit of a grid of ``split_slots``, as there;
        default ``slots``): what a measurement of each range
        (benchmarks/triton_sweep.py --key-ranges) is compared with to fit the estimate's
        constants."""
        steps = np.ceil(np.asarray(keys, dtype=np.float64) / granule)
        per_range = np.asarray(keys_per_split, dtype=np.float64) / granule
        merge = _merge_on(slots, merge_keys_per_split, split_slots or slots)
        return _range_estimates(
            steps, per_range, slots, granule, overhead_keys, merge, copies, listed
        )[0]

    @staticmethod
    def _choice(splits: int, max_seq_len: int, granule: int) -> SplitChoice:
        if splits == 1 or max_seq_len <= 0:
            return SplitChoice(1, max(granule, cdiv(max(max_seq_len, 1), granule) * granule))
        keys = cdiv(cdiv(max_seq_len, splits), granule) * granule
        # no split is empty for the longest sequence
        return SplitChoice(cdiv(max_seq_len, keys), keys)


def key_range_pick(steps_each: np.ndarray, estimates: np.ndarray) -> int:
    """The index of the fixed key range ``choose_by_makespan`` takes among ranges of
    ``steps_each`` granules (ascending) with ``estimates``: the longest power of two within
    ``RANGE_TIE`` of the best estimate (the fewest splits), else the best outright (the
    longest of equal ones). Within the tie the estimate does not rank the ranges."""
    steps_each = np.asarray(steps_each, dtype=np.int64)
    best = estimates <= _min(estimates)
    powers = (estimates <= _min(estimates) * (1 + RANGE_TIE)) & (
        (steps_each & (steps_each - 1)) == 0
    )
    return int(np.flatnonzero(powers if powers.any() else best)[-1])


def tile_keys(
    seq_lens: np.ndarray,
    query_lens: np.ndarray,
    first_query: np.ndarray,
    end_query: np.ndarray,
    *,
    causal: bool,
    window: int | None = None,
    key_step: int = 1,
) -> np.ndarray:
    """Keys a query tile visits (for one KV head), the work the makespan rule weighs:
    per tile, its request's ``seq_lens`` and ``query_lens`` and its queries ``[first_query,
    end_query)`` within the request. Causal: the keys up to its last query's position.
    With a sliding window, at most the window's keys (on both sides of each row without
    the causal mask) beside the tile's rows, plus one ``key_step`` (a kernel's steps are
    aligned to it, a window's first key is not)."""
    seq = np.asarray(seq_lens, dtype=np.int64)
    if causal:
        seq = seq - np.asarray(query_lens, dtype=np.int64) + np.asarray(end_query, np.int64)
    if window is not None:
        rows = np.asarray(end_query, np.int64) - np.asarray(first_query, np.int64)
        span = window if causal else 2 * window
        seq = np.minimum(seq, span + rows + key_step)
    return seq.astype(np.float64)


def splits_within(budget_bytes: int, bytes_per_split: int) -> int:
    """The most splits whose partial results (``bytes_per_split`` each) fit in
    ``budget_bytes``; at least one (an unsplit step writes none)."""
    return max(1, budget_bytes // max(1, bytes_per_split))


def merge_keys_per_split(partial_bytes: int, slots: int, head_size: int, cache_bytes: int) -> float:
    """The reduction's cost per split in ``choose_by_makespan``'s unit (keys one program
    streams): it writes and reads ``partial_bytes`` (one split's partial results) once,
    in the time ``slots`` programs stream that many keys of K and V."""
    return 2 * partial_bytes / (slots * 2 * head_size * cache_bytes)


def _merge_on(slots: int, merge_keys_per_split: float, merge_slots: int) -> float:
    """``merge_keys_per_split`` given in the unit of a grid of ``merge_slots`` programs
    (keys one of them streams meanwhile) in that of a grid of ``slots``."""
    return merge_keys_per_split * merge_slots / slots


def _range_estimates(
    steps: np.ndarray,
    per_range: np.ndarray,
    slots: int,
    granule: int,
    overhead_keys: float,
    merge_keys_per_split: float,
    copies: int,
    listed: bool,
    merge_split_only: bool = False,
    free_share: float = 1.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The makespan estimate of fixed key ranges of ``per_range`` inner steps each (one
    entry per range size) over programs of ``steps`` inner steps, with each size's split
    count (the longest program's ranges) and its programs (``merge_split_only``,
    ``free_share``: see ``SplitPolicy.choose_by_makespan``)."""
    most = float(_max(steps, initial=0.0))
    pieces = np.ceil(steps[None, :] / per_range[:, None])  # [R, P] programs with keys
    splits = np.ceil(most / per_range)  # [R] the grid's split axis
    with_keys = _sum(pieces, axis=1)  # [R]
    work = (float(_sum(steps)) * granule + with_keys * overhead_keys) * copies
    if listed:  # only the programs with keys
        programs = with_keys * copies
    else:  # every sequence's programs up to the longest one's, the others empty
        programs = len(steps) * splits * copies
        work += (programs - with_keys * copies) * overhead_keys
    longest = np.minimum(per_range, most) * granule + overhead_keys
    # not _grid_time's waves: every sequence's last range is shorter than the others, so
    # programs end at scattered times and a wave boundary falls anywhere in the last one
    tail = np.where(programs <= slots * free_share, 0.0, RANGE_TAIL_SHARE * longest)
    estimate = np.maximum(work / max(1, slots) + tail, longest)
    if merge_split_only:  # each cut program's ranges, at its share of a split's merge
        cut = np.where(pieces > 1, pieces, 0.0).sum(axis=1)
        estimate += cut / max(1, len(steps)) * merge_keys_per_split
    else:
        estimate += splits * merge_keys_per_split
    return estimate, splits, programs


@functools.lru_cache(maxsize=256)
def _even_candidates(limit: int, slots: int, split_slots: int) -> tuple[np.ndarray, ...]:
    """The split counts even shares compare (at most ``limit``; the first, 1, unsplit),
    each one's count of merged splits (none unsplit), and the slots of its grid (an
    unsplit launch's ``slots``, a split one's ``split_slots``; at least one). Read-only:
    kept for every step of a layer."""
    counts = [c for c in _SPLIT_CANDIDATES if c <= limit] or [1]
    candidates = np.array(counts, dtype=np.float64)
    merges = np.where(candidates > 1, candidates, 0.0)
    grid_slots = np.where(candidates > 1, split_slots, slots).clip(min=1).astype(np.float64)
    for a in (candidates, merges, grid_slots):
        a.flags.writeable = False
    return candidates, merges, grid_slots


@functools.lru_cache(maxsize=4096)
def _key_range_candidates(
    most: int, granule: int, limit: int, range_multiples: tuple[float, ...], floor: int
) -> tuple[int, ...]:
    """``SplitPolicy.key_range_candidates`` for a longest program of ``most`` inner
    steps: a step's longest request changes step count once every ``granule`` keys, so
    successive decode steps look the same ranges up."""
    least = max(cdiv(floor, granule), math.ceil(most / limit))
    candidates: set[int] = set()  # inner steps per split
    r = prev_power_of_2(least)
    while r < most and most * granule >= 2 * floor:
        steps_each = (r * m for m in range_multiples)
        candidates |= {int(n) for n in steps_each if n == int(n) and least <= n < most}
        r *= 2
    return tuple(n * granule for n in sorted(candidates))


def _grid_time(
    work: np.ndarray,
    longest: np.ndarray,
    programs: np.ndarray,
    slots: np.ndarray,
    free_share: float = 1.0,
) -> np.ndarray:
    """The makespan estimate of grids (one per entry) whose programs stream ``work``
    keys between them, the longest ``longest``: list scheduling's bound (the work over
    the slots, or the longest program), plus a tail when the grid takes several waves:
    the larger of the idle share of a thin last wave times the longest program, and
    ``RAGGED_TAIL_SHARE`` times the longest program's excess over the mean. A grid of
    more programs than the slots free at its launch (``free_share`` of them) has that
    tail too."""
    programs = np.asarray(programs, dtype=np.float64)
    mean = work / np.maximum(programs, 1)
    last_wave = programs % slots
    thin = np.where(last_wave == 0, 0.0, 1.0 - last_wave / slots) * longest
    ragged = RAGGED_TAIL_SHARE * (longest - mean)
    tail = np.where(programs <= slots * free_share, 0.0, np.maximum(thin, ragged))
    return np.maximum(work / slots, longest) + tail


# Split counts the makespan rule compares (each a whole number of even shares; between
# two of them the estimate changes little)
_SPLIT_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
# The ragged grid's tail: its longest program's excess over the mean, times this. Fitted
# with the Triton backend on the H200 (benchmarks/triton_sweep.py --all-splits over 12
# decode workloads, docs/triton.md): 1.5 picks the fastest split count on 11 of them
# and one within 0.4% on the 12th
RAGGED_TAIL_SHARE = 1.5
# The tail of a grid of fixed key ranges: this share of its longest program, the idle
# expected where the last wave's programs end at scattered times. H200, the Triton
# backend's ranges at 1-1.75x powers of two on 8 ragged and speculative rows
# (benchmarks/triton_sweep.py --key-ranges, docs/triton.md): the ranges the estimate
# ranks first ran within 1.054x of the fastest (mean 1.014x), where the waves' tail
# (_grid_time: the thin last wave's idle share) gave 1.131x (mean 1.026x)
RANGE_TAIL_SHARE = 0.5
# Estimates within this fraction of the best are a tie, won by fewer splits (each split
# adds partial results to write and merge, which the estimate only approximates)
MAKESPAN_TIE = 0.05
# ... among fixed key ranges of powers of two (a CUDA-graph step's, a two-part step's),
# where the finer of two neighbours writes twice the partials. H200, Triton backend,
# twenty-sixth session (docs/triton.md): at 2% GQA 16 took 1024-key ranges in a graph
# reserved for 32k, 108.1 us against 117.8 for the 512-key ranges of the best estimate,
# the D 64 mixed step's decodes 98.7 against 102.6. Where multiples of powers of two are
# compared too (an eager step's), the tie goes to the longest power of two within it, and
# a multiple wins only by more than the tie: the tie toward the longest of all lost 1-3%
# on five eager rows (speculative 32 x 8: 2560-key ranges, 185.0 us against 181.1 for
# 2048), while within 2% the multiples' own picks ran at most 0.35% faster than the
# powers of two, and 1.3% slower on speculative 64 x 4 (H100, forty-fourth session, each
# row's two plans: 364.0 us at 1536 keys against 359.4 at 2048; ragged 128, GQA 1 and
# B 64 ragged 0.15-0.35% faster at 768 keys than at 1024, ragged 32 long level; the
# forty-first session's run alike; the H200's sweep, sweep-h200-twelfth-key-ranges.json:
# the picks' mean 1.014x -> 1.013x of the fastest, the worst 1.054x -> 1.033x). GQA 16
# ragged keeps its 1792-key ranges: the best power of two is 10% above them by the
# estimate (6.5% slower measured)
RANGE_TIE = 0.02


# -- the split-KV combinator: slices of long decodes as extra requests ---------------------
#
# A backend that cannot split one sequence's keys across programs still can when the
# sequence is presented to it as several requests, one per slice of its page table,
# each with a copy of the query row. The backend attends the expanded step once,
# returning each row's log-sum-exp (``attend_with_lse``), and ``merge_by_lse`` combines
# each original row's slices in one small kernel. Only rows whose request has one query
# token are cut: a single query sits at the last position and sees every key before it,
# so each slice, attended as a request of its own, sees exactly its keys. A request
# with L > 1 query rows cannot be cut this way under the causal mask: its row j sees
# keys up to position seq_len - L + j, but a slice attended as a request masks
# relative to the slice's own end, so every row but the last would see other keys.


class LSEAttention(Protocol):
    """What an impl provides to be split by the combinator."""

    def attend_with_lse(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        output: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``attend`` without the layer's sinks, with the log-sum-exp (natural log) of each
        row's scaled scores, [T, num_heads] float32 (-inf: no key). Returns the tensors
        holding the results: ``output`` and ``lse`` once written, or the kernel's own of
        the same shapes (any strides) to spare a copy. Rows past ``num_actual_tokens``
        are unspecified in both."""


def split_problem(spec: AttentionSpec) -> str | None:
    """Why the combinator cannot cut this layer's decode rows into slices, or None."""
    if spec.sliding_window is not None:
        return (
            "sliding window: each slice is attended as a request of its own, whose query "
            "sits at the slice's end, so the window would select keys by the wrong position"
        )
    if spec.alibi_slopes is not None:
        return (
            "ALiBi: the bias slope * (k - q) depends on absolute positions, which move when "
            "a slice is attended as a request of its own"
        )
    return None


@dataclass(frozen=True)
class SliceCapacity:
    """Fixed sizes of a sliced step, so a CUDA graph captured on one replays any other."""

    num_requests: int  # virtual requests
    num_rows: int  # rows of the expanded query
    table_width: int  # block-table columns

    @classmethod
    def for_bounds(cls, bounds: GraphBounds, num_splits: int) -> SliceCapacity:
        """Room for every step within ``bounds`` when requests are cut into at most
        ``num_splits`` slices (a request has at most one decode row)."""
        decodes = min(bounds.max_num_reqs, bounds.max_num_tokens)
        extra = decodes * (num_splits - 1)
        return cls(
            bounds.max_num_reqs + extra, bounds.max_num_tokens + extra, bounds.max_blocks_per_req
        )


@dataclass(frozen=True)
class DecodeSlices:
    """A step whose long decode requests are cut into slices of their keys.

    ``common`` is the expanded step: request order kept, each cut request replaced
    by its slices (``keys_per_split`` keys each, the last one the rest, each with a
    copy of the query row), every other request whole. Its slot mapping is all -1:
    attending it writes nothing. Expanded rows keep the original rows' order.
    """

    common: CommonAttentionMetadata
    query_rows: torch.Tensor  # [T_exp] int64, device: the original row each expanded row copies
    merge_indptr: torch.Tensor  # [T + 1] int32, device: original row t merges rows [t]:[t + 1]
    num_cut: int  # requests cut into more than one slice
    keys_per_split: int


Buffer = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]


def plan_decode_slices(
    common: CommonAttentionMetadata,
    keys_per_split: int,
    *,
    capacity: SliceCapacity | None = None,
    buffer: Buffer | None = None,
) -> DecodeSlices:
    """Cut every request with one query token and more than ``keys_per_split`` keys.

    Host planning from the step's CPU copies; the sliced block table is gathered on the
    table's device (small host-to-device copies, no sync). ``keys_per_split`` must be a
    multiple of the block size (slices start on a page). With ``capacity`` (a CUDA-graph
    reservation) every tensor has the capacity's fixed size — unused requests are empty,
    unused rows padding — and lives in ``buffer(name, shape, dtype)`` (the builder's
    ``scratch``: persistent under a reservation).
    """
    bs = common.block_size
    if keys_per_split <= 0 or keys_per_split % bs:
        raise ValueError(
            f"keys_per_split = {keys_per_split}: expected a positive multiple of the block "
            f"size {bs} (each slice starts on a page)"
        )
    qsl = common.query_start_loc_cpu.numpy().astype(np.int64)
    seq = common.seq_lens_cpu.numpy().astype(np.int64)
    query_lens = np.diff(qsl)
    cut = (query_lens == 1) & (seq > keys_per_split)
    pieces = np.where(cut, -(-seq // keys_per_split), 1)
    req = np.repeat(np.arange(seq.size, dtype=np.int64), pieces)
    piece = np.arange(req.size, dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    first_key = np.where(cut[req], piece * keys_per_split, 0)
    v_seq = np.where(cut[req], np.minimum(keys_per_split, seq[req] - first_key), seq[req])
    v_query = np.where(cut[req], 1, query_lens[req])
    v_qsl = np.zeros(req.size + 1, dtype=np.int64)
    np.cumsum(v_query, out=v_qsl[1:])
    rows = int(v_qsl[-1])
    query_rows = np.repeat(qsl[req] - v_qsl[:-1], v_query) + np.arange(rows, dtype=np.int64)
    # expanded rows are in the original rows' order: row t's slices are one run
    merge_indptr = np.searchsorted(query_rows, np.arange(common.num_tokens + 1), side="left")
    pages = -(-v_seq // bs)

    num_v, num_rows = req.size, rows
    width = max(1, int(pages.max(initial=0)))
    if capacity is not None:
        for name, got, cap in (
            ("requests", num_v, capacity.num_requests),
            ("rows", rows, capacity.num_rows),
            ("block-table columns", width, capacity.table_width),
        ):
            if got > cap:
                raise MetadataError(
                    f"split-KV slices: {got} {name} exceed the reserved {cap} (SliceCapacity "
                    "from the CUDA-graph bounds)"
                )
        num_v, num_rows, width = capacity.num_requests, capacity.num_rows, capacity.table_width
    pad_v = num_v - req.size
    v_qsl = np.pad(v_qsl, (0, pad_v), mode="edge")
    v_seq = np.pad(v_seq, (0, pad_v))
    query_rows = np.pad(query_rows, (0, num_rows - rows))

    device = common.block_table.device
    host = {
        "query_start_loc": v_qsl.astype(np.int32),
        "seq_lens": v_seq.astype(np.int32),
        "query_rows": query_rows,
        "merge_indptr": merge_indptr.astype(np.int32),
    }
    out: dict[str, torch.Tensor] = {}
    for name, array in host.items():
        src = torch.from_numpy(array)
        if buffer is None:
            out[name] = to_device(src, device)
        else:
            out[name] = buffer(f"split_kv.{name}", tuple(src.shape), src.dtype)
            out[name].copy_(src, non_blocking=True)

    # the sliced table: row v holds its request's pages from its slice's first page on
    first_page = to_device(np.pad(first_key // bs, (0, pad_v)), device)
    owner = to_device(np.pad(req, (0, pad_v)), device)
    used = to_device(np.pad(pages, (0, pad_v)), device)
    cols = torch.arange(width, device=device)
    src_cols = first_page[:, None] + cols[None, :]
    in_slice = cols[None, :] < used[:, None]
    table = common.block_table
    gathered = table[owner[:, None], src_cols.clamp_max(table.shape[1] - 1)]
    sliced = torch.where(in_slice, gathered, torch.zeros((), dtype=table.dtype, device=device))
    if buffer is None:
        block_table = sliced
        slot_mapping = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    else:
        block_table = buffer("split_kv.block_table", (num_v, width), table.dtype)
        block_table.copy_(sliced)
        slot_mapping = buffer("split_kv.slot_mapping", (num_rows,), torch.int64)
        slot_mapping.fill_(-1)

    expanded = CommonAttentionMetadata(
        query_start_loc=out["query_start_loc"],
        seq_lens=out["seq_lens"],
        block_table=block_table,
        slot_mapping=slot_mapping,
        num_actual_tokens=rows,
        max_query_len=common.max_query_len,
        max_seq_len=common.max_seq_len,
        query_start_loc_cpu=torch.from_numpy(host["query_start_loc"]),
        seq_lens_cpu=torch.from_numpy(host["seq_lens"]),
        block_size=bs,
    )
    return DecodeSlices(
        expanded, out["query_rows"], out["merge_indptr"], int(cut.sum()), keys_per_split
    )


def merge_by_lse(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    merge_indptr: torch.Tensor,
    output: torch.Tensor,
    sinks: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
) -> None:
    """Merge partial attention results over disjoint key ranges into ``output``.

    output[t] = sum_k exp(lse_k - M) * partial_out[k] / Z over the partial rows
    k in [merge_indptr[t], merge_indptr[t + 1]), with M the largest LSE (and sink)
    and Z = sum_k exp(lse_k - M) + exp(sink - M): the layer's sinks count once per
    row, however many slices it has. A row with no partial rows gets zeros.

    partial_out: [R, H, Dv] (any float dtype); partial_lse: [R, H] float32, natural log
    (-inf: no key, and then that partial row is not read: it may be unwritten);
    merge_indptr: [T + 1] int32 (non-decreasing, merge_indptr[T] <= R);
    output: [T, H, Dv]; sinks: [H] float32 logits or None.

    use_triton: None picks the Triton kernel for CUDA tensors (when triton is installed)
    and the torch path otherwise; True forces it (CPU tensors need TRITON_INTERPRET=1).
    """
    rows, heads, head_size_v = output.shape
    if partial_out.dim() != 3 or tuple(partial_out.shape[1:]) != (heads, head_size_v):
        raise ValueError(
            f"partial_out: expected [R, {heads}, {head_size_v}], got {tuple(partial_out.shape)}"
        )
    if tuple(partial_lse.shape) != (partial_out.shape[0], heads) or (
        partial_lse.dtype != torch.float32
    ):
        raise ValueError(
            f"partial_lse: expected float32 [{partial_out.shape[0]}, {heads}], got "
            f"{partial_lse.dtype} {tuple(partial_lse.shape)}"
        )
    if tuple(merge_indptr.shape) != (rows + 1,) or merge_indptr.dtype != torch.int32:
        raise ValueError(
            f"merge_indptr: expected int32 [{rows + 1}], got {merge_indptr.dtype} "
            f"{tuple(merge_indptr.shape)}"
        )
    if sinks is not None and (tuple(sinks.shape) != (heads,) or sinks.dtype != torch.float32):
        raise ValueError(
            f"sinks: expected float32 [{heads}], got {sinks.dtype} {tuple(sinks.shape)}"
        )
    if use_triton is None:
        use_triton = output.is_cuda and importlib.util.find_spec("triton") is not None
    if use_triton:
        from pagedkv.toolkit.triton_lse_merge import plan_merge_by_lse

        plan_merge_by_lse(partial_out, partial_lse, merge_indptr.contiguous(), output, sinks)()
        return
    _merge_by_lse_torch(partial_out, partial_lse, merge_indptr, output, sinks)


def _merge_by_lse_torch(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    merge_indptr: torch.Tensor,
    output: torch.Tensor,
    sinks: torch.Tensor | None,
) -> None:
    """The portable path of merge_by_lse (reads merge_indptr on the host)."""
    rows, heads, _ = output.shape
    counts = merge_indptr.long().diff()
    owner = torch.repeat_interleave(torch.arange(rows, device=output.device), counts)
    lse = partial_lse[: owner.shape[0]]
    neg_inf = torch.full((rows, heads), float("-inf"), device=output.device)
    m = neg_inf.scatter_reduce(0, owner[:, None].expand(-1, heads), lse, "amax")
    if sinks is not None:
        m = torch.maximum(m, sinks[None, :])
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    weight = torch.exp(lse - m[owner])
    denom = torch.zeros_like(m).index_add_(0, owner, weight)
    if sinks is not None:
        denom += torch.exp(sinks[None, :] - m)
    parts = partial_out[: owner.shape[0]].float()
    parts = torch.where(weight[..., None] > 0, weight[..., None] * parts, 0.0)
    merged = torch.zeros(output.shape, device=output.device).index_add_(0, owner, parts)
    output.copy_(merged / torch.where(denom == 0, torch.ones_like(denom), denom)[..., None])


def attend_sliced(
    impl: LSEAttention,
    slices: DecodeSlices,
    metadata: Any,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attend ``slices.common`` once through ``impl.attend_with_lse`` (``metadata`` is the
    backend's metadata of that expanded step) and merge each original row's slices into
    ``output`` [T, num_heads, head_size_v]; ``sinks`` [num_heads] float32 count once."""
    expanded_query = query.index_select(0, slices.query_rows)
    rows = expanded_query.shape[0]
    partial = output.new_empty(rows, *output.shape[1:])
    lse = torch.empty(rows, output.shape[1], dtype=torch.float32, device=output.device)
    partial, lse = impl.attend_with_lse(expanded_query, kv_cache, metadata, partial, lse)
    merge_by_lse(partial, lse, slices.merge_indptr, output, sinks)


@dataclass(frozen=True)
class SplitStep:
    """One step as the combinator runs it: the backend's metadata of the step itself,
    or of its expanded form with the slices to merge."""

    common: CommonAttentionMetadata
    metadata: Any
    slices: DecodeSlices | None


class SplitKVCombinator:
    """Split-KV at the pagedkv level for any backend whose impl implements
    ``attend_with_lse``: long decode rows are cut into slices of their page tables
    (``plan_decode_slices``), the backend runs once over the expanded step, and the
    slices are merged by log-sum-exp (``merge_by_lse``; sinks are applied there, once).

    ``policy`` decides how many slices (``SplitPolicy.choose`` with one program per
    request and KV head, and the block size as granule); ``num_splits`` forces a count.
    Eager steps only: the expanded step's size follows its lengths, so a backend that
    captures CUDA graphs plans slices inside its own builder with a ``SliceCapacity``.
    The step's K/V must already be in the cache (the impl's ``write_kv``).
    """

    def __init__(
        self,
        builder: AttentionMetadataBuilder[Any],
        impl: AttentionImpl[Any],
        policy: SplitPolicy,
        *,
        num_splits: int | None = None,
    ) -> None:
        problem = split_problem(impl.spec)
        if problem is not None:
            raise UnsupportedError(f"split-KV combinator cannot split this layer: {problem}")
        if not callable(getattr(impl, "attend_with_lse", None)):
            raise UnsupportedError(
                f"split-KV combinator: {type(impl).__name__} has no attend_with_lse (the "
                "log-sum-exp of each row is what merges the slices)"
            )
        self.builder, self.impl, self.policy, self.forced = builder, impl, policy, num_splits

    def build(self, common: CommonAttentionMetadata) -> SplitStep:
        if self.builder.graph_bounds is not None:
            raise UnsupportedError(
                "split-KV combinator: the builder holds a CUDA-graph reservation; the "
                "combinator's expanded step changes size with the lengths (eager steps only)"
            )
        spec = self.impl.spec
        choice = self.policy.choose(
            common.num_reqs * spec.num_kv_heads,
            common.max_query_len,
            common.max_seq_len,
            num_sms(common.device),
            forced=self.forced,
            granule=spec.block_size,
        )
        if choice.num_splits > 1:
            slices = plan_decode_slices(common, choice.keys_per_split)
            if slices.num_cut:
                return SplitStep(common, self.builder.build(slices.common), slices)
        return SplitStep(common, self.builder.build(common), None)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        step: SplitStep,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``query`` [T, num_heads, head_size] over the cache; returns
        ``output`` [T, num_heads, head_size_v] (rows past num_actual_tokens: zeros when
        sliced, else as the backend leaves them)."""
        self.impl.check_forward_args(query, None, None, step.common.num_tokens, output)
        self.impl.check_cache(kv_cache, query.device)
        out = self.impl.new_output(query, output)
        if step.slices is None:
            self.impl.attend(query, kv_cache, step.metadata, out)
        else:
            sinks = None if self.impl.sinks is None else self.impl.sinks.to(query.device)
            attend_sliced(self.impl, step.slices, step.metadata, query, kv_cache, out, sinks)  # type: ignore[arg-type]
        return out
