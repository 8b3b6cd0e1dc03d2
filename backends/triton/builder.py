"""The Triton backend's metadata: the step's launch plan, made once per step.

``build_metadata`` cuts the step into parts and chooses tiles and splits per part
(``configs.plan_step``) and fills the launch templates: every kernel argument that
does not depend on a layer's tensors (the step's metadata tensors, the split-KV
partials, the grid, the tile constants, a split launch's list of work items), so
that ``attend`` of every layer only adds its query, output and cache and launches.
Under a CUDA-graph reservation the step arrives padded to the bounds, so the plan
(and the partials, from ``self.scratch``) is the same every step; bounds that allow
chunk-length queries get two launches, decodes and longer requests, whose metadata
each step copies into their own persistent buffers (``_graph_parts_metadata``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
from pagedkv.backend import AttentionMetadataBuilder, BackendMetadata
from pagedkv.backends.triton.attention_kernel import (
    DEPENDENTS_AFTER_KEYS,
    DEPENDENTS_AT_START,
    unified_attention_kernel,
)
from pagedkv.backends.triton.configs import (
    MERGE_ROUNDS,
    REDUCE_MIN_WIDTH,
    REDUCE_TILE_VALUES,
    SPLIT_POLICY,
    FitSource,
    LaunchForm,
    LayerShape,
    StepPart,
    StepShape,
    TileConfig,
    TilePlan,
    check_forced_splits,
    graph_items,
    merge_chunk,
    merge_rows,
    merges_last,
    one_block_per_request,
    plan_step,
    plan_tiles,
    portable_us,
    range_list_choice,
    reduce_tile,
    slots_per_sm,
    step_splits,
    work_items,
)
from pagedkv.backends.triton.gluon_plan import (
    GluonPrefillStep,
    gluon_prefill_problem,
    gluon_program_us,
    gluon_programs,
    gluon_step_problem,
    plan_gluon_prefill,
)
from pagedkv.backends.triton.parts import (
    PartViews,
    StagedPart,
    decode_and_longer_runs,
    part_views,
)
from pagedkv.backends.triton.reduce_kernel import reduce_splits_kernel
from pagedkv.errors import ConfigError
from pagedkv.graph import GraphBounds
from pagedkv.intmath import cdiv, next_power_of_2
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.interpreter import interpreting
from pagedkv.toolkit.launch import MAX_GRID_Y, KernelLaunch, programmatic_launch
from pagedkv.toolkit.split_kv import SplitChoice, num_sms

T = TypeVar("T")


class StepSplits(NamedTuple):
    """One step's ``NumSplits``, the buffer a dynamic-split (CUDA-graph) plan's kernels
    read: the step's split count, the tiles and keys of a fixed key range (0: even
    shares), the token row its partials start at, the work items of each request when a
    listed item finds its request by a division (else 0), and whether the attention
    kernel merges the splits (MERGE_LAST) rather than the merge kernel."""

    num_splits: int
    tiles_per_split: int
    keys_per_split: int
    partial_first: int
    per_request: int
    merged: bool

    def words(self) -> list[int]:
        """The buffer's int32 words. The partials' first row and the merge choice share
        one (row x 2 + merged): both kernels load the row anyway, so a step reads
        nothing more for the choice (a word of its own, read after the keys, took a
        graph decode of 2 x 8192 from 32.6 to 33.0 us, H100, forty-sixth session); the
        kernels decode it with ``reduce_kernel.partials_first_row`` and
        ``merged_in_attention``."""
        row_and_merge = self.partial_first * 2 + int(self.merged)
        return [self.num_splits, self.tiles_per_split, self.keys_per_split, row_and_merge,
                self.per_request]  # fmt: skip

    @classmethod
    def read(cls, buffer: torch.Tensor) -> StepSplits:
        """The fields of a ``NumSplits`` buffer (a copy to the host)."""
        num_splits, tiles, keys, row_and_merge, per_request = buffer.tolist()
        merged = bool(row_and_merge & 1)
        return cls(num_splits, tiles, keys, row_and_merge >> 1, per_request, merged)


@dataclass(frozen=True)
class PartLaunches:
    """The launches of one part of a step (requests ``[first, end)``)."""

    first: int
    end: int
    plan: TilePlan  # tiles and splits
    # unified_attention_kernel, grid (query blocks, Hkv, splits), by request (Hkv,
    # requests, splits) or listed (items x Hkv,)
    attention: KernelLaunch
    reduce: KernelLaunch | None  # reduce_splits_kernel when split, grid (tokens, head blocks)
    # the Gluon sm_90 prefill kernel's launch for this part, when it runs it (the impl
    # falls back to ``attention`` for a cache TMA cannot read)
    gluon: GluonPrefillStep | None = None
    # a CUDA-graph step's launch over one kind of request ("decodes", "longer
    # requests"), whose metadata each step copies into persistent buffers; None: a
    # launch over the step's own requests [first, end)
    role: str | None = None
    # this step's splits where ``plan`` lets each step choose them (a CUDA-graph plan:
    # the kernels read them from the device, the grid holds the plan's most)
    choice: SplitChoice | None = None


@dataclass(frozen=True)
class TritonMetadata(BackendMetadata):
    """One step for the Triton kernels (B = common.num_reqs, padded under a reservation).

    ``parts`` hold launch templates, one attention (+ reduction) per part of the step
    (``configs.plan_step``): the impl completes their kwargs with one layer's tensors
    (query, output, cache views and their strides, sinks, ALiBi slopes, the layer's
    scalars)."""

    layer: LayerShape  # the layer shape the plan was made for
    parts: tuple[PartLaunches, ...]

    @property
    def step_choice(self) -> SplitChoice | None:
        """This step's splits under a CUDA-graph plan that chooses them per step: its
        first such part's (a mixed reservation's decodes; ``parts`` hold each)."""
        return next((p.choice for p in self.parts if p.choice is not None), None)

    @property
    def step_splits(self) -> int | None:
        return None if self.step_choice is None else self.step_choice.num_splits

    @property
    def plan(self) -> TilePlan:
        """The plan of a one-part step (tuning and tests); see ``parts`` otherwise."""
        if len(self.parts) != 1:
            raise ValueError(f"a step of {len(self.parts)} parts has one plan per part")
        return self.parts[0].plan

    @property
    def tile(self) -> TileConfig:
        return self.plan.tile

    @property
    def num_splits(self) -> int:
        """The most splits of any part."""
        return max(p.plan.num_splits for p in self.parts)

    def describe(self) -> str:
        def kernel(p: PartLaunches) -> str:
            if p.gluon is not None:
                return f"Gluon sm_90 prefill, {p.gluon.kwargs['TILE_N']}-key tiles"
            if p.plan.dynamic_splits and p.choice is not None:
                choice = p.choice
                ranges = f" of {choice.keys_per_split} keys" if choice.fixed_ranges else ""
                return (
                    f"{p.plan.tile}, {choice.num_splits}{ranges} of at most "
                    f"{p.plan.num_splits} split(s)"
                )
            if p.plan.tiles_per_split and not p.plan.ordered_reduction:
                keys = p.plan.tiles_per_split * p.plan.tile.tile_n
                return f"{p.plan.tile}, {p.plan.num_splits} split(s) of {keys} keys"
            return f"{p.plan.tile}, {p.plan.num_splits} split(s)"

        def requests(p: PartLaunches) -> str:
            if p.end <= p.first:
                return "none"
            return f"requests {p.first}-{p.end - 1}"

        if len(self.parts) == 1:
            return kernel(self.parts[0])
        if self.parts[0].role is not None:
            return "graph parts; " + "; ".join(
                f"{p.role} ({requests(p)}): {kernel(p)}" for p in self.parts
            )
        return ", ".join(f"{requests(p)}: {kernel(p)}" for p in self.parts)


class TritonMetadataBuilder(AttentionMetadataBuilder[TritonMetadata]):
    """Chooses tiles and splits per step. Options: ``num_splits`` (0 = chosen per
    step), ``batch_invariant`` (a plan that does not depend on the batch),
    ``prefill_kernel`` (``portable``: never the Gluon prefill kernel), ``split_grid``
    (``blocks``: no list of work items)."""

    def __init__(self, spec: AttentionSpec, device: torch.device | str, **options: Any) -> None:
        super().__init__(spec, device, **options)
        self.forced_splits = check_forced_splits(options.get("num_splits"))
        self.batch_invariant = bool(options.get("batch_invariant"))
        # split launches may list their work items (the kernel's RANGE_LIST)
        self.listing = options.get("split_grid", "auto") == "auto"
        # a split launch of one query block per request merges in its last program of
        # each block (the kernel's MERGE_LAST), not in a second launch
        self.merge_last = options.get("split_merge", "auto") == "auto"
        # the MERGE_LAST launches' counts of written splits (``_split_counts``)
        self._counts: torch.Tensor | None = None
        self.layer = LayerShape.of(spec)
        self.num_sms = num_sms(self.device)
        # a split launch's reduction starts during the attention kernel's last programs
        # (programmatic dependent launch) where the GPU has it: a split decode is short,
        # so the gap between the two kernels is a visible share of it
        self.programmatic = programmatic_launch(self.device)
        # the compiled kernels' registers for the tile rule, on a GPU that compiles them
        # (the batch-invariant mode's tile must not depend on the GPU); None: the estimate
        self.fits: FitSource | None = None
        if not self.batch_invariant and self.device.type == "cuda" and not interpreting():
            # imported here: the occupancy probe builds its steps with this module's builder
            from pagedkv.backends.triton.occupancy import CompiledFits

            self.fits = CompiledFits(spec, self.device, options)
        # why prefill steps cannot run the Gluon sm_90 kernel here (None: they do)
        if self.batch_invariant:
            self.gluon_problem = "the batch-invariant mode keeps one kernel and tile per layer"
        elif options.get("prefill_kernel", "auto") == "portable":
            self.gluon_problem = "option prefill_kernel=portable"
        else:
            self.gluon_problem = gluon_prefill_problem(spec, self.device)
        # a two-part step's parts run on two streams (the impl's option of that name)
        self.overlap_parts = options.get("overlap_parts", True) is not False
        # stands in for the tensor arguments a launch never reads
        self._unused = torch.zeros(1, dtype=torch.float32, device=self.device)
        # CUDA-graph plans, by the bounds' shape (``_graph_plan``)
        self._graph_plans: dict[tuple, Any] = {}
        # a mixed reservation's two staged parts, kept across its steps (``StagedPart.kept``)
        self._staged_parts: dict[str, StagedPart] = {}

    def build_metadata(
        self,
        common: CommonAttentionMetadata,
        *,
        tile: TileConfig | None = None,
        num_splits: int | None = None,
        keys_per_split: int | None = None,
    ) -> TritonMetadata:
        """This step's plan. ``tile`` / ``num_splits`` / ``keys_per_split`` (splits of
        fixed key ranges) override the rule (tuning)."""
        forced = check_forced_splits(num_splits) or self.forced_splits
        bounds = self.graph_bounds
        if keys_per_split and (forced or self.batch_invariant or bounds is not None):
            raise ConfigError(
                f"keys_per_split={keys_per_split}: an eager step's override, not with "
                "num_splits, batch_invariant=true or a CUDA-graph reservation"
            )
        if (
            bounds is not None
            and bounds.max_query_len > SPLIT_POLICY.max_query_len
            and not (self.batch_invariant or tile is not None or forced)
        ):
            return self._graph_parts_metadata(common, bounds)
        # the step's own requests (a CUDA-graph step's padded ones); under a reservation
        # the plan's shape-deciding inputs are the bounds only
        requests = StepShape.of(common)
        step = requests if bounds is None else StepShape.of_bounds(common)
        options = dict(
            forced_splits=forced,
            forced_keys=keys_per_split or 0,
            batch_invariant=self.batch_invariant,
            tile=tile,
            listing=self.listing,
        )
        # the Gluon launch of each part that may take it (``_gluon_candidate``), by range
        gluon_plans: dict[tuple[int, int], GluonPrefillStep | None] = {}

        def gluon_for(first: int, end: int, whole: bool) -> GluonPrefillStep | None:
            if (first, end) not in gluon_plans:
                gluon_plans[(first, end)] = self._gluon_candidate(common, step, first, end, whole)
            return gluon_plans[(first, end)]

        # whether each part takes it whatever its splits, by range (asked by its own plan
        # and by the other part's: ``_free_beside_gluon``)
        regardless: dict[tuple[int, int], bool] = {}

        def gluon_regardless(first: int, end: int, whole: bool) -> bool:
            if (first, end) not in regardless:
                gluon = gluon_for(first, end, whole)
                regardless[(first, end)] = gluon is not None and self._gluon_unsplit(
                    gluon, step, first, end, whole
                )
            return regardless[(first, end)]

        if bounds is None:
            # a part the Gluon kernel takes whatever its splits is planned unsplit (its
            # portable plan only the fallback where TMA cannot read the cache): the split
            # rule took a seventh of a mixed step's build
            by_rule = not (forced or keys_per_split or self.batch_invariant or tile is not None)
            gluon_rule = by_rule and self.gluon_problem is None

            def beside_gluon(first: int, end: int) -> float:
                return self._free_beside_gluon(step, first, end, gluon_regardless)

            parts = plan_step(
                self.layer, step, self.num_sms, fit=self.fits,
                unsplit=gluon_regardless if gluon_rule else None,
                free_share=beside_gluon if gluon_rule else None,
                **options,
            )  # fmt: skip
        else:
            parts = self._graph_plan(plan_step, step, **options)
        splits = max(p.plan.num_splits for p in parts)
        s, layer, unused = self.spec, self.layer, self._unused
        acc = stat_max = stat_sum = unused
        if any(p.plan.split for p in parts):
            # one set of partials for the step's tokens, whichever part writes them
            shape = (common.num_tokens, s.num_heads, splits)
            acc = self.scratch("partial_acc", (*shape, layer.head_pad), torch.float32)
            stat_max = self.scratch("partial_max", shape, torch.float32)
            stat_sum = self.scratch("partial_sum", shape, torch.float32)
        partials = (acc, stat_max, stat_sum)
        chosen, num_splits, max_items, step_items = None, unused, None, None
        if parts[0].plan.dynamic_splits:
            # a CUDA-graph plan: the step's own splits (its requests, not the bounds'),
            # written where the captured kernels read them: the count, and the tiles and
            # keys of a fixed range (0: even shares); listed, within the captured grid
            # (bounds of chunk-length queries launch a grid of query blocks, not a list)
            listed = self.listing and one_block_per_request(step, parts[0].plan.block_q)
            if listed:
                max_items = graph_items(layer, parts[0].plan, common.num_reqs, self.num_sms)
            chosen = step_splits(
                layer, requests, parts[0].plan, self.num_sms, self.fits, listed, max_items
            )
            step_items = work_items(requests, chosen) if listed else None
            num_splits = self._write_step_splits(
                chosen,
                parts[0].plan,
                requests,
                query_rows=min(parts[0].plan.block_q, step.max_query_len),
                items=step_items,
            )
        whole = len(parts) == 1
        if whole:  # (a CUDA-graph plan's part is planned from the bounds' shape)
            parts = (dataclasses.replace(parts[0], first=0, end=common.num_reqs),)
        launches = []
        for part in parts:
            # the part as its plan saw it (a CUDA-graph plan: the bounds)
            planned = step if whole else step.part(part.first, part.end)
            listed = range_list_choice(planned, part.plan) if self.listing else None
            range_list = None
            if listed is not None:
                # (a CUDA-graph plan's one part: the step's items, counted above)
                items = (
                    step_items
                    if whole and step_items is not None
                    else work_items(requests.part(part.first, part.end), chosen or listed)
                )
                range_list = self._range_list(
                    f"range_starts_{part.first}", items, part.plan, max_items
                )
            launches.append(
                self._part_launches(
                    part_views(
                        common, None if whole else (part.first, part.end), part.plan.block_q
                    ),
                    part,
                    partials,
                    num_splits,
                    None
                    if tile is not None
                    else self._gluon_part(
                        gluon_for(part.first, part.end, whole), step, part, whole
                    ),
                    range_list=range_list,
                    by_request=one_block_per_request(planned, part.plan.block_q),
                    query_rows=min(part.plan.block_q, planned.max_query_len),
                    choice=chosen if part.plan.dynamic_splits else None,
                    beside=not whole and planned.max_query_len > SPLIT_POLICY.max_query_len,
                    step_tokens=common.num_tokens,
                )
            )
        return TritonMetadata(common, layer, tuple(launches))

    def _graph_parts_metadata(
        self, common: CommonAttentionMetadata, bounds: GraphBounds
    ) -> TritonMetadata:
        """A step under CUDA-graph bounds that allow chunk-length queries: two launches,
        planned from the bounds alone. The requests of one query (decodes) get a decode
        plan, the longer ones the bounds' plan (the Gluon kernel where it runs): one
        launch over both would give the decodes a prefill's tiles. Each launch's splits
        are chosen by each step within its plan's width (``graph_split_limit``), so a
        chunk with a long context splits in the graph as in an eager step (unsplit, the
        fp8 16:2048:8192:256 step took 401 us in its graph against 213 eager on the
        H100; thirty-eighth session). Each step copies its two runs of requests into the
        launches' persistent buffers (``decode_and_longer_runs``: a step whose kinds
        interleave runs whole in the second launch).

        Speculative requests (2 to 8 queries) join the longer launch here: the decodes'
        partials are sized for one query per request of the bounds (a CUDA-graph plan's
        scratch is fixed), and room for eight would cut the splits the decodes may take
        eightfold within the same memory."""
        layer, width = self.layer, common.block_table.shape[1]
        step = StepShape.of(common)  # this step's own requests
        decode_run, longer_run = decode_and_longer_runs(step.query_lens, 1)
        max_reqs = bounds.max_num_reqs
        decode_tokens = min(bounds.max_num_tokens, max_reqs)
        decode_shape = StepShape(
            np.ones(decode_tokens, np.int64), np.full(decode_tokens, common.max_seq_len, np.int64)
        )
        # the longer requests' Gluon launch, where it runs (it does not split: its
        # portable plan is then only the fallback, planned unsplit)
        gluon_runs = self.gluon_problem is None and (
            gluon_step_problem(common, self.spec, 1, max_query_len=bounds.max_query_len) is None
        )
        decode_plan = self._graph_plan(plan_tiles, decode_shape)
        longer_plan = self._graph_plan(
            plan_tiles, StepShape.of_bounds(common), forced_splits=1 if gluon_runs else 0
        )
        parts, scratch = self._staged_parts, self.scratch
        decodes = StagedPart.kept(parts, scratch, "decodes", max_reqs, decode_tokens, width)
        longer = StagedPart.kept(parts, scratch, "longer", max_reqs, bounds.max_num_tokens, width)
        decodes.stage(common, decode_run)
        longer.stage(common, longer_run)
        decode_requests = step.part(*decode_run)
        # the decodes' launch lists its work items (its runs' requests first, then the
        # padding ones, which have none), at most the captured grid's
        max_items = None  # unsplit: one item per request; unlisted: no list to cap
        if self.listing and decode_plan.split:
            max_items = graph_items(layer, decode_plan, max_reqs, self.num_sms)
        decode_partials, decode_num_splits, decode_choice, decode_items = self._staged_splits(
            "decodes", common, decode_plan, decode_requests, decode_run, decode_tokens, max_items
        )
        range_list = None
        if self.listing:
            items = np.zeros(max_reqs, np.int64)
            if decode_plan.split:
                items[: len(decode_requests.query_lens)] = decode_items
            else:
                items[: len(decode_requests.query_lens)] = decode_requests.query_lens > 0
            range_list = self._range_list("decodes_range_starts", items, decode_plan, max_items)
        longer_partials, longer_num_splits, longer_choice, _ = self._staged_splits(
            "longer", common, longer_plan, step.part(*longer_run), longer_run,
            bounds.max_num_tokens, None,
        )  # fmt: skip
        gluon = plan_gluon_prefill(self.spec, common, staged=longer) if gluon_runs else None
        launches = (
            self._part_launches(
                decodes.views(decode_plan.block_q),
                StepPart(*decode_run, decode_plan),
                decode_partials,
                decode_num_splits,
                None,
                role="decodes",
                range_list=range_list,
                step_tokens=common.num_tokens,
                by_request=True,
                query_rows=1,
                choice=decode_choice,
            ),
            self._part_launches(
                longer.views(longer_plan.block_q),
                StepPart(*longer_run, longer_plan),
                longer_partials,
                longer_num_splits,
                gluon,
                role="longer requests",
                choice=longer_choice,
                beside=True,
                step_tokens=common.num_tokens,
            ),
        )
        return TritonMetadata(common, layer, launches)

    def _staged_splits(
        self,
        name: str,
        common: CommonAttentionMetadata,
        plan: TilePlan,
        requests: StepShape,
        run: tuple[int, int],
        max_tokens: int,
        max_items: int | None,
    ) -> tuple[
        tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        torch.Tensor,
        SplitChoice | None,
        np.ndarray | None,
    ]:
        """A mixed reservation's launch ``name`` over ``run``'s ``requests`` this step:
        its partials (``max_tokens`` rows from the run's first token, ``StepSplits``'
        ``partial_first``), the device buffer of the step's splits, the splits
        (``step_splits``: a launch that lists its work items within ``max_items``, else,
        None, a grid) and, listed, each request's work items; or the unused tensors and
        None for an unsplit plan."""
        unused = self._unused
        if not plan.split:
            return (unused, unused, unused), unused, None, None
        shape = (max_tokens, self.spec.num_heads, plan.num_splits)
        partials = (
            self.scratch(f"{name}_partial_acc", (*shape, self.layer.head_pad), torch.float32),
            self.scratch(f"{name}_partial_max", shape, torch.float32),
            self.scratch(f"{name}_partial_sum", shape, torch.float32),
        )
        # the step's own requests may fit one block each (speculative ones in the longer
        # launch), but the launch's form is the captured one
        listed = max_items is not None
        chosen = (
            step_splits(self.layer, requests, plan, self.num_sms, self.fits, listed, max_items)
            if requests.max_query_len > 0
            else SplitChoice(1, plan.tile.tile_n)
        )
        first_token = int(common.query_start_loc_cpu[run[0]])
        # (a mixed reservation's decodes: one query each; its longer requests' launch
        # holds blocks of several queries and no MERGE_LAST)
        query_rows = 1 if name == "decodes" else plan.block_q
        items = work_items(requests, chosen) if listed else None
        num_splits = self._write_step_splits(
            chosen, plan, requests, query_rows, items, first_token, buffer=f"{name}_num_splits"
        )
        return partials, num_splits, chosen, items

    def _graph_plan(self, planner: Callable[..., T], shape: StepShape, **options: Hashable) -> T:
        """``planner``'s CUDA-graph plan (``plan_step``, ``plan_tiles``) of ``shape``, the
        bounds as a step: the same at every step of a reservation, so planned at its
        first and kept, by planner, shape and ``options`` (the rule's estimates took a
        quarter of a decode step's build, CPU)."""
        key = (planner, shape.query_lens.tobytes(), shape.seq_lens.tobytes(), *options.items())
        if key not in self._graph_plans:
            self._graph_plans[key] = planner(
                self.layer, shape, self.num_sms, bounded=True, fit=self.fits, **options
            )
        return self._graph_plans[key]

    def _range_list(
        self, name: str, items: np.ndarray, plan: TilePlan, max_items: int | None
    ) -> tuple[torch.Tensor, int]:
        """A range-list launch's ``RangeStarts`` (each request's first work item, then
        the total) on the device, and its grid's items: the step's own, or under a
        CUDA-graph reservation the most any step's plan takes: ``max_items`` (the step
        splits chose within it: ``graph_items``), else every split of every request."""
        starts = np.zeros(len(items) + 1, np.int32)
        np.cumsum(items, out=starts[1:])
        buffer = self.scratch(name, starts.shape, torch.int32)
        buffer.copy_(torch.from_numpy(starts), non_blocking=True)
        if self.graph_bounds is not None:
            grid_items = len(items) * plan.num_splits if max_items is None else max_items
            assert starts[-1] <= grid_items, (starts[-1], grid_items)
            return buffer, grid_items
        return buffer, max(1, int(starts[-1]))

    def _write_step_splits(
        self,
        chosen: SplitChoice,
        plan: TilePlan,
        step: StepShape,
        query_rows: int,
        items: np.ndarray | None,
        partial_first: int = 0,
        buffer: str = "num_splits",
    ) -> torch.Tensor:
        """The device buffer the captured kernels of a dynamic-split plan read: this
        step's ``StepSplits``. A list's item finds its request by a division when the
        splits are even shares and the requests without queries come after the others;
        the attention kernel merges when ``_merges_in_attention`` says so (a launch
        compiled without MERGE_LAST ignores it). ``query_rows``: the rows of a query
        block that may hold tokens; ``items``: each request's work items where the
        launch lists them (``work_items``), else None."""
        tile_n = plan.tile.tile_n
        tiles = chosen.keys_per_split // tile_n if chosen.fixed_ranges else 0
        live = step.query_lens > 0
        per_request = 0
        if not chosen.fixed_ranges and live[: int(live.sum())].all():
            per_request = chosen.num_splits
        listed = items is not None
        programs = int(items.sum()) if listed else int(live.sum()) * chosen.num_splits
        form = LaunchForm.KEY_RANGES if listed or chosen.fixed_ranges else LaunchForm.EVEN_SHARES
        merged = self._merges_in_attention(
            plan, query_rows, chosen.num_splits, programs * self.spec.num_kv_heads, form
        )
        values = StepSplits(
            chosen.num_splits, tiles, tiles * tile_n, partial_first, per_request, merged
        )
        num_splits = self.scratch(buffer, (len(values.words()),), torch.int32)
        num_splits.copy_(torch.tensor(values.words(), dtype=torch.int32), non_blocking=True)
        return num_splits

    def _gluon_candidate(
        self, common: CommonAttentionMetadata, step: StepShape, first: int, end: int, whole: bool
    ) -> GluonPrefillStep | None:
        """The Gluon launch of requests ``[first, end)`` if they may take it (prefills or
        chunked prefills: whole 128-row tiles), or None: decodes keep the portable kernel,
        whose small tiles fit them (a mixed step's chunks take Gluon, its decodes the
        portable kernel). Whether they do take it depends on the portable plan's splits
        (``_gluon_part``)."""
        if self.gluon_problem is not None:
            return None
        # a CUDA-graph plan (one part) decides from its bounds
        longest = step.max_query_len if whole else step.part(first, end).max_query_len
        if gluon_step_problem(common, self.spec, 1, max_query_len=longest) is not None:
            return None
        return plan_gluon_prefill(self.spec, common, requests=None if whole else (first, end))

    def _gluon_part(
        self, gluon: GluonPrefillStep | None, step: StepShape, part: StepPart, whole: bool
    ) -> GluonPrefillStep | None:
        """The part's Gluon launch (its candidate, ``gluon``), or None. The Gluon kernel
        does not split; a part the portable rule splits takes it only where
        ``_gluon_unsplit`` holds: not decode-like (speculative queries filling a tile at
        GQA 16 keep their splits), and its programs (one per SM: it holds a whole SM)
        still cover every SM or run beside the step's decodes."""
        if gluon is None:
            return None
        if part.plan.split and not self._gluon_unsplit(gluon, step, part.first, part.end, whole):
            return None
        return gluon

    def _gluon_unsplit(
        self, gluon: GluonPrefillStep, step: StepShape, first: int, end: int, whole: bool
    ) -> bool:
        """Whether requests ``[first, end)`` take their Gluon launch even where the
        portable rule would split them (else only where it does not)."""
        longest = step.max_query_len if whole else step.part(first, end).max_query_len
        return longest > SPLIT_POLICY.max_query_len and (  # decode-like: keeps its splits
            gluon.grid[0] * gluon.grid[1] >= self.num_sms
            or (not whole and self._gluon_beside_decodes(step, first, end))
        )

    def _gluon_beside_decodes(self, step: StepShape, first: int, end: int) -> bool:
        """Whether a two-part step's longer requests (``[first, end)``) take the Gluon
        kernel unsplit though its programs leave SMs idle: the decodes' launch runs on
        those SMs meanwhile (the impl overlaps the parts on two streams). Taken when one
        Gluon program (the longest request's last query block, on its SM) takes no
        longer than the portable kernel's model time for both parts, which would then
        share the whole GPU: on the H200 the mixed 16+1 step's eager plan (its chunk
        split in 3) took 153 us back to back where the graph plan (the chunk unsplit in
        Gluon) took 117 (docs/benchmarks.md, fourteenth session)."""
        if not self.overlap_parts:
            return False
        longer = step.part(first, end)
        decodes = step.part(0, first) if first > 0 else step.part(end, len(step.query_lens))
        # (the Gluon kernel takes no sliding window: its last block reads every key)
        alone = gluon_program_us(self.layer.head_size, longer.max_seq_len)
        return alone <= portable_us(self.layer, decodes) + portable_us(self.layer, longer)

    def _free_beside_gluon(
        self,
        step: StepShape,
        first: int,
        end: int,
        gluon_regardless: Callable[[int, int, bool], bool],
    ) -> float:
        """The share of the GPU's slots free when a two-part step's part ``[first, end)``
        launches: where it holds the decodes and the other part runs beside it on the
        Gluon kernel (``_gluon_beside_decodes``), each Gluon program holds a whole SM
        for the share of the decodes' time it runs (both by the model); the Gluon
        launch goes first, on a stream of higher priority, so its programs take their
        SMs first. Else 1. A Gluon grid of at least the GPU's SMs leaves the decodes
        none until its programs end, and then the whole GPU: 1 too.

        The decodes' split rule counts a grid of more programs than those free slots as
        several waves (``makespan_splits``). H100, thirty-eighth session (docs/triton.md):
        D 256 mixed's 48 decodes took 1024-key ranges, 380 programs in 396 slots as if
        the 32 Gluon programs were not there, and ran 172 us eager; 512-key ranges, the
        choice with the free share, 146."""
        n = len(step.query_lens)
        other = (end, n) if first == 0 else (0, first)
        decodes = step.part(first, end)
        if (
            not self.overlap_parts
            or decodes.max_query_len > SPLIT_POLICY.max_query_len
            or not gluon_regardless(*other, False)
        ):
            return 1.0
        longer = step.part(*other)
        programs = gluon_programs(self.spec, longer.query_lens)
        decodes_us = portable_us(self.layer, decodes)
        if programs >= self.num_sms or decodes_us <= 0:
            return 1.0
        held = min(1.0, gluon_program_us(self.layer.head_size, longer.max_seq_len) / decodes_us)
        return 1.0 - programs * held / self.num_sms

    def _split_counts(self, num_tokens: int) -> torch.Tensor:
        """The MERGE_LAST launches' counters: a row per token, the block that starts at
        it (a request's) counts its written splits there, one count per KV head, then
        its splits. The counts are zero between launches, as each block's merging program
        leaves them; so one buffer serves every step, its parts by their own tokens (they
        may run at once). Under a CUDA-graph reservation it holds the bounds' tokens
        from the first build on, so that its captured address holds."""
        bounds, heads = self.graph_bounds, self.spec.num_kv_heads
        rows = num_tokens if bounds is None else max(bounds.max_num_tokens, num_tokens)
        if self._counts is None or self._counts.shape[0] < rows:
            self._counts = torch.zeros(rows, heads + 1, dtype=torch.int32, device=self.device)
        return self._counts

    def _merges_in_attention(
        self, plan: TilePlan, query_rows: int, splits: int, programs: int, form: LaunchForm
    ) -> bool:
        """Whether a split launch of one query block per request that may merge in its
        last program of each block (MERGE_LAST) does, for ``splits`` splits a request
        and ``programs`` programs in ``form``: where the launch fits one wave of the
        SMs, and each block's merge takes at most ``MERGE_ROUNDS`` rounds of loads.
        Each program then counts its split (an atomic after its stores) and the last
        merges, one round after another: in one wave that replaces the merge kernel's
        launch at the end; over several, every program's count lengthens the waves.
        H100 (forty-fifth session, graph replays, µs, merge kernel -> in the attention):
        4 x 32k (512 programs, 16 splits, 2 rounds) 181.3 -> 180.5, 4 x 2048 14.9 ->
        14.5; 2 x 8192 (4 rounds) 32.3 -> 32.7, 1 x 4096 (4 rounds) 11.0 -> 12.4;
        64 ragged short (4,096 programs, one round) 85.0 -> 89.7."""
        if not (self.merge_last and merges_last(self.layer, query_rows)):
            return False
        slots = slots_per_sm(self.layer, plan.tile, form, self.fits) * self.num_sms
        chunk = merge_chunk(plan, self.layer, query_rows)
        return splits <= MERGE_ROUNDS * chunk and programs <= slots

    def _dependents_at(self, plan: TilePlan, beside: bool) -> int:
        """Where a split launch's programs let its reduction launch (the kernel's
        ``LAUNCH_DEPENDENTS``; 0: not a programmatic launch). At their start, where the
        reduction's programs wait on SMs the attention's last programs leave; after their
        keys for a two-part step's longer requests beside the decodes (``beside``, the
        parts overlapped): their grid starts every program in its first wave or two, so a
        reduction launched at their start would hold, for the longer part's whole length,
        slots the decodes' launch needs. H100 (fortieth session, docs/triton.md): fp8
        mixed 201.4 -> 182.2 us eager, 189.8 -> 180.5 graph; the longer part at one of its
        graph's dynamic splits 221.0 -> 160.0. Decode launches keep the start: after the
        keys, their listed dynamic-split variant compiled to 158 registers instead of 126
        (sm_90; three programs an SM instead of four), and the decode graphs lost 11-13%.
        The chunk's variants keep their registers (168 and 142-144)."""
        if not (self.programmatic and plan.split):
            return 0
        return DEPENDENTS_AFTER_KEYS if beside and self.overlap_parts else DEPENDENTS_AT_START

    def _part_launches(
        self,
        views: PartViews,
        part: StepPart,
        partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        num_splits: torch.Tensor,
        gluon: GluonPrefillStep | None,
        role: str | None = None,
        range_list: tuple[torch.Tensor, int] | None = None,
        by_request: bool = False,
        query_rows: int | None = None,
        choice: SplitChoice | None = None,
        beside: bool = False,
        step_tokens: int = 0,
    ) -> PartLaunches:
        """The launch templates of one part: its requests' metadata tensors (``views``)
        and its grid; ``gluon``: its Gluon launch, if it takes one; ``range_list``: the
        work items of a range-list launch (``_range_list``); ``by_request``: every
        request's queries fit one query block (an unlisted launch then takes one program
        per request); ``query_rows``: the rows of a query block that may hold tokens
        (the launch's longest query, at most the block; None: the block); ``choice``: the step's splits under a dynamic-split plan;
        ``beside``: the longer requests of a two-part step, whose launch the decodes'
        runs beside where the impl overlaps the parts (``_dependents_at``);
        ``step_tokens``: the step's tokens, which the parts' query rows index."""
        s, layer, unused, plan = self.spec, self.layer, self._unused, part.plan
        qsl, seq_lens, table = views.query_start_loc, views.seq_lens, views.block_table
        num_reqs, num_tokens, query_blocks = views.num_reqs, views.num_tokens, views.query_blocks
        acc, stat_max, stat_sum = partials
        acc_strides = acc.stride() if plan.split else (0, 0, 0)
        stat_strides = stat_max.stride() if plan.split else (0, 0)
        if not plan.split:
            acc = stat_max = stat_sum = unused
        t = plan.tile
        # (unsplit too: without the search the m16-n64 D 128 variant takes 128 registers,
        # 4 programs per SM where the search's took 164, 3; its one spilled predicate is
        # stored in the prologue and read in the epilogue, SPILL_SLACK_BYTES)
        # (a by-request grid puts the requests on its second axis, which CUDA caps; a
        # dynamic-split plan's is one axis, the kernel's note)
        by_request = (
            by_request and range_list is None and (num_reqs <= MAX_GRID_Y or plan.dynamic_splits)
        )
        # one query block per request: its programs' last merges the block's splits (the
        # batch-invariant mode keeps the ordered merge, one arithmetic for every step)
        rows = plan.block_q if query_rows is None else max(query_rows, 1)
        merge_last = (
            self.merge_last
            and plan.split
            and not plan.ordered_reduction
            and (range_list is not None or by_request)
            and merges_last(layer, rows)
        )
        if range_list is None:
            range_starts = unused
            if by_request:  # a request's KV heads adjacent (the kernel's note on order)
                grid = (s.num_kv_heads, num_reqs, plan.num_splits)
                if plan.dynamic_splits:
                    grid = (math.prod(grid), 1, 1)
            else:
                grid = (query_blocks, s.num_kv_heads, plan.num_splits)
        else:
            range_starts, items = range_list
            grid = (items * s.num_kv_heads, 1, 1)  # an item's heads adjacent (the kernel's)
        # a static plan merges in its attention kernel where ``_merges_in_attention``
        # says so, else launches the merge kernel; a CUDA-graph plan captures both, each
        # step's choice in NumSplits (``StepSplits``), read by both kernels
        if merge_last and not plan.dynamic_splits:
            form = (
                LaunchForm.KEY_RANGES
                if range_list is not None or plan.tiles_per_split > 0
                else LaunchForm.EVEN_SHARES
            )
            merge_last = self._merges_in_attention(
                plan, rows, plan.num_splits, math.prod(grid), form
            )
        split_counts = self._split_counts(max(step_tokens, num_tokens)) if merge_last else unused
        # a merge kernel follows unless a static plan's blocks merge in their last programs
        merge_kernel = plan.split and not (merge_last and not plan.dynamic_splits)
        attention = KernelLaunch(
            unified_attention_kernel,
            grid,
            dict(
                PartAcc=acc,
                PartMax=stat_max,
                PartSum=stat_sum,
                BlockTable=table,
                SeqLens=seq_lens,
                QueryStartLoc=qsl,
                Sinks=unused,
                AlibiSlopes=unused,
                NumSplits=num_splits,
                RangeStarts=range_starts,
                SplitCounts=split_counts,
                num_seqs=num_reqs,
                tiles_per_split=plan.tiles_per_split,
                stride_bt=table.stride(0),
                stride_pt=acc_strides[0],
                stride_ph=acc_strides[1],
                stride_ps=acc_strides[2],
                stride_mt=stat_strides[0],
                stride_mh=stat_strides[1],
                HEAD_SIZE=s.head_size,
                HEAD_PAD=layer.head_pad,
                BLOCK_SIZE=s.block_size,
                GROUP=layer.group,
                NUM_KV_HEADS=s.num_kv_heads,
                BLOCK_M=t.block_m,
                BLOCK_Q=plan.block_q,
                TILE_N=t.tile_n,
                SPLIT=plan.split,
                DYNAMIC_SPLITS=plan.dynamic_splits,
                TRIM_SPLITS=plan.trim_splits,
                RANGE_LIST=range_list is not None,
                BLOCK_PER_REQUEST=by_request,
                LAUNCH_DEPENDENTS=self._dependents_at(plan, beside) if merge_kernel else 0,
                MERGE_LAST=merge_last,
                MERGE_ROWS=merge_rows(layer, rows) if merge_last else 1,
                MERGE_CHUNK=merge_chunk(plan, layer, rows) if merge_last else 1,
                DOT_PRECISION="ieee" if layer.fp32 else "tf32",
                num_warps=t.num_warps,
                num_stages=t.num_stages,
            ),
        )
        reduce = None
        if merge_kernel:
            # rows merge fewer splits than the most: per step (a CUDA-graph plan), per
            # request (fixed key ranges)
            narrow = plan.trim_splits or plan.dynamic_splits
            split_pad = next_power_of_2(plan.num_splits)
            block_h, reduce_warps = reduce_tile(
                split_pad, layer.head_pad, s.num_heads, plan.ordered_reduction
            )
            reduce = KernelLaunch(
                reduce_splits_kernel,
                (num_tokens, cdiv(s.num_heads, block_h)),
                dict(
                    PartAcc=acc,
                    PartMax=stat_max,
                    PartSum=stat_sum,
                    Sinks=unused,
                    QueryStartLoc=qsl,
                    SeqLens=seq_lens,
                    NumSplits=num_splits,
                    num_seqs=num_reqs,
                    num_heads=s.num_heads,
                    num_splits=plan.num_splits,
                    keys_per_split=plan.tiles_per_split * t.tile_n,
                    stride_pt=acc_strides[0],
                    stride_ph=acc_strides[1],
                    stride_ps=acc_strides[2],
                    stride_mt=stat_strides[0],
                    stride_mh=stat_strides[1],
                    HEAD_SIZE=s.head_size,
                    HEAD_PAD=layer.head_pad,
                    SPLIT_PAD=split_pad,
                    BLOCK_H=block_h,
                    MIN_WIDTH=min(split_pad, REDUCE_MIN_WIDTH) if narrow else split_pad,
                    # (one width: the tile of the grid's BLOCK_H heads)
                    REDUCE_VALUES=(
                        REDUCE_TILE_VALUES if narrow else block_h * split_pad * layer.head_pad
                    ),
                    ORDERED=plan.ordered_reduction,
                    DYNAMIC_SPLITS=plan.dynamic_splits,
                    TRIM_SPLITS=plan.trim_splits,
                    CAUSAL=s.causal,
                    WAIT_FOR_PRIMARY=self.programmatic,
                    # (a CUDA-graph plan's: each step's choice, in NumSplits)
                    SKIP_MERGED=merge_last,
                    num_warps=reduce_warps,
                    # Triton's interpreter takes no launch_pdl
                    **({"launch_pdl": True} if self.programmatic else {}),
                ),
            )
        return PartLaunches(part.first, part.end, plan, attention, reduce, gluon, role, choice)
