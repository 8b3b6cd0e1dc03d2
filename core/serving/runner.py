"""ModelRunner: one scheduled step through the model, eager or as a CUDA-graph replay.

Worker side of a step, in order: drop the block-table rows of sequences that left,
apply the forks' copies to every layer (before any K/V is written), build the
step's metadata once per layer group, run the model, return the sampled rows' logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.distributed import agree_num_blocks
from pagedkv.kv import StepAssembler
from pagedkv.serving.config import EngineConfig
from pagedkv.serving.errors import EngineConfigError
from pagedkv.serving.graphs import DecodeGraphs, supports_decode_graphs
from pagedkv.serving.inputs import TokenFeed, build_step_inputs
from pagedkv.serving.kv_cache import ModelKVCache
from pagedkv.serving.model import PagedModel
from pagedkv.serving.parallel import TensorParallel
from pagedkv.serving.plan import StepPlan


class ModelRunner:
    """Executes StepPlans on one device. Under tensor parallelism (``tp``) every rank
    has one, over its share of the heads; the pool size is the minimum of every
    rank's ``config.resolved_num_blocks`` (``agree_num_blocks``), so block ids mean
    the same on all ranks."""

    def __init__(
        self, model: PagedModel, config: EngineConfig, tp: TensorParallel | None = None
    ) -> None:
        self.model = model
        self.config = config
        self.tp = tp
        self.device = torch.device(config.device)
        num_blocks = config.resolved_num_blocks
        if tp is not None:
            num_blocks = agree_num_blocks(num_blocks, group=tp.group)
        self.kv = ModelKVCache(
            model.attention_layers(config.block_size), num_blocks, config.backend, self.device
        )
        self.assembler = StepAssembler(
            config.block_size, config.max_num_seqs, config.max_model_len, self.device
        )
        self.resident: set[str] = set()  # sequences holding a block-table row
        self._staged: torch.cuda.Event | None = None  # after the last step's copies
        self.graphs: DecodeGraphs | None = None
        if self._use_graphs():
            self.graphs = DecodeGraphs(
                model, self.kv, config.graph_batch_sizes, config.max_blocks_per_seq
            )

    def _use_graphs(self, backends: Sequence[AttentionBackend] | None = None) -> bool:
        """Whether decode steps replay graphs on ``backends`` (one per layer group;
        default: the current ones). Raises when cuda_graph=True cannot be honoured."""
        wanted = self.config.cuda_graph
        if wanted is False:
            return False
        backends = [g.backend for g in self.kv.groups] if backends is None else backends
        why_not = []
        if self.device.type != "cuda":
            why_not.append(f"device {self.device.type} is not CUDA")
        why_not += [
            f"{b!r} (layers {g.layer_ids[0]}..) has no decode CUDA-graph support"
            for b, g in zip(backends, self.kv.groups, strict=True)
            if not supports_decode_graphs(b)
        ]
        if why_not and wanted:
            raise EngineConfigError("cuda_graph=True, but " + "; ".join(why_not))
        return not why_not

    def switch_backend(
        self, backend: str | AttentionBackend | None, blocks: Sequence[int] | None = None
    ) -> None:
        """Run every layer on ``backend`` from the next step on: caches converted
        (``blocks``: those holding K/V; default all), impls, builders and decode graphs
        made anew. Block tables, rows and the KV manager are the same for any backend."""
        use_graphs = self._use_graphs(self.kv.resolve(backend))  # refuse before changing
        self.graphs = None  # captured graphs hold the old caches
        self.kv.switch_backend(backend, blocks)
        self.config = dataclasses.replace(self.config, backend=backend)
        if use_graphs:
            self.graphs = DecodeGraphs(
                self.model, self.kv, self.config.graph_batch_sizes, self.config.max_blocks_per_seq
            )

    def execute(self, plan: StepPlan, feed: TokenFeed | None = None) -> torch.Tensor:
        """Run the step; returns logits [S, vocab] of the sampled sequences, batch order.
        ``feed``: the step before's sampled tokens, for the plan's placeholders."""
        for seq_id in plan.removed_seq_ids:
            if seq_id in self.resident:  # a sequence may leave before its first step
                self.resident.remove(seq_id)
                self.assembler.remove_request(seq_id)
        if self._staged is not None:
            # the step before's metadata copies have run: a builder may stage metadata
            # in host buffers it reuses every step (FlashInfer's plan does), and under
            # async scheduling this step is built while the step before waits to run
            self._staged.synchronize()
        self.kv.copy_blocks(plan.copies)
        graph = None
        if self.graphs is not None and plan.is_pure_decode:
            graph = self.graphs.bucket(len(plan.seqs))
        num_tokens = graph.batch_size if graph is not None else None
        common = self.assembler.build(plan.kv_requests(), num_tokens)
        if self.tp is not None and self.tp.check_every_step:
            self.tp.check_same_step(
                {
                    "block_table": common.block_table,
                    "slot_mapping": common.slot_mapping,
                    "query_start_loc": common.query_start_loc,
                    "seq_lens": common.seq_lens,
                }
            )
        self.resident.update(s.seq_id for s in plan.seqs)
        inputs = build_step_inputs(plan.seqs, self.device, num_tokens, feed)
        with torch.inference_mode():
            if graph is not None:
                assert self.graphs is not None
                self.graphs.stage(graph, common, inputs)
                self._mark_staged()
                return self.graphs.launch(graph, inputs)
            attention = self.kv.build(common)
            self._mark_staged()
            return self.model.forward(
                inputs.input_ids, inputs.positions, inputs.logits_indices, attention
            )

    def _mark_staged(self) -> None:
        """An event after the step's metadata and input copies (CUDA only)."""
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()
