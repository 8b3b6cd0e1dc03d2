"""Tensor parallelism: attention heads sharded across ranks, one KV pool size for all.

Each of ``tp`` ranks holds ``num_heads / tp`` query heads and ``num_kv_heads / tp`` KV
heads — or, when ``tp > num_kv_heads``, one KV head replicated on ``tp /
num_kv_heads`` ranks — in its own cache, in its backend's layout. MLA layers keep
their single latent on every rank and shard only the query heads. Every rank runs
the same steps over the same block tables, so their pools must have the same number
of blocks: ``agree_num_blocks`` takes the minimum over ranks (an all-reduce, as vLLM
does), because the smallest rank's memory bounds everyone's.

Communication goes through ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass

import torch
from pagedkv.errors import SpecError
from pagedkv.spec import AttentionSpec


@dataclass(frozen=True)
class HeadShard:
    """One rank's part of a layer."""

    spec: AttentionSpec  # the rank's layer: its heads only
    rank: int
    tp_size: int
    query_heads: range  # of the full layer's query heads
    kv_heads: range  # of the full layer's KV heads (one head when replicated)

    def query_slice(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's query heads of a full ``[..., num_heads, ...]`` tensor."""
        return t.narrow(dim, self.query_heads.start, len(self.query_heads))

    def kv_slice(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's KV heads of a full ``[..., num_kv_heads, ...]`` tensor."""
        return t.narrow(dim, self.kv_heads.start, len(self.kv_heads))


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank stores: an even share, or one replicated head when there are
    more ranks than heads (raises SpecError when neither divides)."""
    if tp_size < 1:
        raise SpecError(f"tp_size must be >= 1, got {tp_size}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise SpecError(
                f"num_kv_heads {num_kv_heads} is not divisible by tp_size {tp_size}: every "
                "rank needs the same number of KV heads"
            )
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads:
        raise SpecError(
            f"tp_size {tp_size} is not a multiple of num_kv_heads {num_kv_heads}: each KV "
            "head must be replicated on the same number of ranks"
        )
    return 1


def shard_problems(spec: AttentionSpec, tp_size: int) -> list[str]:
    """Why ``spec`` cannot be split over ``tp_size`` ranks (empty: it can)."""
    out = []
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        return [f"tp_size must be a positive int, got {tp_size!r}"]
    if spec.num_heads % tp_size:
        out.append(
            f"num_heads {spec.num_heads} is not divisible by tp_size {tp_size}: every rank "
            "needs the same number of query heads"
        )
    if not spec.is_mla:
        try:
            kv_heads_per_rank(spec.num_kv_heads, tp_size)
        except SpecError as exc:
            out.append(str(exc))
    return out


def shard_spec(spec: AttentionSpec, tp_size: int, rank: int) -> HeadShard:
    """Rank ``rank``'s part of ``spec`` (raises SpecError naming why it cannot be split)."""
    problems = shard_problems(spec, tp_size)
    if problems:
        raise SpecError("cannot shard this layer: " + "; ".join(problems))
    if not 0 <= rank < tp_size:
        raise SpecError(f"rank {rank} is outside [0, {tp_size})")
    hq = spec.num_heads // tp_size
    query_heads = range(rank * hq, (rank + 1) * hq)
    if spec.is_mla:
        kv_heads = range(0, 1)  # the latent is replicated
    elif spec.num_kv_heads >= tp_size:
        hkv = kv_heads_per_rank(spec.num_kv_heads, tp_size)
        kv_heads = range(rank * hkv, (rank + 1) * hkv)
    else:
        first = query_heads.start // spec.num_queries_per_kv
        kv_heads = range(first, first + 1)
    changes: dict[str, object] = {"num_heads": hq, "num_kv_heads": len(kv_heads)}
    if spec.alibi_slopes is not None:
        changes["alibi_slopes"] = spec.alibi_slopes[query_heads.start : query_heads.stop]
    local = dataclasses.replace(spec, **changes)  # scale and head sizes unchanged
    return HeadShard(local, rank, tp_size, query_heads, kv_heads)


def free_port() -> int:
    """A TCP port free on this host now, for ``MASTER_PORT`` of a local process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agree_num_blocks(
    local_num_blocks: int, *, group: torch.distributed.ProcessGroup | None = None
) -> int:
    """The pool size every rank can hold: the minimum of each rank's
    ``local_num_blocks`` (e.g. free memory / bytes per block), by an all-reduce."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return local_num_blocks
    backend = dist.get_backend(group)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    value = torch.tensor([local_num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return int(value.item())


def same_on_every_rank(
    tensor: torch.Tensor, *, group: torch.distributed.ProcessGroup | None = None
) -> bool:
    """Whether ``tensor`` (any dtype, same shape everywhere) holds the same values on every
    rank: compares a checksum of its bytes by all-reduce MIN and MAX."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    data = tensor.detach().contiguous().view(-1).view(torch.uint8).to(torch.int64)
    weights = torch.arange(1, data.numel() + 1, dtype=torch.int64, device=data.device)
    digest = torch.stack(
        [(data * weights).sum(), data.sum(), torch.tensor(data.numel(), device=data.device)]
    )
    digest = digest.cuda() if dist.get_backend(group) == "nccl" else digest.cpu()
    low, high = digest.clone(), digest.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(low, high))
