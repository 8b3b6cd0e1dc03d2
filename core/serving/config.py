"""EngineConfig: every size of the serving layer, given once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.intmath import cdiv
from pagedkv.serving.errors import EngineConfigError

if TYPE_CHECKING:
    from pagedkv.backend import AttentionBackend


@dataclass(frozen=True)
class EngineConfig:
    """The engine's sizes and switches. ``block_size`` and ``max_model_len`` are given
    here only; the KV manager, the step assembler and every layer's spec take them
    from this object.

    backend: a config string (``"triton,torch"``; None: ``$PAGEDKV_BACKEND`` or auto),
        resolved per distinct layer spec, or a configured backend object.
    num_blocks: physical blocks per layer, block 0 included (the null block). None:
        enough for ``max_num_seqs`` sequences of ``max_model_len`` tokens.
    max_num_batched_tokens: the token budget of one step (decodes + prefill chunks).
    cuda_graph: decode steps replay CUDA graphs. None: on when the device is CUDA and
        every layer's backend supports them; True: required (error if not possible).
    cuda_graph_batch_sizes: the decode batch sizes captured (a step runs in the
        smallest one that holds it). Empty: powers of two up to ``max_num_seqs``.
    block_order_seed: shuffle the free-block order with this seed (tests: physical
        blocks far from logical order). None: the pool's own order.
    async_scheduling: schedule and launch step N+1 before step N's sampled tokens
        reach the host (they are fed to step N+1 on the device), so the host's work
        of a step overlaps the device's. The same tokens as without it; a sequence
        that samples a stop token has run one step more, whose token is dropped.
    """

    backend: str | AttentionBackend | None = None
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None
    max_model_len: int = 1024
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    cuda_graph: bool | None = None
    cuda_graph_batch_sizes: tuple[int, ...] = field(default=())
    block_order_seed: int | None = None
    hash_seed: str | None = None
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "cuda_graph_batch_sizes", tuple(self.cuda_graph_batch_sizes))
        problems = []
        for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be an int >= 1, got {value!r}")
        if self.num_blocks is not None and (
            not isinstance(self.num_blocks, int) or self.num_blocks < 2
        ):
            problems.append(
                f"num_blocks must be an int >= 2 (block 0 is the null block) or None, "
                f"got {self.num_blocks!r}"
            )
        bad_sizes = [s for s in self.cuda_graph_batch_sizes if not isinstance(s, int) or s < 1]
        if bad_sizes:
            problems.append(f"cuda_graph_batch_sizes must be ints >= 1, got {bad_sizes}")
        if problems:
            raise EngineConfigError("invalid EngineConfig: " + "; ".join(problems))
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise EngineConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_model_len "
                f"({self.max_model_len}) needs enable_chunked_prefill=True: a long prompt "
                "could never be scheduled whole"
            )

    @property
    def max_blocks_per_seq(self) -> int:
        return cdiv(self.max_model_len, self.block_size)

    @property
    def resolved_num_blocks(self) -> int:
        """num_blocks, or enough for every sequence at max_model_len (plus the null block)."""
        if self.num_blocks is not None:
            return self.num_blocks
        return self.max_num_seqs * self.max_blocks_per_seq + 1

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes to capture, ascending, capped at max_num_seqs."""
        sizes = self.cuda_graph_batch_sizes
        if not sizes:
            sizes = tuple(1 << i for i in range(self.max_num_seqs.bit_length()))
            if sizes[-1] != self.max_num_seqs:
                sizes += (self.max_num_seqs,)
        return tuple(sorted({min(s, self.max_num_seqs) for s in sizes}))
