"""Worker: a tensor-parallel rank other than 0, executing rank 0's step plans."""

from __future__ import annotations

from pagedkv.serving.config import EngineConfig
from pagedkv.serving.errors import EngineConfigError
from pagedkv.serving.model import PagedModel
from pagedkv.serving.parallel import TensorParallel
from pagedkv.serving.runner import ModelRunner


class Worker:
    """Holds this rank's share of the model's KV cache and runs every step rank 0's
    Engine plans, until the Engine closes. ``model`` is this rank's shard (e.g.
    ``HFModel(model, tp=tp)``); ``config`` the Engine's (sizes must match)."""

    def __init__(self, model: PagedModel, config: EngineConfig, tp: TensorParallel) -> None:
        if tp.is_driver:
            raise EngineConfigError("rank 0 runs the Engine, not a Worker")
        self.tp = tp
        self.runner = ModelRunner(model, config, tp)
        self.num_steps = 0

    def run(self) -> None:
        """Execute plans as they come; returns when the Engine closes."""
        while (plan := self.tp.broadcast_plan(None)) is not None:
            self.runner.execute(plan)  # the logits are rank 0's to sample
            self.num_steps += 1
