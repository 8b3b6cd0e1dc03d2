"""The Pallas backend on a CUDA device: which Pallas GPU lowering works, no host round
trip in forward, one compile per shape. Skipped without CUDA and a JAX GPU backend."""

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


@pytest.mark.parametrize("options", [{}, {"num_splits": 4}], ids=["auto", "split4"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_matches_reference_on_cuda(scenario, options):
    backend = pagedkv.get_backend("pallas", **options)
    result = run_scenario(backend, scenario, "cuda", backend_label=f"pallas{options or ''}")
    assert result.passed, result.report()


def _decode_step(num_reqs: int = 32, context: int = 1000, **spec_changes):
    spec = AttentionSpec(
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.bfloat16,
        block_size=16,
        **spec_changes,
    )
    backend = pagedkv.get_backend("pallas")
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


def test_forward_has_no_host_round_trip_and_compiles_once():
    from pagedkv.backends.pallas import kernel
    from pagedkv.spec import alibi_slopes

    builder, impl, common, cache, query, _ = _decode_step(
        use_sinks=True, alibi_slopes=alibi_slopes(32), logits_soft_cap=30.0
    )
    metadata = builder.build(common)
    first = impl.forward(query, None, None, cache, metadata)  # compiles (warm-up)
    compiled = kernel.jitted("triton")._cache_size()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with jax.transfer_guard("disallow"):
            again = impl.forward(query, None, None, cache, metadata)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert kernel.jitted("triton")._cache_size() == compiled
    assert torch.equal(first, again)


@pytest.mark.parametrize("stream", ["default", "side"])
def test_torch_writes_are_ordered_before_the_kernel(stream):
    """A torch write on torch's current stream (the default one, or another made
    current), then forward at once: the kernel sees it, and torch reads its result."""
    builder, impl, common, cache, query, (_, v) = _decode_step(num_reqs=4, context=64)
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


def test_jax_leaves_the_gpu_memory_to_torch():
    """The backend configured JAX before its GPU client started (the module fixture
    asks through the backend): JAX allocates on demand instead of taking 75% of the GPU."""
    builder, impl, common, cache, query, _ = _decode_step(num_reqs=4, context=64)
    impl.forward(query, None, None, cache, builder.build(common))
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    held_outside_torch = total - free - torch.cuda.memory_reserved()
    assert held_outside_torch < 0.25 * total, f"{held_outside_torch / 2**30:.1f} GiB"
