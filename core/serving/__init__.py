"""A reference serving layer built only from pagedkv's public parts (docs/serving.md).

- ``Engine(model, EngineConfig(...))``: ``add_request`` / ``step`` / ``abort`` /
  ``generate``; outputs per request and sample.
- ``Scheduler``: token budget, decodes first, chunked prefill, prefix-cache admission,
  preemption by recompute, n > 1 samples by fork + copy-on-write.
- ``ModelKVCache``: every layer's cache from one spec per layer, block copies applied
  to all layers; ``StepAttention``: the per-step view a model's attention calls.
- ``build_step_inputs``, ``sample``, ``DecodeGraphs`` (CUDA-graph decode).
"""

from __future__ import annotations

from pagedkv.serving.config import EngineConfig
from pagedkv.serving.engine import Engine, EngineStats, RequestOutput, SampleOutput
from pagedkv.serving.errors import CudaGraphError, EngineConfigError, RequestError
from pagedkv.serving.graphs import DecodeGraphs, supports_decode_graphs
from pagedkv.serving.inputs import StepInputs, build_step_inputs
from pagedkv.serving.kv_cache import AttentionLayer, LayerGroup, ModelKVCache, StepAttention
from pagedkv.serving.model import PagedModel
from pagedkv.serving.params import SamplingParams
from pagedkv.serving.runner import ModelRunner
from pagedkv.serving.sampler import sample
from pagedkv.serving.scheduler import (
    ScheduledSeq,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
)
from pagedkv.serving.sequence import FinishReason, SeqStatus, Sequence

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
    "build_step_inputs",
    "sample",
    "supports_decode_graphs",
]
