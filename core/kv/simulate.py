"""Replay a request trace through KV allocators and measure how much memory holds tokens.

Model (iteration-level scheduling, as in Orca and vLLM): every request arrives at
time 0 and waits in a FCFS queue. Each step first admits queued requests in order
until one does not fit (its prompt is prefilled in that step), then every running
request writes one more token; a request leaves when it holds prompt + output
tokens. An allocator that cannot grow a request preempts the newest running one,
which later restarts from scratch (recompute, as vLLM does).

Memory is classified per step, in token slots of a fixed pool:
- tokens:    slots holding a token's K/V (the effective utilisation);
- reserved:  allocated slots a later token of the same request will fill;
- internal:  allocated slots that will never be filled (rounding, over-reservation);
- free:      slots no request holds. While a request waits for memory, free space
             is exactly the space that could not take it: external fragmentation
             (plus, for paged pools, the null block and the pool's remainder).
Averages are over the steps in which the head of the queue was refused for lack of
memory (the regime where utilisation decides throughput).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pagedkv import textutil
from pagedkv.errors import KVCacheUsageError
from pagedkv.intmath import cdiv
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.request import Request
from pagedkv.kv.trace import TraceRequest

# -- allocators -----------------------------------------------------------------------------


class Allocator(Protocol):
    name: str
    pool_tokens: int  # token slots of the whole pool

    def admit(self, rid: int, length: int, final_len: int) -> bool:
        """Hold ``length`` tokens of a new request (``final_len`` when done); False: no room."""

    def grow(self, rid: int, length: int) -> bool:
        """Make the request hold ``length`` tokens; False, changing nothing: no room."""

    def release(self, rid: int) -> None: ...

    def allocated(self, rid: int) -> int:
        """Token slots the request holds."""


class ContiguousAllocator:
    """One contiguous range per request, placed first-fit in a linear address space.

    ``policy`` sizes the range at admission:
    - "max":    max_model_len slots (Orca (Max): the output length is unknown);
    - "pow2":   the final length rounded up to a power of two (Orca (Pow2));
    - "oracle": the final length rounded up to ``granule`` (Orca (Oracle) at granule 1);
    - "grow":   the current length rounded up to ``granule``; when a request outgrows
                its range it is extended in place if the next range is far enough,
                else moved (copied) to the first hole that fits, else it fails.
    """

    POLICIES = ("max", "pow2", "oracle", "grow")

    def __init__(
        self, name: str, pool_tokens: int, policy: str, max_model_len: int, granule: int = 1
    ) -> None:
        if policy not in self.POLICIES:
            raise KVCacheUsageError(f"unknown policy {policy!r}: expected one of {self.POLICIES}")
        self.name = name
        self.pool_tokens = pool_tokens
        self.policy = policy
        self.max_model_len = max_model_len
        self.granule = granule
        self._starts: list[int] = []  # sorted start offsets of the ranges
        self._range: dict[int, tuple[int, int]] = {}  # rid -> (start, size)
        self._rid_at: dict[int, int] = {}  # start -> rid
        self.num_moves = 0

    def _round(self, n: int) -> int:
        return cdiv(n, self.granule) * self.granule

    def _size_for(self, length: int, final_len: int) -> int:
        if self.policy == "max":
            return self.max_model_len
        if self.policy == "pow2":
            return min(1 << (final_len - 1).bit_length(), self._round(self.max_model_len))
        if self.policy == "oracle":
            return self._round(final_len)
        return self._round(length)

    def _first_fit(self, size: int) -> int | None:
        prev_end = 0
        for start in self._starts:
            if start - prev_end >= size:
                return prev_end
            prev_end = start + self._range[self._rid_at[start]][1]
        return prev_end if self.pool_tokens - prev_end >= size else None

    def _place(self, rid: int, start: int, size: int) -> None:
        bisect.insort(self._starts, start)
        self._range[rid] = (start, size)
        self._rid_at[start] = rid

    def admit(self, rid: int, length: int, final_len: int) -> bool:
        size = self._size_for(length, final_len)
        start = self._first_fit(size)
        if start is None:
            return False
        self._place(rid, start, size)
        return True

    def grow(self, rid: int, length: int) -> bool:
        start, size = self._range[rid]
        if length <= size:
            return True
        new_size = self._round(length)
        i = bisect.bisect_right(self._starts, start)
        limit = self._starts[i] if i < len(self._starts) else self.pool_tokens
        if start + new_size <= limit:
            self._range[rid] = (start, new_size)
            return True
        self.release(rid)
        new_start = self._first_fit(new_size)
        if new_start is None:
            self._place(rid, start, size)
            return False
        self._place(rid, new_start, new_size)
        self.num_moves += 1
        return True

    def release(self, rid: int) -> None:
        start, _ = self._range.pop(rid)
        del self._rid_at[start]
        self._starts.pop(bisect.bisect_left(self._starts, start))

    def allocated(self, rid: int) -> int:
        return self._range[rid][1]


class PagedAllocator:
    """vLLM-style paging through KVCacheManager (and its BlockPool) at one block size."""

    def __init__(self, name: str, pool_tokens: int, block_size: int, max_model_len: int) -> None:
        self.name = name
        self.pool_tokens = pool_tokens
        self.block_size = block_size
        self.manager = KVCacheManager(
            pool_tokens // block_size, block_size, max_model_len, enable_prefix_caching=False
        )
        self._requests: dict[int, Request] = {}
        self.num_moves = 0

    def admit(self, rid: int, length: int, final_len: int) -> bool:
        # token ids only matter to prefix caching, which is off here
        request = Request(str(rid), [0] * length)
        if self.manager.allocate_slots(request, length) is None:
            return False
        self.manager.mark_computed(request, length)
        self._requests[rid] = request
        return True

    def grow(self, rid: int, length: int) -> bool:
        request = self._requests[rid]
        if request.num_tokens < length:
            request.append_output_token_ids([0] * (length - request.num_tokens))
        new = length - request.num_computed_tokens
        if self.manager.allocate_slots(request, new) is None:
            return False
        self.manager.mark_computed(request, new)
        return True

    def release(self, rid: int) -> None:
        self.manager.free(self._requests.pop(rid))

    def allocated(self, rid: int) -> int:
        return len(self.manager.req_to_blocks[str(rid)]) * self.block_size


# -- the replay -------------------------------------------------------------------------------


@dataclass(eq=False)
class _Running:
    rid: int
    prompt_len: int
    final_len: int
    generated: int = 0  # output tokens so far (survives preemption: recomputed)
    length: int = 0  # tokens held now
    active: bool = False  # running (not queued)


@dataclass
class SimResult:
    """One allocator's averages over the memory-bound steps; fractions of the pool."""

    allocator: str
    tokens: float
    reserved: float
    internal: float
    free: float
    mean_batch: float  # running requests per memory-bound step
    max_batch: int
    num_steps: int  # steps to finish the whole trace
    num_bound_steps: int  # steps where the queue head was refused for memory
    num_preemptions: int
    num_moves: int
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def waste(self) -> float:
        return 1.0 - self.tokens


def replay(alloc: Allocator, trace: Sequence[TraceRequest], max_num_seqs: int = 256) -> SimResult:
    """Run ``trace`` through ``alloc`` to completion; see the module docstring."""
    queue: deque[_Running] = deque(
        _Running(i, r.prompt_len, r.prompt_len + r.output_len) for i, r in enumerate(trace)
    )
    running: list[_Running] = []  # admission order; the newest is preempted first
    sums = {"tokens": 0.0, "reserved": 0.0, "internal": 0.0, "free": 0.0, "batch": 0.0}
    num_steps = num_bound = num_preempt = max_batch = 0
    pool = alloc.pool_tokens
    while queue or running:
        refused = False
        while queue and len(running) < max_num_seqs:
            r = queue[0]
            length = r.prompt_len + r.generated
            if not alloc.admit(r.rid, length, r.final_len):
                refused = True
                break
            queue.popleft()
            r.length = length
            r.active = True
            running.append(r)
        if not running:
            raise KVCacheUsageError(
                f"{alloc.name}: request {queue[0].rid} ({queue[0].final_len} tokens) can never "
                f"fit the pool of {pool} token slots"
            )
        if refused:
            num_bound += 1
            held = tokens = future = 0
            for r in running:
                size = alloc.allocated(r.rid)
                held += size
                tokens += r.length
                future += min(size, r.final_len) - r.length
            sums["tokens"] += tokens / pool
            sums["reserved"] += future / pool
            sums["internal"] += (held - tokens - future) / pool
            sums["free"] += (pool - held) / pool
            sums["batch"] += len(running)
        max_batch = max(max_batch, len(running))
        done = False
        for r in list(running):
            if not r.active:
                continue  # preempted earlier in this step
            while not alloc.grow(r.rid, r.length + 1):
                victim = running.pop()
                while not victim.active:  # finished earlier in this step
                    victim = running.pop()
                alloc.release(victim.rid)
                victim.active = False
                queue.appendleft(victim)
                num_preempt += 1
                if victim is r:
                    if not running:  # alone and still cannot grow: it never will
                        raise KVCacheUsageError(
                            f"{alloc.name}: a request of {r.length + 1} tokens does not fit "
                            f"the pool of {pool} token slots on its own"
                        )
                    break
            else:
                r.length += 1
                r.generated += 1
                if r.length >= r.final_len:
                    alloc.release(r.rid)
                    r.active = False
                    done = True
        if done:
            running = [r for r in running if r.active]
        num_steps += 1
    n = max(num_bound, 1)
    return SimResult(
        allocator=alloc.name,
        tokens=sums["tokens"] / n,
        reserved=sums["reserved"] / n,
        internal=sums["internal"] / n,
        free=sums["free"] / n,
        mean_batch=sums["batch"] / n,
        max_batch=max_batch,
        num_steps=num_steps,
        num_bound_steps=num_bound,
        num_preemptions=num_preempt,
        num_moves=getattr(alloc, "num_moves", 0),
    )


def default_allocators(
    pool_tokens: int,
    max_model_len: int,
    *,
    granule: int = 64,
    block_sizes: Sequence[int] = (8, 16, 32, 128),
) -> list[Allocator]:
    """The contiguous baselines and the paged pool at each block size."""
    allocators: list[Allocator] = [
        ContiguousAllocator("contiguous max-len", pool_tokens, "max", max_model_len),
        ContiguousAllocator("contiguous pow2", pool_tokens, "pow2", max_model_len),
        ContiguousAllocator("contiguous oracle", pool_tokens, "oracle", max_model_len),
        ContiguousAllocator(
            f"first-fit grow g={granule}", pool_tokens, "grow", max_model_len, granule
        ),
    ]
    for b in block_sizes:
        allocators.append(PagedAllocator(f"paged B={b}", pool_tokens, b, max_model_len))
    return allocators


def simulate(
    trace: Sequence[TraceRequest],
    pool_tokens: int,
    max_model_len: int,
    *,
    granule: int = 64,
    block_sizes: Sequence[int] = (8, 16, 32, 128),
    max_num_seqs: int = 256,
) -> list[SimResult]:
    """Replay ``trace`` through every default allocator."""
    too_long = [r for r in trace if r.total_len > max_model_len]
    if too_long:
        raise KVCacheUsageError(
            f"{len(too_long)} trace requests exceed max_model_len {max_model_len} "
            f"(e.g. {too_long[0].total_len} tokens)"
        )
    if pool_tokens < max_model_len:
        raise KVCacheUsageError(
            f"pool of {pool_tokens} token slots cannot hold one max_model_len "
            f"({max_model_len}) request"
        )
    allocators = default_allocators(
        pool_tokens, max_model_len, granule=granule, block_sizes=block_sizes
    )
    return [replay(a, trace, max_num_seqs) for a in allocators]


# -- output -------------------------------------------------------------------------------------

TABLE_HEADERS = [
    "allocator",
    "tokens %",
    "reserved %",
    "internal %",
    "free/ext %",
    "waste %",
    "mean batch",
    "steps",
    "preempt",
    "moves",
]


def table_rows(results: Sequence[SimResult]) -> list[list[str]]:
    return [
        [
            r.allocator,
            f"{100 * r.tokens:.1f}",
            f"{100 * r.reserved:.1f}",
            f"{100 * r.internal:.1f}",
            f"{100 * r.free:.1f}",
            f"{100 * r.waste:.1f}",
            f"{r.mean_batch:.1f}",
            str(r.num_steps),
            str(r.num_preemptions),
            str(r.num_moves),
        ]
        for r in results
    ]


def plot(results: Sequence[SimResult], path: str | Path, title: str = "") -> Path:
    """A stacked bar per allocator (tokens / reserved / internal / free), as PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KVCacheUsageError(
            "the simulator plot needs matplotlib: pip install 'pagedkv[dev]' (or matplotlib), "
            "or pass --no-plot"
        ) from None
    names = [r.allocator for r in results][::-1]
    parts = [
        ("tokens", "#10b981", [r.tokens for r in results][::-1]),
        ("reserved (future tokens)", "#ef4444", [r.reserved for r in results][::-1]),
        ("internal fragmentation", "#f59e0b", [r.internal for r in results][::-1]),
        ("free: external fragmentation", "#3b82f6", [r.free for r in results][::-1]),
    ]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(results) + 1.8))
    left = [0.0] * len(results)
    for label, color, values in parts:
        pct = [100 * v for v in values]
        ax.barh(names, pct, left=left, color=color, label=label, zorder=2)
        left = [a + b for a, b in zip(left, pct, strict=True)]
    for i, r in enumerate(results[::-1]):
        ax.text(1, i, f"{100 * r.tokens:.1f}%", va="center", fontsize=8, color="white", zorder=3)
    # the paper's token-state share for contiguous systems, drawn over the bars
    ax.axvline(20.4, color="black", ls=":", lw=1, zorder=4)
    ax.axvline(38.2, color="black", ls=":", lw=1, zorder=4, label="paper, contiguous: 20.4-38.2%")
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of the KV pool (mean over memory-bound steps)")
    ax.set_title(title or "KV-cache use by allocator")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown_table(results: Sequence[SimResult]) -> str:
    return textutil.markdown_table(TABLE_HEADERS, table_rows(results)) + "\n"
