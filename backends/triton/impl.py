"""The Triton backend's attention: the builder's launch templates, completed with one
layer's tensors, then launched.

Everything that depends only on the step was planned by the builder, everything
that depends only on the layer (its scalars, sinks, ALiBi slopes, the geometry of
its cache views) is computed once here; a forward adds the query, the output and
the cache and launches, without syncing the host or allocating (CUDA-graph
capturable once each kernel has been compiled by a first, uncaptured call).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from pagedkv.backend import AttentionImpl, CacheViews
from pagedkv.backends.triton.builder import TritonMetadata
from pagedkv.backends.triton.configs import LayerShape
from pagedkv.backends.triton.gluon_plan import (
    call_args,
    gluon_cache_args,
    gluon_cache_problem,
    gluon_layer_args,
)
from pagedkv.errors import UnsupportedError
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.dispatch import CallArgs, LaunchArgs, layer_groups
from pagedkv.toolkit.launch import KernelLaunch
from pagedkv.toolkit.triton_helpers import LOG2E


class TritonAttentionImpl(AttentionImpl[TritonMetadata]):
    def __init__(
        self, spec: AttentionSpec, *, sinks: torch.Tensor | None = None, **options: Any
    ) -> None:
        super().__init__(spec, sinks=sinks, **options)
        self.layer = LayerShape.of(spec)
        s = spec
        # only an fp8 cache stores x / scale (docs/contract.md): a 16-bit one is read as is
        k_scale, v_scale = (s.k_scale, s.v_scale) if s.is_fp8_kv else (1.0, 1.0)
        # the layer's part of the launches, without its device tensors
        self._attention_args: dict[str, Any] = dict(
            qk_scale=s.scale * k_scale * (1.0 if s.logits_soft_cap else LOG2E),
            softcap=float(s.logits_soft_cap or 0.0),
            v_scale=float(v_scale),
            window=int(s.sliding_window or 0),
            CAUSAL=s.causal,
            USE_WINDOW=s.sliding_window is not None,
            USE_SOFTCAP=s.logits_soft_cap is not None,
            USE_ALIBI=s.alibi_slopes is not None,
            USE_SINKS=sinks is not None,
        )
        self._reduce_args: dict[str, Any] = dict(USE_SINKS=sinks is not None)
        # per device: the layer's arguments with its sinks / ALiBi slopes there
        self._by_device: dict[torch.device, tuple[dict[str, Any], dict[str, Any]]] = {}
        self._gluon_layer_args = gluon_layer_args(spec)
        # a two-part step's parts run on two streams (``_attend_overlapped``)
        self.overlap_parts = options.get("overlap_parts", True) is not False

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonMetadata,
        output: torch.Tensor,
    ) -> None:
        # the launches skip Triton's per-call dispatch once their variant is known: the
        # step's and the layer's arguments are specialised once, the forward's at each call
        if len(metadata.parts) == 2 and self.overlap_parts and query.is_cuda:
            self._attend_overlapped(query, kv_cache, metadata, output)
            return
        for _, template, layer, call in self._launches(query, kv_cache, metadata, output):
            template.run_with(*layer, call=call)

    def _attend_overlapped(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonMetadata,
        output: torch.Tensor,
    ) -> None:
        """A two-part step (decodes and longer requests) with its parts on two streams:
        the decodes stream the cache (memory-bound), the longer requests' queries keep
        the tensor cores busy (compute-bound), so each runs in what the other leaves of
        the SMs. The longer part goes first, on a stream of higher priority, so that its
        programs are placed first; the caller's stream waits for both (CUDA graphs
        capture the fork and the join). The launches come longer part first, so its
        launch leaves the host before the decodes' arguments are found (an eager step's
        host time is on its critical path where the longer part is the longer kernel),
        and the join is recorded after the side stream's last launch."""
        device = query.device
        launches = self._launches(query, kv_cache, metadata, output, longer_first=True)
        side_stream = _SIDE_STREAMS.get(device)
        if side_stream is None:  # one per device, for every layer and step
            side_stream = _SIDE_STREAMS[device] = _SideStream(device)
        # the current device's stream, where the kernels launch (Triton's dispatch too)
        main = side_stream.current()
        side, forked, joined = side_stream.stream, side_stream.forked, side_stream.joined
        # the events' own methods: torch.cuda.Event's wrappers only add a Python frame
        record, wait = torch._C._CudaEventBase.record, torch._C._CudaEventBase.wait
        record(forked, main)
        wait(forked, side)
        joined_recorded = False
        for part, template, layer, call in launches:
            if part == 1:  # the longer requests, on the side stream (not made current)
                template.run_with(*layer, call=call, stream=side)
                continue
            if not joined_recorded:  # after the side stream's last launch
                record(joined, side)
                joined_recorded = True
            template.run_with(*layer, call=call)
        if not joined_recorded:
            record(joined, side)
        wait(joined, main)

    def plan(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonMetadata,
        output: torch.Tensor,
    ) -> list[KernelLaunch]:
        """The launches of one forward (the KV write excluded), planned, not run."""
        launches = []
        for _, template, layer, call in self._launches(query, kv_cache, metadata, output):
            kwargs = dict(template.kwargs)
            for group in layer:
                kwargs.update(group.values)
            launches.append(
                KernelLaunch(template.kernel, template.grid, {**kwargs, **call.mapping})
            )
        return launches

    def _launches(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonMetadata,
        output: torch.Tensor,
        longer_first: bool = False,
    ) -> Iterator[tuple[int, KernelLaunch, tuple[LaunchArgs, ...], CallArgs]]:
        """One forward's launches: (the part's index, the step's template, the layer's
        arguments, the forward's own arguments), in the parts' order or, with
        ``longer_first``, a two-part step's longer part first."""
        md = metadata
        if md.layer is not self.layer and md.layer != self.layer:
            raise UnsupportedError(
                f"metadata: planned for {md.layer.describe()}, but this layer is "
                f"{self.layer.describe()} (build it with a builder for this layer's spec)"
            )
        # the forward's own arguments, the same names in every kernel (strides checked),
        # specialised once for all of the forward's launches
        forward_call = CallArgs(call_args(query, output))
        portable_call = reduce_call = None
        # parts planned for the Gluon kernel take it, unless TMA cannot read this cache
        gluon_layer = None
        if any(part.gluon is not None for part in md.parts):
            gluon_layer = self._gluon_launch_args(kv_cache)
        layer_args = None
        parts = enumerate(md.parts)
        for index, part in reversed(tuple(parts)) if longer_first else parts:
            if part.gluon is not None and gluon_layer is not None:
                yield index, part.gluon.template, (gluon_layer,), forward_call
                continue
            if layer_args is None:
                layer_args = self._layer_launch_args(query.device, kv_cache)
                # the layer's tensors go with the forward's: the layer's other arguments
                # are then one group that every layer of its shape shares
                portable_call = forward_call.extended(layer_args.tensors)
            assert portable_call is not None
            yield index, part.attention, (layer_args.attention,), portable_call
            if part.reduce is not None:
                if reduce_call is None:
                    reduce_call = portable_call.subset(layer_args.reduce_call_names)
                yield index, part.reduce, (layer_args.reduce,), reduce_call

    # -- per layer, computed once -----------------------------------------------------

    def _layer_args(self, device: torch.device) -> tuple[dict[str, Any], dict[str, Any]]:
        args = self._by_device.get(device)
        if args is None:
            # once per device, on the first (uncaptured) forward
            tensors: dict[str, torch.Tensor] = {}
            if self.sinks is not None:
                tensors["Sinks"] = self.sinks.to(device)
            if self.spec.alibi_slopes is not None:
                tensors["AlibiSlopes"] = torch.tensor(
                    self.spec.alibi_slopes, dtype=torch.float32, device=device
                )
            reduce_tensors = {k: v for k, v in tensors.items() if k == "Sinks"}
            args = self._by_device[device] = (
                {**self._attention_args, **tensors},
                {**self._reduce_args, **reduce_tensors},
            )
        return args

    def _layer_launch_args(self, device: torch.device, kv_cache: torch.Tensor) -> _LayerArgs:
        """The layer's arguments of the attention and reduction launches over
        ``kv_cache`` (once per cache, with its views)."""
        views, memo = self._cache_args(kv_cache)
        if memo.launch_args is None or memo.launch_args[0] != device:
            attention_args, reduce_args = self._layer_args(device)
            attention, tensors = layer_groups(
                {**attention_args, **memo.strides, "KCache": views.k, "VCache": views.v},
                own=_LAYER_TENSORS,
            )
            # the merge's own tensors (sinks) are a subset of the attention's, passed
            # with the forward's call (``reduce_call_names``)
            reduce, _ = layer_groups(reduce_args, own=_LAYER_TENSORS)
            own_reduce = tuple(n for n in reduce_args if n in _LAYER_TENSORS)
            memo.launch_args = (
                device,
                _LayerArgs(
                    attention, reduce, tensors, ("Out", "stride_ot", "stride_oh", *own_reduce)
                ),
            )
        return memo.launch_args[1]

    def _cache_args(self, kv_cache: torch.Tensor) -> tuple[CacheViews, _CacheArgs]:
        """The contract's views of ``kv_cache`` and what the launches take of them, kept
        with the views (``CacheViews.derived``: dropped with them)."""
        views = self.cache_views(kv_cache)
        memo = views.derived.get("triton launches")
        if memo is None:
            ks, vs = views.k.stride(), views.v.stride()
            if ks[3] != 1 or vs[3] != 1:
                raise UnsupportedError(
                    f"kv_cache: the {self.layout().name} layout's head dimension is strided"
                )
            strides = dict(
                stride_kb=ks[0], stride_ks=ks[1], stride_kh=ks[2],
                stride_vb=vs[0], stride_vs=vs[1], stride_vh=vs[2],
            )  # fmt: skip
            memo = views.derived["triton launches"] = _CacheArgs(strides)
        return views, memo

    def _gluon_launch_args(self, kv_cache: torch.Tensor) -> LaunchArgs | None:
        """The Gluon kernel's layer arguments over ``kv_cache``, its TMA descriptors among
        them (once per cache, with its views), or None when TMA cannot read this cache
        (the portable kernel runs)."""
        views, memo = self._cache_args(kv_cache)
        if memo.gluon is _UNSET:  # the memo's K/V views: the cache's bytes, its strides
            memo.gluon = None
            if gluon_cache_problem(views.k, views.v) is None:
                descriptors = gluon_cache_args(self.spec, views.k, views.v)
                memo.gluon = LaunchArgs({**descriptors, **self._gluon_layer_args})
        return memo.gluon  # type: ignore[return-value]


_UNSET = object()


class _SideStream:
    """The stream a two-part step's longer requests run on, and the fork and join events
    (re-recorded by every step: a wait is on the event's latest record, in a capture too;
    creating and destroying two events per call cost host time)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device, priority=-1)
        self.forked, self.joined = torch.cuda.Event(), torch.cuda.Event()
        # the callers' streams by torch's (id, device, type) triple: made once each, as
        # ``torch.cuda.current_stream()`` makes a new Stream object at every call
        self._callers: dict[tuple[int, int, int], torch.cuda.Stream] = {}

    def current(self) -> torch.cuda.Stream:
        """The current device's current stream."""
        found = torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())
        stream = self._callers.get(found)
        if stream is None:
            if len(self._callers) >= 64:  # bounded: a caller may make streams per step
                self._callers.clear()
            stream = self._callers[found] = torch.cuda.Stream(
                stream_id=found[0], device_index=found[1], device_type=found[2]
            )
        return stream


_SIDE_STREAMS: dict[torch.device, _SideStream] = {}


@dataclass
class _CacheArgs:
    """What the launches take of a cache's views (kept in ``CacheViews.derived``): their
    strides, the Gluon kernel's descriptors, the layer's launch arguments."""

    strides: dict[str, int]
    # the Gluon kernel's layer arguments with its descriptors over this cache (None:
    # TMA cannot read it), made on its first Gluon step
    gluon: object = _UNSET
    # (device, the layer's arguments over these views)
    launch_args: tuple[torch.device, _LayerArgs] | None = None


# a layer's own arguments of the portable kernels: passed with each forward's
_LAYER_TENSORS = ("KCache", "VCache", "Sinks", "AlibiSlopes")


@dataclass(frozen=True)
class _LayerArgs:
    """A layer's part of the portable kernels' launches over one cache: its scalars,
    flags and cache strides (a group shared by every layer of equal values:
    ``dispatch.layer_groups``), and its tensors (the cache views, sinks, ALiBi slopes),
    which each forward passes with its own arguments."""

    attention: LaunchArgs
    reduce: LaunchArgs
    tensors: CallArgs
    reduce_call_names: tuple[str, ...]  # the merge's per-call arguments
