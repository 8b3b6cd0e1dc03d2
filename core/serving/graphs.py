"""CUDA-graph decode: one graph per decode batch size, replayed with new metadata.

Through the contract's graph support: a builder reserved with
``reserve_cuda_graph(GraphBounds(...))`` writes every later step's metadata into the
same persistent buffers, so a graph captured on a dummy step replays any decode step
within the bounds. Each batch size (bucket) has its own builders, static input
buffers and graph; a step of B decodes runs in the smallest bucket >= B, its tokens
padded with slot -1 (nothing written).

``capture=False`` keeps everything but the CUDA graph: a replay runs the model
eagerly on the objects fixed at capture time (the static inputs and the metadata
built for the dummy step, whose buffers every later build refills), so on a CPU a
test sees exactly what a replay would read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from pagedkv.backend import AttentionBackend, AttentionMetadataBuilder
from pagedkv.graph import GraphBounds
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.serving.errors import CudaGraphError
from pagedkv.serving.inputs import StepInputs
from pagedkv.serving.kv_cache import ModelKVCache, StepAttention

if TYPE_CHECKING:
    from pagedkv.serving.model import PagedModel


def supports_decode_graphs(backend: AttentionBackend) -> bool:
    """The backend's forward can be captured for pure-decode steps (its declared
    ``GraphSupport`` is PURE_DECODE or MIXED)."""
    return backend.capabilities.graph_support.allows(max_query_len=1)


def decode_bounds(batch_size: int, max_blocks: int) -> GraphBounds:
    """The reservation of a decode graph: ``batch_size`` sequences of one token each."""
    return GraphBounds(
        max_num_reqs=batch_size,
        max_num_tokens=batch_size,
        max_blocks_per_req=max_blocks,
        max_query_len=1,
    )


@dataclass
class DecodeGraph:
    batch_size: int
    builders: list[AttentionMetadataBuilder[Any]]
    input_ids: torch.Tensor  # [batch_size] int64, static
    positions: torch.Tensor  # [batch_size] int64, static
    # every tensor the captured forward reads must live as long as the graph: a
    # replay reads their addresses, whatever the allocator has put there since
    rows: torch.Tensor  # [batch_size] int64, static: the rows whose logits are computed
    logits: torch.Tensor  # [batch_size, vocab], written by every replay
    graph: torch.cuda.CUDAGraph | None  # None: replayed eagerly (capture=False)
    attention: StepAttention  # the metadata the graph was captured with


class DecodeGraphs:
    """Captured decode graphs of one model over one ModelKVCache."""

    def __init__(
        self,
        model: PagedModel,
        kv: ModelKVCache,
        batch_sizes: tuple[int, ...],
        max_blocks_per_seq: int,
        *,
        capture: bool = True,
    ) -> None:
        self.model, self.kv = model, kv
        self.max_blocks = max_blocks_per_seq
        self.capture = capture
        self.graphs: dict[int, DecodeGraph] = {}
        self.num_replays = 0
        pool = None
        try:
            for size in sorted(batch_sizes, reverse=True):  # largest first: smaller reuse its pool
                with torch.inference_mode():
                    self.graphs[size] = self._capture(size, pool)
                graph = self.graphs[size].graph
                pool = graph.pool() if graph is not None else None
        except Exception as exc:
            raise CudaGraphError(
                f"capturing the decode graph of batch size {size} failed "
                f"({type(exc).__name__}: {exc}); run with cuda_graph=False"
            ) from exc

    def _capture(self, size: int, pool: Any) -> DecodeGraph:
        kv, device = self.kv, self.kv.device
        builders = kv.make_builders()
        for builder in builders:
            builder.reserve_cuda_graph(decode_bounds(size, self.max_blocks))
        # a dummy step: every sequence one token, in the null block
        common = CommonAttentionMetadata.from_requests(
            [1] * size,
            [1] * size,
            [[0]] * size,
            kv.block_size,
            device,
            max_blocks_per_req=self.max_blocks,
        )
        attention = kv.build(common, builders)
        input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        positions = torch.zeros(size, dtype=torch.int64, device=device)
        rows = torch.arange(size, device=device)
        if not self.capture:
            logits = self.model.forward(input_ids, positions, rows, attention)
            return DecodeGraph(size, builders, input_ids, positions, rows, logits, None, attention)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm up: lazy inits, autotuning, allocator
            for _ in range(2):
                self.model.forward(input_ids, positions, rows, attention)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.model.forward(input_ids, positions, rows, attention)
        return DecodeGraph(size, builders, input_ids, positions, rows, logits, graph, attention)

    def bucket(self, num_seqs: int) -> DecodeGraph | None:
        """The smallest captured batch that holds ``num_seqs`` decodes."""
        fitting = [s for s in self.graphs if s >= num_seqs]
        return self.graphs[min(fitting)] if fitting else None

    def replay(
        self, graph: DecodeGraph, common: CommonAttentionMetadata, inputs: StepInputs
    ) -> torch.Tensor:
        """common and inputs padded to graph.batch_size rows. Returns the sampled rows'
        logits [S, vocab] (a view of the graph's output: use before the next replay)."""
        self.stage(graph, common, inputs)
        return self.launch(graph, inputs)

    def stage(
        self, graph: DecodeGraph, common: CommonAttentionMetadata, inputs: StepInputs
    ) -> None:
        """The step's metadata into the reserved buffers, its inputs into the static ones."""
        self.kv.build(common, graph.builders)
        graph.input_ids.copy_(inputs.input_ids, non_blocking=True)
        graph.positions.copy_(inputs.positions, non_blocking=True)

    def launch(self, graph: DecodeGraph, inputs: StepInputs) -> torch.Tensor:
        """Replay the staged step; the sampled rows' logits (a view, as ``replay``'s)."""
        self.num_replays += 1
        if graph.graph is None:
            logits = self.model.forward(
                graph.input_ids, graph.positions, graph.rows, graph.attention
            )
            return logits[inputs.logits_indices]
        graph.graph.replay()
        return graph.logits[inputs.logits_indices]
