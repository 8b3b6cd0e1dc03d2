"""pagedkv.toolkit.dispatch: a compiled variant is launched directly once Triton's
dispatch has found it, and only for arguments that specialise the same way."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import pytest
import torch
from pagedkv.toolkit import dispatch
from pagedkv.toolkit.dispatch import LaunchArgs, launch, launch_value, specialization
from pagedkv.toolkit.interpreter import interpreting


@dataclass
class _Param:
    name: str
    is_constexpr: bool


@dataclass
class _Compiled:
    """Triton's CompiledKernel as the dispatch sees it: run(grid, stream, ..., *args)."""

    ran: list = field(default_factory=list)
    function: object = "fn"
    packed_metadata: object = "meta"

    def run(self, g0, g1, g2, stream, function, packed, launch_metadata, enter, exit_, *args):
        self.ran.append(((g0, g1, g2), stream, args))

    def launch_metadata(self, grid, stream, *args):
        return None


class _Kernel:
    """A JIT kernel of (X, n, stride, BLOCK: constexpr, scale=2.0) whose dispatch
    returns one compiled variant per specialisation of its arguments."""

    def __init__(self) -> None:
        def kernel(X, n, stride, BLOCK, scale=2.0):
            pass

        self.signature = inspect.signature(kernel)
        self.params = [_Param(n, n == "BLOCK") for n in self.signature.parameters]
        self.dispatched: list[dict] = []
        self.variants: dict = {}

    def __getitem__(self, grid):
        def run(**kwargs):
            self.dispatched.append(kwargs)
            key = (kwargs["BLOCK"], specialization(kwargs["X"]), specialization(kwargs["n"]))
            return self.variants.setdefault(key, _Compiled())

        return run


@pytest.fixture(autouse=True)
def _no_gpu_stream(monkeypatch):
    monkeypatch.setattr(dispatch, "current_stream", lambda: 7)
    monkeypatch.setattr(dispatch, "_VARIANTS", {})


def test_second_call_skips_the_dispatch_with_every_argument_in_place():
    kernel, x, y = _Kernel(), torch.zeros(8), torch.zeros(8)
    step = LaunchArgs({"n": 32, "num_warps": 4})
    layer = LaunchArgs({"BLOCK": 64})
    assert launch(kernel, (3, 2), (step, layer), {"X": x, "stride": 5}) is not None
    assert len(kernel.dispatched) == 1
    assert launch(kernel, (3, 2), (step, layer), {"X": y, "stride": 7}) is None
    assert len(kernel.dispatched) == 1  # the variant was known: launched directly
    (compiled,) = kernel.variants.values()
    grid, stream, args = compiled.ran[0]
    # every parameter in the kernel's order, the default where nothing was given, a
    # tensor as its address (the launcher then asks the driver nothing)
    assert grid == (3, 2, 1) and stream == 7 and args == (y.data_ptr(), 32, 7, 64, 2.0)
    # a stream given: launched there, by its handle (the current stream stays current)
    side = type("Stream", (), {"cuda_stream": 11})()
    launch(kernel, (3, 2), (step, layer), {"X": y, "stride": 7}, stream=side)
    assert compiled.ran[-1][1] == 11


def test_a_layer_group_swapped_in_lays_the_arguments_out_again():
    """The step's group keeps a layout per combination of the groups after it: another
    layer's group (or another cache's) with the same specialisation puts its own values
    in place."""
    kernel, x = _Kernel(), torch.zeros(8)
    step = LaunchArgs({"stride": 3})
    ran = []
    for n in (32, 48, 32):  # 48 specialises as 32: no new dispatch, its own value
        layer = LaunchArgs({"n": n, "BLOCK": 64})
        for _ in range(2):
            launch(kernel, (1,), (step, layer), {"X": x})
        (compiled,) = kernel.variants.values()
        ran.append(compiled.ran[-1][2])
    assert len(kernel.dispatched) == 1
    assert [args[1] for args in ran] == [32, 48, 32]
    assert all(args == (x.data_ptr(), args[1], 3, 64, 2.0) for args in ran)


@dataclass
class _Descriptor:
    """A host TMA descriptor as Triton's (and Gluon's) TensorDescriptor holds it."""

    base: torch.Tensor
    shape: list
    strides: list
    block_shape: list
    layout: str = "swizzle128"
    padding: str = "zero"


def test_a_tma_descriptor_is_keyed_by_what_triton_specialises_and_kept_as_it_is():
    kernel, x = _Kernel(), torch.zeros(64)
    desc = _Descriptor(torch.zeros(256, 32), [256, 32], [32, 1], [16, 32])
    layer = LaunchArgs({"n": desc, "BLOCK": 64})
    for _ in range(2):
        launch(kernel, (1,), (LaunchArgs({"stride": 3}), layer), {"X": x})
    assert len(kernel.dispatched) == 1  # keyed: the second launch was direct
    (compiled,) = kernel.variants.values()
    assert compiled.ran[-1][2][1] is desc  # the launcher expands the descriptor itself
    key = specialization(desc)
    for other in (
        _Descriptor(desc.base.half(), [256, 32], [32, 1], [16, 32]),
        _Descriptor(desc.base, [256, 32], [32, 1], [32, 32]),
        _Descriptor(desc.base, [256, 32], [32, 1], [16, 32], layout="swizzle64"),
        _Descriptor(desc.base, [256, 32], [32, 1], [16, 32], padding="nan"),
        _Descriptor(desc.base, [257, 32], [32, 1], [16, 32]),
    ):
        assert specialization(other) != key, other


def test_a_differently_specialised_argument_goes_through_triton_again():
    kernel = _Kernel()
    step, layer = LaunchArgs({"n": 32}), LaunchArgs({"BLOCK": 64})
    x = torch.zeros(64)
    launch(kernel, (1,), (step, layer), {"X": x, "stride": 16})
    launch(kernel, (1,), (step, layer), {"X": x[1:], "stride": 16})  # not 16-byte aligned
    launch(kernel, (1,), (step, layer), {"X": x, "stride": 1})  # == 1 is specialised
    launch(kernel, (1,), (step, layer), {"X": x.half(), "stride": 16})  # another dtype
    launch(kernel, (1,), (LaunchArgs({"n": 32}), LaunchArgs({"BLOCK": 32})),
           {"X": x, "stride": 16})  # another constexpr  # fmt: skip
    assert len(kernel.dispatched) == 5
    launch(kernel, (1,), (LaunchArgs({"n": 48}), layer), {"X": x, "stride": 32})
    assert len(kernel.dispatched) == 5  # 48 and 32 specialise as 32 and 16 do


def test_what_cannot_be_keyed_always_takes_the_dispatch():
    kernel, x = _Kernel(), torch.zeros(8)
    opaque = LaunchArgs({"n": 32, "BLOCK": 64, "stride": object()})  # a TMA descriptor, say
    for _ in range(2):
        launch(kernel, (1,), (opaque,), {"X": x})
    # a constexpr among the per-call arguments: keyed by value only in a shared group
    for _ in range(2):
        launch(kernel, (1,), (LaunchArgs({"n": 32, "stride": 1}),), {"X": x, "BLOCK": 64})
    assert len(kernel.dispatched) == 4


def test_specialization_is_never_coarser_than_tritons():
    assert specialization(1) != specialization(17)  # == 1
    assert specialization(16) != specialization(17)  # % 16
    assert specialization(2**31) != specialization(16)  # 64-bit
    assert specialization(True) != specialization(1)
    t = torch.zeros(4, dtype=torch.float32)
    assert specialization(t) != specialization(t.half()) != specialization(t[1:])


def _source_params(kernel):
    """A kernel's parameters read from its source (Triton's interpreter has no compiled
    variants to read them from)."""
    signature = inspect.signature(kernel.fn)
    names = tuple(signature.parameters)
    return dispatch._Params(
        names,
        {n: i for i, n in enumerate(names)},
        frozenset(n for n, p in signature.parameters.items() if "constexpr" in str(p.annotation)),
        tuple(None if p.default is p.empty else p.default for p in signature.parameters.values()),
    )  # fmt: skip


def _two_forwards(monkeypatch, forward, launches: int) -> None:
    """``forward(output)`` twice: the first forward's ``launches`` launches go through
    Triton's dispatch (recorded), the second's go direct; each direct launch must pass,
    in the kernel's parameter order, exactly what the first gave the dispatch (tensors
    as their addresses, defaults where nothing was given), but for its own output."""
    dispatched, variants = [], {}

    def dispatch_once(kernel, grid, shared, call, stream=None):
        kwargs = {k: v for g in shared for k, v in g.values.items()} | dict(call)
        dispatched.append((kernel, kwargs))
        return variants.setdefault(len(dispatched), _Compiled())

    monkeypatch.setattr(dispatch, "_params", _source_params)
    monkeypatch.setattr(dispatch, "_dispatch", dispatch_once)
    forward()
    assert len(dispatched) == launches  # every launch's first call: Triton's dispatch
    out = forward()
    assert len(dispatched) == launches  # the second: direct
    for index, (kernel, kwargs) in enumerate(dispatched, start=1):
        params = _source_params(kernel)
        expected = tuple(
            launch_value(kwargs[n]) if n in kwargs else params.defaults[i]
            for i, n in enumerate(params.names)
        )
        ran = variants[index].ran[-1][2]
        # the second forward's own output: its address where the first one's was (a
        # one-split kernel also takes it for its untouched partials)
        outs = [i for i, n in enumerate(params.names) if kwargs.get(n) is kwargs["Out"]]
        expected = tuple(out.data_ptr() if i in outs else v for i, v in enumerate(expected))
        assert ran == expected, kernel


def _contiguous_step(seq_lens: list[int], query_lens: list[int], block_size: int = 16):
    """(a step whose requests' blocks follow each other from block 1, the blocks its
    cache needs)."""
    from pagedkv import CommonAttentionMetadata

    tables, first = [], 1
    for n in seq_lens:
        tables.append(list(range(first, first + -(-n // block_size))))
        first += len(tables[-1])
    return CommonAttentionMetadata.from_requests(seq_lens, query_lens, tables, block_size), first


NEEDS_INTERPRETER = pytest.mark.skipif(
    not interpreting(),
    reason="plans a CPU step, which needs Triton's interpreter (a GPU host runs "
    "the backends' GPU tests' direct launches instead)",
)


@NEEDS_INTERPRETER
def test_a_direct_launch_passes_what_tritons_dispatch_binds(monkeypatch):
    """The triton backend's real launches (a mixed step: split decodes and a chunk, each
    an attention and a reduction)."""
    import pagedkv
    from pagedkv import AttentionSpec

    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=32, dtype=torch.float16,
                         block_size=16)  # fmt: skip
    seq_lens, query_lens = [4000, 40, 900, 3000], [1, 1, 1, 64]
    common, first = _contiguous_step(seq_lens, query_lens)
    backend = pagedkv.get_backend("triton")
    md = backend.make_builder(spec, "cpu").build(common)
    assert len(md.parts) == 2 and all(p.reduce is not None for p in md.parts), md.describe()
    impl, cache = backend.make_impl(spec), backend.allocate_kv_cache(first, spec, "cpu")
    query = torch.randn(common.num_actual_tokens, 8, 32).half()

    def forward():
        out = torch.empty_like(query)
        impl.forward(query, None, None, cache, md, out)
        return out

    _two_forwards(monkeypatch, forward, 4)


@NEEDS_INTERPRETER
def test_a_steps_layers_share_its_layout_and_launch_their_own_tensors(monkeypatch):
    """Two layers of one shape (their own caches and sinks) over one step: they share
    one group of layer arguments, so the step's launches are laid out once for both,
    and each layer's direct launches pass its own cache views and sinks."""
    import pagedkv
    from pagedkv import AttentionSpec

    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=32, dtype=torch.float16,
                         block_size=16, use_sinks=True)  # fmt: skip
    seq_lens, query_lens = [4000, 40, 900], [1, 1, 1]
    common, first = _contiguous_step(seq_lens, query_lens)
    backend = pagedkv.get_backend("triton")
    md = backend.make_builder(spec, "cpu").build(common, num_splits=3)
    (part,) = md.parts
    assert part.reduce is not None
    layers = [
        (
            backend.make_impl(spec, sinks=torch.full((8,), float(i))),
            backend.allocate_kv_cache(first, spec, "cpu"),
        )
        for i in range(2)
    ]
    query = torch.randn(common.num_actual_tokens, 8, 32).half()
    out = torch.empty_like(query)
    compiled = {}

    def dispatch_once(kernel, grid, shared, call, stream=None):
        return compiled.setdefault(kernel, _Compiled())

    monkeypatch.setattr(dispatch, "_params", _source_params)
    monkeypatch.setattr(dispatch, "_dispatch", dispatch_once)
    for impl, cache in layers:  # the variants found (Triton's dispatch)
        impl.forward(query, None, None, cache, md, out)
    placed = {k: list(v) for k, v in part.attention._shared._placed.items()}
    for impl, cache in layers:
        impl.forward(query, None, None, cache, md, out)
    shared = [impl._layer_launch_args(query.device, cache) for impl, cache in layers]
    assert shared[0].attention is shared[1].attention and shared[0].reduce is shared[1].reduce
    # the step's group was placed once, and its layout is the one both layers found
    assert {k: list(v) for k, v in part.attention._shared._placed.items()} == placed
    (layout,) = part.attention._shared._layouts.values()  # one for both layers
    assert layout[0] == (shared[0].attention,)
    for kernel in (part.attention.kernel, part.reduce.kernel):
        params = _source_params(kernel)
        runs = compiled[kernel].ran[-2:]  # the second round: layer 0, then layer 1
        for (layer_impl, layer_cache), (_, _, args) in zip(layers, runs, strict=True):
            sinks = args[params.index["Sinks"]]
            assert sinks == layer_impl._layer_args(query.device)[0]["Sinks"].data_ptr()
            if "KCache" in params.index:
                k_view, _ = layer_impl.layout().logical(layer_cache, spec)
                assert args[params.index["KCache"]] == k_view.data_ptr()


@NEEDS_INTERPRETER
def test_alternating_kinds_of_layer_keep_a_layout_each(monkeypatch):
    """A sliding window every other layer (one plan serves both kinds): the step keeps
    one layout per kind, and each layer's launch passes its own window."""
    import dataclasses

    import pagedkv
    from pagedkv import AttentionSpec

    full = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=32, dtype=torch.float16,
                         block_size=16)  # fmt: skip
    windowed = dataclasses.replace(full, sliding_window=64)
    common, blocks = _contiguous_step([700, 40, 300], [1, 1, 1])
    backend = pagedkv.get_backend("triton")
    md = backend.make_builder(full, "cpu").build(common)
    layers = [
        (backend.make_impl(spec), backend.allocate_kv_cache(blocks, spec, "cpu"))
        for spec in (full, windowed, full, windowed)
    ]
    query = torch.randn(common.num_actual_tokens, 8, 32).half()
    out = torch.empty_like(query)
    compiled = {}
    monkeypatch.setattr(dispatch, "_params", _source_params)
    monkeypatch.setattr(
        dispatch, "_dispatch", lambda kernel, *a, **k: compiled.setdefault(kernel, _Compiled())
    )
    for _ in range(2):
        for impl, cache in layers:
            impl.forward(query, None, None, cache, md, out)
    (part,) = md.parts
    assert len(part.attention._shared._layouts) == 2
    params = _source_params(part.attention.kernel)
    runs = compiled[part.attention.kernel].ran[-4:]
    assert [args[params.index["window"]] for _, _, args in runs] == [0, 64, 0, 64]


@NEEDS_INTERPRETER
@pytest.mark.parametrize(
    ("options", "launches"),
    [({}, 1), ({"num_splits": 3}, 2), ({"num_splits": 3, "use_tma": False}, 2)],
)
def test_a_direct_mla_launch_passes_what_tritons_dispatch_binds(monkeypatch, options, launches):
    """The MLA backend's launches: one split (the attention alone, its partials' pointers
    the output) or three (attention and reduction), the layer's group (the cache, its
    descriptors or strides, CAUSAL) and the forward's arguments."""
    from pagedkv import AttentionSpec

    spec = AttentionSpec(num_heads=32, num_kv_heads=1, head_size=80, dtype=torch.float16,
                         block_size=16, scale=0.3, kv_lora_rank=64, qk_rope_head_dim=16)  # fmt: skip
    seq_lens, query_lens = [1200, 30, 600], [1, 4, 1]
    common, first = _contiguous_step(seq_lens, query_lens)
    from pagedkv.backends.mla import MLABackend

    backend = MLABackend(**options)
    md = backend.make_builder(spec, "cpu").build(common)
    assert (md.plan.reduce is not None) == (launches == 2), md.describe()
    impl, cache = backend.make_impl(spec), backend.allocate_kv_cache(first, spec, "cpu")
    query = torch.randn(common.num_actual_tokens, 32, 80).half()

    def forward():
        out = torch.empty(query.shape[0], 32, 64, dtype=torch.float16)
        impl.forward(query, None, None, cache, md, out)
        return out

    _two_forwards(monkeypatch, forward, launches)


def test_a_call_entry_is_the_specialization_and_the_launch_value(monkeypatch):
    """The per-call fast path (a tensor's address read once, an int's key looked up)
    gives what ``specialization`` and ``launch_value`` give, for every kind of value,
    and its cache of ints stays bounded."""
    base = torch.empty(64, dtype=torch.float16)
    values = [
        base, base[1:], torch.empty(3, dtype=torch.int32),
        1, 16, 17, 0, -5, 2**31, 2**31 - 1, 2**63, True, False, 2.5, None,
    ]  # fmt: skip
    for value in values:
        for _ in range(2):  # the first call fills the cache of ints, the second reads it
            assert dispatch.call_entry(value) == (specialization(value), launch_value(value))
    monkeypatch.setattr(dispatch, "_INT_SPECS_MAX", 4)
    for n in range(40):
        assert dispatch.call_entry(n)[0] == specialization(n)
    assert len(dispatch._INT_SPECS) <= 4


class CudaLauncher:
    """Triton's CUDA launcher as a variant's ``run``: ``__call__`` allocates the scratch
    memory (none here) and passes everything on to the C entry point ``launch``."""

    def __init__(self, global_scratch_size: int = 0) -> None:
        self.global_scratch_size = global_scratch_size
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = True
        self.c_calls: list[tuple] = []
        self.py_calls: list[tuple] = []

    def launch(self, *args):
        self.c_calls.append(args)

    def __call__(self, g0, g1, g2, stream, function, *args):
        self.py_calls.append((g0, g1, g2, stream, function, *args))


class _HookChain:
    """Triton 3.5+'s chain of launch hooks (passed to the launcher even when empty)."""

    def __init__(self, *calls):
        self.calls = list(calls)

    def __call__(self, metadata):
        for call in self.calls:
            call(metadata)


def _launched_twice(run, monkeypatch, enter=None, exit_=None):
    """A kernel whose variant's ``run`` is ``run``, launched twice (dispatched, then direct)."""
    kernel, x = _Kernel(), torch.zeros(8)
    knobs = type("Knobs", (), {"launch_enter_hook": enter, "launch_exit_hook": exit_})()
    monkeypatch.setattr(dispatch, "_runtime_knobs", lambda: knobs)
    compiled = _Compiled()
    compiled.run = run
    compiled.launch_metadata = lambda grid, stream, *args: ("metadata", grid)
    kernel.variants[(64, specialization(x), specialization(32))] = compiled
    step, layer = LaunchArgs({"n": 32}), LaunchArgs({"BLOCK": 64})
    for _ in range(2):
        launch(kernel, (3,), (step, layer), {"X": x, "stride": 5})
    return x


def test_a_direct_launch_calls_tritons_c_launcher_with_what_its_wrapper_passes(monkeypatch):
    """Triton's CUDA launcher with no scratch memory and no launch hook (or an empty chain
    of them): the C entry point itself, with the arguments ``CudaLauncher.__call__``
    would have given it (no scratch, no launch metadata, no hooks)."""
    for hooks in ((None, None), (_HookChain(), _HookChain())):
        run = CudaLauncher()
        x = _launched_twice(run, monkeypatch, *hooks)
        assert run.py_calls == []
        assert run.c_calls == [
            (3, 1, 1, 7, "fn", False, True, None, None, "meta", None, None, None,
             x.data_ptr(), 32, 5, 64, 2.0),
        ]  # fmt: skip


def test_a_launch_hook_or_scratch_memory_takes_the_launchers_own_call(monkeypatch):
    seen = []
    hook = _HookChain(seen.append)
    run = CudaLauncher()
    x = _launched_twice(run, monkeypatch, enter=hook, exit_=_HookChain())
    assert run.c_calls == []
    (call,) = run.py_calls  # the hook's metadata built, the hooks passed on
    assert call[:9] == (3, 1, 1, 7, "fn", "meta", ("metadata", (3, 1, 1)), hook, call[8])
    assert call[9:] == (x.data_ptr(), 32, 5, 64, 2.0)
    run = CudaLauncher(global_scratch_size=128)  # the wrapper allocates it
    _launched_twice(run, monkeypatch)
    assert run.c_calls == [] and len(run.py_calls) == 1
    assert run.py_calls[0][5:9] == ("meta", None, None, None)


def test_call_args_are_found_once_for_every_launch_that_takes_them():
    kernel, x = _Kernel(), torch.zeros(8)
    call = dispatch.CallArgs({"X": x, "stride": 5})
    step, layer = LaunchArgs({"n": 32}), LaunchArgs({"BLOCK": 64})
    for _ in range(3):
        launch(kernel, (1,), (step, layer), call)
    assert len(kernel.dispatched) == 1
    (compiled,) = kernel.variants.values()
    assert compiled.ran[-1][2] == (x.data_ptr(), 32, 5, 64, 2.0)
    # a subset keeps each argument's specialisation and value, and keys like a fresh one
    part = call.subset(("stride",))
    fresh = dispatch.CallArgs({"stride": 5})
    assert (part.names, part.specs, part.values, part.key, dict(part.mapping)) == (
        fresh.names, fresh.specs, fresh.values, fresh.key, dict(fresh.mapping),
    )  # fmt: skip
    assert dispatch.CallArgs({"X": x[1:], "stride": 5}).key != call.key
    # extended by a layer's arguments: as a fresh call of both, and its subsets too
    fixed = dispatch.CallArgs({"W": torch.zeros(4, dtype=torch.float16)})
    extended, both = call.extended(fixed), dispatch.CallArgs({**call.mapping, **fixed.mapping})
    assert (extended.names, extended.specs, extended.values, extended.key) == (
        both.names, both.specs, both.values, both.key,
    )  # fmt: skip
    assert dict(extended.mapping) == dict(both.mapping)
    picked = extended.subset(("W", "X"))
    assert dict(picked.mapping) == {"W": fixed.mapping["W"], "X": x}
    assert call.extended(fixed).key == extended.key


def test_a_direct_launch_encodes_each_tma_descriptor_once_per_address_and_shape(monkeypatch):
    """Triton's launcher for a kernel of host TMA descriptors is a wrapper that encodes
    each one at every launch; a direct launch calls the wrapper's C launcher with the
    same arguments, each descriptor encoded once per (address, shape, strides)."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    from triton.tools.tensor_descriptor import TensorDescriptor

    encoded = []

    def encode(desc, metadata):  # Triton's make_tensordesc_arg: a CUtensorMap, shape, strides
        encoded.append((desc.base.data_ptr(), metadata))
        return [("map", desc.base.data_ptr(), metadata), *desc.shape, *desc.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    passed = []

    def c_launcher(*args):
        passed.append(args)

    signature = {0: "*bf16", 1: "tensordesc<bf16[16, 16]>", 2: "i32", 3: "tensordesc<bf16[8, 16]>"}
    wrapper = driver.wrap_handle_tensordesc(c_launcher, signature, [{"m": 1}, {"m": 2}])
    descriptors = dispatch._Descriptors.unwrap(wrapper)
    assert descriptors is not None and descriptors.indices == (1, 3)
    x, y = torch.zeros(32, 16, dtype=torch.bfloat16), torch.zeros(64, 16, dtype=torch.bfloat16)
    first = TensorDescriptor.from_tensor(x, [16, 16])
    second = TensorDescriptor.from_tensor(y, [8, 16])
    base = tuple(range(driver._BASE_ARGS_FORMAT_LEN))
    args = [123, first, 7, second]
    wrapper(*base, *args)  # what Triton's wrapper gives its C launcher
    encoded.clear()
    assert base + tuple(descriptors.expand(args)) == passed[0]
    assert len(encoded) == 2
    descriptors.expand([5, TensorDescriptor.from_tensor(x, [16, 16]), 9, second])
    assert len(encoded) == 2  # the same address, shape and strides: kept
    descriptors.expand([5, TensorDescriptor.from_tensor(x[16:], [16, 16]), 9, second])
    assert encoded[2:] == [(x[16:].data_ptr(), {"m": 1})]  # another address: encoded
    # a variant launched directly calls the C launcher itself
    run = CudaLauncher()
    run.launch = wrapper
    compiled = _Compiled()
    compiled.run = run
    variant = dispatch.CompiledLaunch(compiled)
    assert variant.descriptors is not None and variant.c_launch is c_launcher
    variant.launch((4,), args, 7)
    assert passed[-1] == (4, 1, 1, 7, *variant.fixed, *descriptors.expand(args))
    # another wrapper (not Triton's) is called as it is
    assert dispatch._Descriptors.unwrap(lambda *args: None) is None


@NEEDS_INTERPRETER
def test_a_direct_kv_write_passes_what_tritons_dispatch_binds(monkeypatch):
    """The Triton KV write (its constants and its cache's geometry as groups, the rows,
    slots and views per call): the first write goes through Triton's dispatch with what
    ``plan_write_kv`` plans, the second directly with the same values but its own rows."""
    import pagedkv
    from pagedkv import AttentionSpec
    from pagedkv.toolkit.triton_kv_write import (
        CacheWriter,
        plan_write_kv,
        write_kv_kernel,
        write_kv_triton,
    )

    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=32, dtype=torch.float16,
                         block_size=16)  # fmt: skip
    common, first = _contiguous_step([40, 7], [5, 7])
    backend = pagedkv.get_backend("triton")
    views = backend.make_impl(spec).cache_views(backend.allocate_kv_cache(first, spec, "cpu"))
    slots = common.slot_mapping
    rows = [torch.randn(common.num_tokens, 2, 32).half() for _ in range(4)]
    dispatched, variants = [], {}

    def dispatch_once(kernel, grid, shared, call, stream=None):
        kwargs = {k: v for g in shared for k, v in g.values.items()} | dict(call)
        dispatched.append((kernel, tuple(grid), kwargs))
        return variants.setdefault(len(dispatched), _Compiled())

    monkeypatch.setattr(dispatch, "_params", _source_params)
    monkeypatch.setattr(dispatch, "_dispatch", dispatch_once)
    write_kv_triton(rows[0], rows[1], views.k, views.v, slots, 0.5, 2.0)
    planned = plan_write_kv(rows[0], rows[1], views.k, views.v, slots, 0.5, 2.0)
    assert len(dispatched) == 1
    kernel, grid, kwargs = dispatched[0]
    assert kernel is write_kv_kernel and grid == planned.grid and kwargs == planned.kwargs
    write_kv_triton(rows[2], rows[3], views.k, views.v, slots, 0.5, 2.0)
    assert len(dispatched) == 1  # the second write: direct
    params = _source_params(write_kv_kernel)
    given = {**kwargs, "Key": rows[2], "Value": rows[3]}
    expected = tuple(
        launch_value(given[n]) if n in given else params.defaults[i]
        for i, n in enumerate(params.names)
    )
    assert variants[1].ran[-1][0] == (*planned.grid, 1, 1)
    assert variants[1].ran[-1][2] == expected
    # a writer kept for the views (``AttentionImpl.cache_writer``): the same launch
    writer = CacheWriter(views.k, views.v, 0.5, 2.0)
    for _ in range(2):
        writer(rows[2], rows[3], slots)
        assert len(dispatched) == 1 and variants[1].ran[-1][2] == expected
