"""A reference serving layer built only from pagedkv's public parts (docs/serving.md).

- ``Engine(model, EngineConfig(...))``: ``add_request`` / ``step`` / ``abort`` /
  ``generate``; outputs per request and sample.
- ``Scheduler``: token budget, decodes first, chunked prefill, prefix-cache admission,
  preemption by recompute, n > 1 samples by fork + copy-on-write.
- ``ModelKVCache``: every layer's cache from one spec per layer, block copies applied
  to all layers; ``StepAttention``: the per-step view a model's attention calls.
- ``build_step_inputs``, ``sample``, ``DecodeGraphs`` (CUDA-graph decode).
- Tensor parallelism: ``Engine(..., tp=)`` on rank 0, ``Worker`` on the others,
  ``run_tensor_parallel`` to spawn the ranks (``pagedkv.serving.parallel``).
"""

from __future__ import annotations

from pagedkv.serving.config import EngineConfig
from pagedkv.serving.engine import Engine, EngineStats, RequestOutput, SampleOutput
from pagedkv.serving.errors import CudaGraphError, EngineConfigError, RequestError
from pagedkv.serving.graphs import DecodeGraphs, supports_decode_graphs
from pagedkv.serving.inputs import StepInputs, build_step_inputs
from pagedkv.serving.kv_cache import AttentionLayer, LayerGroup, ModelKVCache, StepAttention
from pagedkv.serving.model import PagedModel
from pagedkv.serving.parallel import (
    RankDivergenceError,
    TensorParallel,
    init_tensor_parallel,
    run_tensor_parallel,
)
from pagedkv.serving.params import SamplingParams
from pagedkv.serving.plan import PlannedSeq, StepPlan
from pagedkv.serving.runner import ModelRunner
from pagedkv.serving.sampler import sample
from pagedkv.serving.scheduler import (
    ScheduledSeq,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
)
from pagedkv.serving.sequence import FinishReason, SeqStatus, Sequence
from pagedkv.serving.worker import Worker

__all__ = [
    "AttentionLayer",
    "CudaGraphError",
    "DecodeGraphs",
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "EngineStats",
    "FinishReason",
    "LayerGroup",
    "ModelKVCache",
    "ModelRunner",
    "PagedModel",
    "PlannedSeq",
    "RankDivergenceError",
    "RequestError",
    "RequestOutput",
    "SampleOutput",
    "SamplingParams",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "SeqStatus",
    "Sequence",
    "StepAttention",
    "StepInputs",
    "StepPlan",
    "TensorParallel",
    "Worker",
    "build_step_inputs",
    "init_tensor_parallel",
    "run_tensor_parallel",
    "sample",
    "supports_decode_graphs",
]
