"""Tensor-parallel serving: one process per rank, rank 0 decides every step.

Rank 0 runs the ``Engine`` (scheduler, KV manager, sampler); every other rank runs a
``Worker``. Each step rank 0 broadcasts its ``StepPlan`` (plain values: block ids,
token ids, copies, rows to drop) to the workers; then every rank executes the same
plan with its share of the heads, the model's row-parallel projections all-reducing
their outputs. The workers never schedule or sample, so nothing they do can make
their block tables differ from rank 0's: the step is decided once (docs/serving.md
says why this and not a replicated scheduler).

Communication is ``torch.distributed``: the model's all-reduces on the device group
(NCCL on GPUs, gloo on CPUs), plans on a gloo group of their own (host objects, like
vLLM's CPU group). ``run_tensor_parallel`` spawns the ranks on one host.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pagedkv.errors import PagedKVError
from pagedkv.serving.plan import StepPlan


class RankDivergenceError(PagedKVError, RuntimeError):
    """Tensor-parallel ranks were about to run different steps (block tables, slot
    mappings or sequence lengths differ between ranks)."""


@dataclass
class TensorParallel:
    """One rank's view of its tensor-parallel group.

    group: the device group the model's all-reduces use (None: the default group);
    control_group: a gloo group for the step plans. check_every_step: before each
    forward, compare the step's block table, slot mapping, query starts and sequence
    lengths across ranks (``pagedkv.distributed.same_on_every_rank``; a few small
    all-reduces per step, for tests and debugging); ``num_checked_steps`` counts them.
    """

    rank: int
    size: int
    group: Any = None
    control_group: Any = None
    check_every_step: bool = False
    num_checked_steps: int = field(default=0, init=False)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def broadcast_plan(self, plan: StepPlan | None) -> StepPlan | None:
        """Rank 0 sends ``plan`` (None: stop); every other rank returns what it sent."""
        import torch.distributed as dist

        box = [plan if self.is_driver else None]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def check_same_step(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise RankDivergenceError naming the tensors that differ between ranks."""
        from pagedkv.distributed import same_on_every_rank

        differ = [n for n, t in tensors.items() if not same_on_every_rank(t, group=self.group)]
        if differ:
            raise RankDivergenceError(
                f"rank {self.rank} of {self.size}: {', '.join(differ)} differ between ranks"
            )
        self.num_checked_steps += 1


def init_tensor_parallel(
    rank: int, size: int, device_type: str, port: int, *, check_every_step: bool = False
) -> TensorParallel:
    """Join a process group of ``size`` ranks on this host (NCCL with one GPU per rank
    when ``device_type`` is cuda, else gloo) and make the plans' gloo group."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size)
    control = dist.new_group(backend="gloo") if cuda else None
    return TensorParallel(rank, size, None, control, check_every_step)


def run_tensor_parallel(
    fn: Callable[..., Any],
    size: int,
    device_type: str,
    *args: Any,
    check_every_step: bool = False,
) -> Any:
    """Run ``fn(tp, *args)`` in ``size`` spawned processes, one per rank; returns rank
    0's result. ``fn`` and ``args`` must be picklable (a module-level function). A
    rank that raises stops the others; a PagedKVError it raised is raised here as
    it was (the lowest rank's), anything else as torch's ProcessRaisedException."""
    import torch.multiprocessing as mp
    from pagedkv.distributed import free_port

    if device_type == "cuda" and torch.cuda.device_count() < size:
        raise PagedKVError(
            f"tensor parallelism over {size} ranks on cuda needs {size} GPUs, this host has "
            f"{torch.cuda.device_count()}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pickle")
        try:
            mp.spawn(
                _rank_main,
                args=(fn, size, device_type, free_port(), check_every_step, out, args),
                nprocs=size,
                join=True,
            )
        except mp.ProcessRaisedException:
            for rank in range(size):
                path = f"{out}.error{rank}"
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        raise pickle.load(f) from None
            raise
        with open(out, "rb") as f:
            return pickle.load(f)


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    size: int,
    device_type: str,
    port: int,
    check_every_step: bool,
    out: str,
    args: tuple[Any, ...],
) -> None:
    import torch.distributed as dist

    tp = init_tensor_parallel(rank, size, device_type, port, check_every_step=check_every_step)
    try:
        result = fn(tp, *args)
        if tp.is_driver:
            with open(out, "wb") as f:
                pickle.dump(result, f)
        # no rank tears its group down while another still talks to it: a gloo rank
        # whose peer had exited aborted in its background thread (SIGABRT, seen once in
        # CI). A rank that raised skips this; the spawn then stops the waiting ones.
        dist.barrier()
    except PagedKVError as exc:  # relayed to the caller as itself
        with open(f"{out}.error{rank}", "wb") as f:
            pickle.dump(exc, f)
        raise
    finally:
        dist.destroy_process_group()
    # a rank that got here is done: it leaves without the interpreter's shutdown, whose
    # C++ destructors can meet a gloo thread still running (rank 1 died of SIGABRT,
    # "terminate called without an active exception", once more in CI after its output
    # was complete, with the barrier above in place). Its output is flushed first.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
