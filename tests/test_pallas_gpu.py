"""The Pallas backend on a CUDA device: which Pallas GPU lowering works, both launchers
(direct and JAX's runtime) against the reference, no host round trip in forward, one
compile per shape, the direct launcher's misaligned views and CUDA graphs. Skipped
without CUDA and a JAX GPU backend."""

from __future__ import annotations

import numpy as np
import pagedkv
import pytest
import torch
from pagedkv import AttentionSpec
from pagedkv.conformance import Scenario, run_scenario

jax = pytest.importorskip("jax")

from pagedkv.backends.pallas.backend import jax_gpu_unavailable  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", autouse=True)
def _jax_gpu():
    why = jax_gpu_unavailable()
    if why:
        pytest.skip(why)


def test_which_pallas_gpu_lowering_works(capsys):
    from pagedkv.backends.pallas import lowering

    lines = [lowering.smoke("triton"), lowering.smoke("mosaic_gpu")]
    with capsys.disabled():
        print(f"\njax {jax.__version__} on {jax.devices('gpu')[0].device_kind}:")
        for line in lines:
            print("  " + line)
    assert lines[0].startswith("triton: WORKS"), lines[0]


MIXED = dict(seq_lens=(1, 17, 33, 64, 40, 5), query_lens=(1, 17, 5, 1, 8, 0))
SCENARIOS = [
    Scenario("mixed-bf16", **MIXED, dtype=torch.bfloat16, head_size=128, num_padding_tokens=3),
    Scenario(
        "gqa5-fp32-head80", **MIXED, num_heads=10, num_kv_heads=2, head_size=80, dtype=torch.float32
    ),
    Scenario(
        "mqa-fp16-block5",
        seq_lens=(23, 9, 70),
        query_lens=(23, 1, 6),
        num_heads=8,
        num_kv_heads=1,
        block_size=5,
    ),
    Scenario(
        "everything-bf16",
        **MIXED,
        sliding_window=20,
        logits_soft_cap=30.0,
        alibi=True,
        use_sinks=True,
        dtype=torch.bfloat16,
    ),
    Scenario(
        "fp8-e4m3-long-decode",
        seq_lens=(3000, 200, 1),
        query_lens=(1, 1, 1),
        kv_cache_dtype="fp8_e4m3",
        k_scale=0.5,
        v_scale=2.0,
        dtype=torch.bfloat16,
    ),
    Scenario(
        "fp8-e5m2-prefill",
        seq_lens=(300, 129),
        query_lens=(120, 129),
        kv_cache_dtype="fp8_e5m2",
        k_scale=0.25,
        v_scale=1.5,
    ),
]


@pytest.mark.parametrize(
    "options",
    [{}, {"num_splits": 4}, {"launcher": "jax"}, {"launcher": "jax", "num_splits": 4}],
    ids=["direct", "direct-split4", "jax", "jax-split4"],
)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_matches_reference_on_cuda(scenario, options):
    backend = pagedkv.get_backend("pallas", **options)
    result = run_scenario(backend, scenario, "cuda", backend_label=f"pallas{options or ''}")
    assert result.passed, result.report()


def _decode_step(num_reqs: int = 32, context: int = 1000, options=None, **spec_changes):
    spec = AttentionSpec(
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.bfloat16,
        block_size=16,
        **spec_changes,
    )
    backend = pagedkv.get_backend("pallas", **(options or {}))
    blocks = -(-context // 16)
    rng = np.random.default_rng(0)
    ids = (rng.permutation(num_reqs * blocks) + 1).reshape(num_reqs, blocks).tolist()
    common = pagedkv.CommonAttentionMetadata.from_requests(
        [context] * num_reqs, [1] * num_reqs, ids, 16, "cuda"
    )
    cache = backend.allocate_kv_cache(1 + num_reqs * blocks, spec, "cuda")
    cache.normal_()
    sinks = torch.randn(32, device="cuda") if spec.use_sinks else None
    builder, impl = backend.make_builder(spec, "cuda"), backend.make_impl(spec, sinks=sinks)
    query = torch.randn(num_reqs, 32, 128, device="cuda", dtype=torch.bfloat16)
    return builder, impl, common, cache, query, backend.kv_cache_to_logical(cache, spec)


LAUNCHERS = pytest.mark.parametrize("launcher", ["direct", "jax"])


@LAUNCHERS
def test_forward_has_no_host_round_trip_and_compiles_once(launcher):
    from pagedkv.backends.pallas import kernel
    from pagedkv.spec import alibi_slopes

    builder, impl, common, cache, query, _ = _decode_step(
        options={"launcher": launcher},
        use_sinks=True,
        alibi_slopes=alibi_slopes(32),
        logits_soft_cap=30.0,
    )
    metadata = builder.build(common)
    assert metadata.launcher == launcher
    first = impl.forward(query, None, None, cache, metadata)  # compiles (warm-up)
    compiled = kernel.jitted("triton")._cache_size(), len(impl._direct_kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with jax.transfer_guard("disallow"):
            again = impl.forward(query, None, None, cache, metadata)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (kernel.jitted("triton")._cache_size(), len(impl._direct_kernels)) == compiled
    assert torch.equal(first, again)


@LAUNCHERS
@pytest.mark.parametrize("stream", ["default", "side"])
def test_torch_writes_are_ordered_before_the_kernel(stream, launcher):
    """A torch write on torch's current stream (the default one, or another made
    current), then forward at once: the kernel sees it, and torch reads its result."""
    builder, impl, common, cache, query, (_, v) = _decode_step(
        num_reqs=4, context=64, options={"launcher": launcher}
    )
    metadata = builder.build(common)
    before = impl.forward(query, None, None, cache, metadata).clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side if stream == "side" else torch.cuda.current_stream()):
        for _ in range(3):  # queue work on torch's stream so a missing wait would show
            cache.mul_(1.0)
        v.mul_(2.0)  # every V doubles: so does the output
        after = impl.forward(query, None, None, cache, metadata)
        doubled = after.float() / 2  # read on the same stream, right after the forward
    torch.cuda.synchronize()
    torch.testing.assert_close(doubled, before.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("num_splits", [1, 8])
def test_direct_launch_takes_misaligned_views(num_splits):
    """A query and an output at addresses the kernel's module does not allow (views 2
    bytes into their buffers): the same bits as aligned tensors."""
    builder, impl, common, cache, query, _ = _decode_step(
        num_reqs=8, context=900, options={"num_splits": num_splits}
    )
    metadata = builder.build(common)
    assert metadata.launcher == "direct" and metadata.num_splits == num_splits
    aligned = impl.forward(query, None, None, cache, metadata)
    shape = query.shape
    q_view = torch.empty(query.numel() + 1, dtype=query.dtype, device="cuda")[1:].view(shape)
    q_view.copy_(query)
    out_view = torch.empty(query.numel() + 1, dtype=query.dtype, device="cuda")[1:].view(shape)
    impl.forward(q_view, None, None, cache, metadata, output=out_view)
    assert torch.equal(out_view, aligned)


def test_direct_launch_replays_in_a_cuda_graph_across_split_counts():
    """One capture, replayed on steps whose split counts differ (a long decode, then a
    batch of short ones): each replay matches the same step run eagerly."""
    from pagedkv.graph import GraphBounds

    spec = AttentionSpec(
        num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=16
    )
    backend = pagedkv.get_backend("pallas")
    rng = np.random.default_rng(1)
    width, num_reqs = 256, 4
    cache = backend.allocate_kv_cache(1 + num_reqs * width, spec, "cuda")
    cache.normal_()
    ids = (rng.permutation(num_reqs * width) + 1).reshape(num_reqs, width)

    def step(seq_lens):
        tables = [ids[i, : -(-n // 16)].tolist() for i, n in enumerate(seq_lens)]
        return pagedkv.CommonAttentionMetadata.from_requests(
            list(seq_lens), [1] * len(seq_lens), tables, 16, "cuda"
        )

    impl = backend.make_impl(spec)
    builder, eager = backend.make_builder(spec, "cuda"), backend.make_builder(spec, "cuda")
    builder.reserve_cuda_graph(GraphBounds(num_reqs, num_reqs, width))
    query = torch.randn(num_reqs, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(query)
    first = builder.build(step([4096, 10, 3000, 7]))
    impl.forward(query, None, None, cache, first, output=out)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(query, None, None, cache, first, output=out)
    splits = []
    for seq_lens in ([4096, 10, 3000, 7], [100, 64, 33, 1], [4096, 4096, 4096, 4096]):
        md = builder.build(step(seq_lens))
        splits.append(md.num_splits)
        graph.replay()
        expected = impl.forward(query, None, None, cache, eager.build(step(seq_lens)))
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert len(set(splits)) > 1, splits  # the replays covered different split counts


def test_jax_leaves_the_gpu_memory_to_torch():
    """The backend configured JAX before its GPU client started (the module fixture
    asks through the backend): JAX allocates on demand instead of taking 75% of the GPU."""
    builder, impl, common, cache, query, _ = _decode_step(
        num_reqs=4, context=64, options={"launcher": "jax"}
    )
    impl.forward(query, None, None, cache, builder.build(common))
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    held_outside_torch = total - free - torch.cuda.memory_reserved()
    assert held_outside_torch < 0.25 * total, f"{held_outside_torch / 2**30:.1f} GiB"
