"""torch <-> JAX for the Pallas backend: views of the same memory, never copies."""

from __future__ import annotations

import pagedkv
import pytest
import torch
from pagedkv import AttentionSpec

jax = pytest.importorskip("jax")

from pagedkv.backends.pallas import interop  # noqa: E402

BACKEND = pagedkv.get_backend("pallas")


def _pointer(array) -> int:
    return array.unsafe_buffer_pointer()


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2],
)
def test_the_cache_is_viewed_not_copied(dtype):
    spec = AttentionSpec(
        num_heads=4,
        num_kv_heads=2,
        head_size=16,
        dtype=torch.float16,
        block_size=4,
        kv_cache_dtype={torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}.get(
            dtype, "auto"
        ),
    )
    spec = spec if spec.is_fp8_kv else spec.replace(dtype=dtype)
    cache = BACKEND.allocate_kv_cache(5, spec, "cpu")
    view = interop.to_jax(cache, "kv_cache")
    assert _pointer(view) == cache.data_ptr()
    assert view.shape == tuple(cache.shape) and view.dtype.itemsize == cache.element_size()
    # an in-place write through torch's logical K view shows through JAX
    k, v = BACKEND.kv_cache_to_logical(cache, spec)
    k[3, 2, 1] = 2.0
    v[3, 2, 1] = -0.5
    assert float(view[3, 2, 2, 0].astype("float32")) == 2.0
    assert float(view[3, 2, 3, 0].astype("float32")) == -0.5
    assert float(jax.numpy.abs(view.astype("float32")).sum()) == 2.5 * 16


def test_int32_metadata_is_viewed_and_int64_refused():
    table = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    assert _pointer(interop.to_jax(table, "block_table")) == table.data_ptr()
    with pytest.raises(TypeError, match="slot_mapping: dtype torch.int64 would be copied"):
        interop.to_jax(table.long(), "slot_mapping")


def test_strided_and_misaligned_tensors_are_refused_for_the_cache():
    base = torch.zeros(8, 4, 4, 16)
    with pytest.raises(ValueError, match="kv_cache: expected a contiguous tensor"):
        interop.to_jax(base[:, :, 0::2], "kv_cache")
    misaligned = torch.zeros(1 + 4 * 4 * 16 * 4)[1:].view(4, 4, 4, 16)
    with pytest.raises(ValueError, match="kv_cache: JAX cannot view this tensor without a copy"):
        interop.to_jax(misaligned, "kv_cache")
    # small per-step inputs may be copied on their device instead
    assert interop.to_jax(misaligned, "query", allow_copy=True).shape == (4, 4, 4, 16)


def test_results_come_back_to_torch_without_a_copy():
    array = jax.numpy.arange(24, dtype=jax.numpy.bfloat16).reshape(2, 3, 4)
    tensor = interop.to_torch(array)
    assert tensor.data_ptr() == _pointer(array)
    assert tensor.dtype == torch.bfloat16 and tuple(tensor.shape) == (2, 3, 4)


def test_the_cache_view_is_reused_while_the_tensor_is_the_same():
    views = interop.CacheView()
    cache = torch.zeros(4, 4, 4, 16)
    first = views.get(cache)
    assert views.get(cache) is first
    other = torch.zeros(4, 4, 4, 16)
    second = views.get(other)
    assert second is not first and _pointer(second) == other.data_ptr()


def test_forward_reads_the_torch_cache_in_place():
    """A torch write between two forwards changes the second output (no stale copy)."""
    spec = AttentionSpec(
        num_heads=2, num_kv_heads=1, head_size=16, dtype=torch.float32, block_size=4
    )
    md = BACKEND.make_builder(spec, "cpu").build(
        pagedkv.CommonAttentionMetadata.from_requests([2], [1], [[1]], 4)
    )
    impl = BACKEND.make_impl(spec)
    cache = BACKEND.allocate_kv_cache(2, spec, "cpu")
    _, v = BACKEND.kv_cache_to_logical(cache, spec)
    v[1, 0, 0] = 1.0
    v[1, 1, 0] = 3.0
    q = torch.zeros(1, 2, 16)
    # equal scores: the mean of the two value rows
    assert torch.allclose(impl.forward(q, None, None, cache, md), torch.full((1, 2, 16), 2.0))
    v[1, 1, 0] = 5.0
    assert torch.allclose(impl.forward(q, None, None, cache, md), torch.full((1, 2, 16), 3.0))


def test_the_crossings_take_jaxs_own_dlpack_calls():
    """The installed JAX has the calls beneath its public DLPack wrappers that the fast
    crossings use: if an upgrade removes them, the public path serves (slower by
    ~100 us a forward on the H200 host) and this test says so."""
    assert interop._FAST_CALLS is not None, (
        "jax._src.lib._jax lacks dlpack_managed_tensor_to_buffer / "
        "buffer_to_dlpack_managed_tensor with dl_device_type: the crossings take the public path"
    )


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "public"])
def test_both_crossings_view_the_same_memory(monkeypatch, fast):
    if not fast:  # as where JAX lacks the calls: no endpoint is made
        monkeypatch.setattr(interop, "_FAST_CALLS", None)
        monkeypatch.setattr(interop, "_ENDPOINTS", {})
    elif interop._FAST_CALLS is None:
        pytest.skip("this JAX has no fast crossing (test_the_crossings_take_jaxs_own_dlpack_calls)")
    query = torch.randn(3, 4, 16, dtype=torch.bfloat16)
    array = interop.to_jax(query, "query")
    assert _pointer(array) == query.data_ptr() and array.dtype == jax.numpy.bfloat16
    assert array.shape == (3, 4, 16)
    assert array.devices() == {jax.devices("cpu")[0]}
    doubled = array.astype(jax.numpy.float32) * 2
    back = interop.to_torch(doubled, query.device)
    assert back.data_ptr() == _pointer(doubled) and back.dtype == torch.float32
    torch.testing.assert_close(back, query.float() * 2, rtol=0, atol=0)
    # the refusals are the same on both paths
    misaligned = torch.zeros(1 + 4 * 16)[1:].view(4, 16)
    with pytest.raises(ValueError, match="kv_cache: JAX cannot view this tensor without a copy"):
        interop.to_jax(misaligned, "kv_cache")
    copied = interop.to_jax(misaligned, "query", allow_copy=True)
    assert copied.shape == (4, 16) and _pointer(copied) != misaligned.data_ptr()


def test_the_handshake_event_is_reused_per_thread(monkeypatch):
    """Each thread records and waits on its own event (reused across its crossings): a
    shared one could be re-recorded by another thread between a record and its wait."""
    import threading

    made, waits = [], []

    class Event:
        def __init__(self):
            made.append(self)

        def record(self):
            pass

    class Stream:
        def wait_event(self, event):
            waits.append((threading.get_ident(), event))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    end = interop._Endpoint(jax.devices("cpu")[0], 2, 1, Stream())
    for _ in range(3):
        end.order_after_torch()
    other = threading.Thread(target=lambda: [end.order_after_torch() for _ in range(2)])
    other.start()
    other.join()
    assert len(made) == 2 and len(waits) == 5
    by_thread: dict[int, set] = {}
    for ident, event in waits:
        by_thread.setdefault(ident, set()).add(id(event))
    assert sorted(len(events) for events in by_thread.values()) == [1, 1]
    assert len(set().union(*by_thread.values())) == 2
