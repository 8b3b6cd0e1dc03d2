"""CUDA-graph decode: one graph per decode batch size, replayed with new metadata.

Through the contract's graph support: a builder reserved with
``reserve_cuda_graph(GraphBounds(...))`` writes every later step's metadata into the
same persistent buffers, so a graph captured on a dummy step replays any decode step
within the bounds. Each batch size (bucket) has its own builders, static input
buffers and graph; a step of B decodes runs in the smallest bucket >= B, its tokens
padded with slot -1 (nothing written).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pagedkv
import torch
from pagedkv.backend import AttentionBackend, AttentionMetadataBuilder
from pagedkv.features import Feature
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.serving.errors import CudaGraphError
from pagedkv.serving.inputs import StepInputs
from pagedkv.serving.kv_cache import ModelKVCache

if TYPE_CHECKING:
    from pagedkv.serving.model import PagedModel


def supports_decode_graphs(backend: AttentionBackend) -> bool:
    """The backend's metadata can be captured for pure-decode steps."""
    graph_support = getattr(pagedkv, "GraphSupport", None)
    capabilities = backend.capabilities
    if graph_support is not None and hasattr(capabilities, "cuda_graph"):
        return capabilities.cuda_graph != graph_support.NEVER
    # before the contract's GraphSupport: backends whose builder reserves graph buffers
    return Feature.CUDA_GRAPH in capabilities.features and hasattr(
        backend.get_builder_cls(), "reserve_cuda_graph"
    )


def reserve(builder: AttentionMetadataBuilder[Any], batch_size: int, max_blocks: int) -> None:
    """Reserve capture-safe buffers for pure-decode steps of up to ``batch_size``."""
    bounds_cls = getattr(pagedkv, "GraphBounds", None)
    if bounds_cls is not None:
        builder.reserve_cuda_graph(  # type: ignore[attr-defined]
            bounds_cls(
                max_num_reqs=batch_size,
                max_num_tokens=batch_size,
                max_blocks_per_req=max_blocks,
                max_query_len=1,
            )
        )
    else:  # before the contract's GraphBounds: the keyword form of the Triton builder
        builder.reserve_cuda_graph(batch_size, batch_size, max_blocks, max_query_len=1)  # type: ignore[attr-defined]


@dataclass
class DecodeGraph:
    batch_size: int
    builders: list[AttentionMetadataBuilder[Any]]
    input_ids: torch.Tensor  # [batch_size] int64, static
    positions: torch.Tensor  # [batch_size] int64, static
    logits: torch.Tensor  # [batch_size, vocab], written by every replay
    graph: torch.cuda.CUDAGraph


class DecodeGraphs:
    """Captured decode graphs of one model over one ModelKVCache."""

    def __init__(
        self,
        model: PagedModel,
        kv: ModelKVCache,
        batch_sizes: tuple[int, ...],
        max_blocks_per_seq: int,
    ) -> None:
        self.model, self.kv = model, kv
        self.max_blocks = max_blocks_per_seq
        self.graphs: dict[int, DecodeGraph] = {}
        self.num_replays = 0
        pool = None
        try:
            for size in sorted(batch_sizes, reverse=True):  # largest first: smaller reuse its pool
                with torch.inference_mode():
                    self.graphs[size] = self._capture(size, pool)
                pool = self.graphs[size].graph.pool()
        except Exception as exc:
            raise CudaGraphError(
                f"capturing the decode graph of batch size {size} failed "
                f"({type(exc).__name__}: {exc}); run with cuda_graph=False"
            ) from exc

    def _capture(self, size: int, pool: Any) -> DecodeGraph:
        kv, device = self.kv, self.kv.device
        builders = kv.make_builders()
        for builder in builders:
            reserve(builder, size, self.max_blocks)
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
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm up: lazy inits, autotuning, allocator
            for _ in range(2):
                self.model.forward(input_ids, positions, rows, attention)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.model.forward(input_ids, positions, rows, attention)
        return DecodeGraph(size, builders, input_ids, positions, logits, graph)

    def bucket(self, num_seqs: int) -> DecodeGraph | None:
        """The smallest captured batch that holds ``num_seqs`` decodes."""
        fitting = [s for s in self.graphs if s >= num_seqs]
        return self.graphs[min(fitting)] if fitting else None

    def replay(
        self, graph: DecodeGraph, common: CommonAttentionMetadata, inputs: StepInputs
    ) -> torch.Tensor:
        """common and inputs padded to graph.batch_size rows. Returns the sampled rows'
        logits [S, vocab] (a view of the graph's output: use before the next replay)."""
        self.kv.build(common, graph.builders)  # new metadata into the reserved buffers
        graph.input_ids.copy_(inputs.input_ids, non_blocking=True)
        graph.positions.copy_(inputs.positions, non_blocking=True)
        graph.graph.replay()
        self.num_replays += 1
        return graph.logits[inputs.logits_indices]
