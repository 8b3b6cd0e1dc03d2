"""torch <-> JAX through DLPack: views of the same memory, no copy, no host round trip.

Ordering on CUDA comes from the DLPack stream handshake: importing a torch tensor
makes JAX's stream wait for torch's current stream, and importing a JAX result makes
torch's current stream wait for JAX. A cache view imported once therefore stays
correct as long as every forward also imports its query (it does): that import
orders the kernel after the torch writes that came before it.

A forward crosses twice (its query in, its result out), so each crossing's host time
counts per layer. The public calls (``jax.dlpack.from_dlpack``, ``torch.from_dlpack``
of a JAX array) spend most of theirs in Python around the one C++ call that does the
work: device lookup, dtype canonicalisation, ``jnp.asarray``, torch's stream
bookkeeping (on the H200 host, 70-140 us of a pallas forward's ~300, twelfth and
thirteenth sessions). Here the handshake is done once per device (``_Endpoint``) and
the crossing calls JAX's own DLPack functions under those wrappers (``_FAST_CALLS``),
with the same stream order; where this JAX lacks them, the public calls.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import torch
import torch.utils.dlpack

_PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"


@functools.cache
def configure_jax() -> None:
    """Configure JAX for sharing a GPU with torch; call before JAX's first computation.

    JAX's GPU client takes 75% of the GPU's memory when it starts unless told not to
    preallocate, and torch owns the cache, so this asks the client (through
    ``jax_pjrt_client_create_options``, merged with any options already set) to
    allocate on demand. A choice the user made stands: an explicit
    ``XLA_PYTHON_CLIENT_PREALLOCATE`` or a ``preallocate`` client option. Importing jax
    starts no client; the backend calls this before it asks JAX for a device. A JAX
    that has already started its GPU client keeps its allocator (set the variable
    yourself when JAX computes on the GPU before pagedkv does).
    """
    if os.environ.get(_PREALLOCATE_ENV):
        return
    current = jax.config.jax_pjrt_client_create_options
    if isinstance(current, str):
        options: dict[str, object] = dict(
            item.split(":", 1) for item in current.split(";") if ":" in item
        )
    else:
        options = dict(current or {})
    if "preallocate" not in options:
        options["preallocate"] = False
        jax.config.update("jax_pjrt_client_create_options", options)


# DLPack hands these over without a copy (int64 would be converted unless jax_enable_x64)
ZERO_COPY_DTYPES = frozenset(
    {
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int32,
    }
)


def jax_version() -> str:
    return jax.__version__


def _fast_calls() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """JAX's DLPack import and export beneath its public wrappers (jaxlib's
    ``dlpack_managed_tensor_to_buffer(capsule, device, stream, copy, dl_device_type)``
    and ``buffer_to_dlpack_managed_tensor(array, stream)``), or None where this JAX
    has other ones."""
    try:
        from jax._src.lib import _jax, jaxlib_extension_version
    except ImportError:
        return None
    if jaxlib_extension_version < 467:  # the import's signature before dl_device_type
        return None
    calls = (
        getattr(_jax, "dlpack_managed_tensor_to_buffer", None),
        getattr(_jax, "buffer_to_dlpack_managed_tensor", None),
    )
    return None if None in calls else calls  # type: ignore[return-value]


_FAST_CALLS = _fast_calls()

_DL_CPU, _DL_CUDA = 1, 2  # DLPack device types


@dataclass(frozen=True)
class _Endpoint:
    """One torch device as JAX sees it, with what a crossing to it needs, found once."""

    jax_device: jax.Device
    dl_device_type: int
    # CUDA: the stream JAX waits on for an imported buffer, and torch's handle on it
    jax_stream: int | None = None
    torch_view: torch.cuda.ExternalStream | None = None
    # one event per thread, reused: a wait reads the event as it is when enqueued, and
    # another thread's record cannot fall between this thread's record and wait
    _ready: threading.local = field(default_factory=threading.local, compare=False)

    def order_after_torch(self) -> None:
        """JAX's import stream waits for torch's current stream, as torch's
        ``__dlpack__(stream=...)`` makes it (without a new event per call)."""
        if self.torch_view is not None:
            ready = getattr(self._ready, "event", None)
            if ready is None:
                ready = self._ready.event = torch.cuda.Event()
            ready.record()
            self.torch_view.wait_event(ready)


# per torch device: its endpoint, or None where the crossing takes the public calls
_ENDPOINTS: dict[torch.device, _Endpoint | None] = {}


def _endpoint(device: torch.device) -> _Endpoint | None:
    if device in _ENDPOINTS:
        return _ENDPOINTS[device]
    found = None
    if _FAST_CALLS is None:
        pass
    elif device.type == "cpu":
        found = _Endpoint(jax.devices("cpu")[0], _DL_CPU)
    elif device.type == "cuda" and device.index is not None and torch.version.hip is None:
        # (ROCm's DLPack numbers differ, and nothing here has run there: the public calls)
        gpus = jax.devices("gpu")
        jax_device = next((d for d in gpus if d.local_hardware_id == device.index), None)
        if jax_device is None:
            raise ValueError(
                f"{device}: JAX has no GPU of that index (its GPUs: "
                f"{[d.local_hardware_id for d in gpus]})"
            )
        stream = jax_device.get_stream_for_external_ready_events()
        found = _Endpoint(
            jax_device, _DL_CUDA, stream, torch.cuda.ExternalStream(stream, device=device)
        )
    _ENDPOINTS[device] = found
    return found


def to_jax(tensor: torch.Tensor, name: str, *, allow_copy: bool = False) -> jax.Array:
    """A JAX array sharing ``tensor``'s memory.

    DLPack copies int64 (unless jax_enable_x64), strided views and, on CPU, data
    not aligned to 64 bytes. Those raise TypeError/ValueError naming ``name``, except
    that ``allow_copy`` lets a contiguous, misaligned tensor be copied on its own
    device (small per-step inputs); the cache is never copied.
    """
    if tensor.dtype not in ZERO_COPY_DTYPES:
        raise TypeError(
            f"{name}: dtype {tensor.dtype} would be copied by DLPack; expected one of "
            f"{sorted(str(d).removeprefix('torch.') for d in ZERO_COPY_DTYPES)}"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor (DLPack copies strided views), got "
            f"shape {list(tensor.shape)} with strides {list(tensor.stride())}"
        )
    copy = None if allow_copy else False
    end = _endpoint(tensor.device)
    try:
        if end is None:
            return jax.dlpack.from_dlpack(tensor, copy=copy)
        end.order_after_torch()
        capsule = torch.utils.dlpack.to_dlpack(tensor)
        assert _FAST_CALLS is not None  # (an endpoint is made only with them)
        return _FAST_CALLS[0](capsule, end.jax_device, end.jax_stream, copy, end.dl_device_type)
    except (BufferError, ValueError, RuntimeError) as exc:
        raise ValueError(
            f"{name}: JAX cannot view this tensor without a copy ({exc}); on CPU the data "
            "pointer must be aligned to 64 bytes (a freshly allocated tensor is)"
        ) from exc


def to_torch(array: jax.Array, device: torch.device | None = None) -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory (on CUDA, torch's current stream waits
    for JAX's work on it). ``device``: the torch device ``array`` is on, when the caller
    knows it (the fast crossing needs it)."""
    end = None if device is None else _endpoint(device)
    if end is None:
        return torch.from_dlpack(array)
    stream = None
    if end.torch_view is not None:
        # DLPack's number for the legacy default stream is 1
        stream = torch.cuda.current_stream(device).cuda_stream or 1
    assert _FAST_CALLS is not None
    return torch.utils.dlpack.from_dlpack(_FAST_CALLS[1](array, stream=stream))


class CacheView:
    """The JAX view of one layer's cache, imported once and reused while the caller
    passes the same tensor (same object, same storage)."""

    def __init__(self) -> None:
        self._tensor: weakref.ref[torch.Tensor] | None = None
        self._key: tuple[int, tuple[int, ...], torch.dtype] | None = None
        self._array: jax.Array | None = None

    def get(self, kv_cache: torch.Tensor) -> jax.Array:
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)
        if self._tensor is not None and self._tensor() is kv_cache and self._key == key:
            assert self._array is not None
            return self._array
        self._array = to_jax(kv_cache, "kv_cache")
        self._tensor, self._key = weakref.ref(kv_cache), key
        return self._array
