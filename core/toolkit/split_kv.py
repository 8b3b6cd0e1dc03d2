"""Split-KV (flash-decoding): when few query tiles would leave SMs idle, several programs
share one sequence's keys and a reduction merges their partial results.

One rule for every backend; each backend keeps its own ``SplitPolicy`` numbers (its
programs differ in size), and every backend names the forcing option ``num_splits``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from pagedkv.intmath import cdiv

# Without a GPU (Triton's interpreter, Pallas interpret mode) there is no SM count; this
# stands in for it, small enough that only few-sequence, long-context batches split,
# so CPU tests still cover the split path.
CPU_SM_COUNT = 4


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


@dataclass(frozen=True)
class SplitPolicy:
    """When and how far to split.

    A batch splits when its longest query has at most ``max_query_len`` tokens (None:
    any) and its grid has fewer than ``split_below_programs_per_sm`` programs per SM;
    it then gets enough splits for ``target_programs_per_sm``, each split keeping at
    least ``min_keys_per_split`` keys, at most ``max_splits``.
    """

    max_query_len: int | None = 8
    split_below_programs_per_sm: float = 2.0
    target_programs_per_sm: float = 4.0
    min_keys_per_split: int = 512
    max_splits: int = 64

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
        if splits == 1 or max_seq_len <= 0:
            return SplitChoice(1, max(granule, cdiv(max(max_seq_len, 1), granule) * granule))
        keys = cdiv(cdiv(max_seq_len, splits), granule) * granule
        # no split is empty for the longest sequence
        return SplitChoice(cdiv(max_seq_len, keys), keys)
