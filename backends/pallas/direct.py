"""The Pallas kernel launched from torch: lowered by JAX, compiled by Triton, launched on
torch's current stream.

Through JAX's runtime a forward crosses torch -> JAX -> torch and waits for JAX's
dispatch: 170-380 us of host time per call on the H200 host (docs/pallas.md), longer
than the kernel on short rows, and the work runs on JAX's stream, which a torch CUDA
graph cannot capture. JAX's Pallas Triton lowering turns the kernel into a Triton IR
module, which XLA would compile and launch; here that module is taken from the
lowering, compiled by Triton for the tensors' GPU and launched like any compiled
Triton kernel (``pagedkv.toolkit.dispatch.CompiledLaunch``) with the torch tensors'
addresses. The same kernel, with no JAX call at run time.

The module is caught from JAX's Pallas Triton lowering rule
(``lower_jaxpr_to_triton_module``), wrapped while one lowering runs: a private
function of JAX; where it is missing, ``capture_unavailable`` says so and the backend
runs the kernel through JAX. Shapes are constants in the module (the lowering bakes
them in, as XLA's jit does): one compiled variant per config and input shapes, the
granularity of JAX's own jit cache.
"""

from __future__ import annotations

import functools
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import torch
from pagedkv.backends.pallas.kernel import KernelConfig, StepArrays
from pagedkv.backends.pallas.lowering import export_kernel
from pagedkv.errors import ConfigError, UnsupportedError

# the lowering declares every pointer parameter aligned to this many bytes
# (``tt.divisibility``): every tensor a launch is given must be
DEFAULT_ALIGNMENT = 32

_LOCK = threading.Lock()  # the lowering rule is wrapped for one lowering at a time


@dataclass(frozen=True)
class LaunchShape:
    """What one compiled variant is specialised to: the config and every input's shape."""

    cfg: KernelConfig
    num_tokens: int
    num_tiles: int
    num_reqs: int
    table_width: int
    cache_shape: tuple[int, ...]
    dtype: str  # the query's (and output's) dtype, by JAX's name
    cache_dtype: str

    def abstract_args(self) -> tuple:
        """ShapeDtypeStructs of the kernel's inputs (``kernel.kernel_call``)."""
        s, i32, f32 = jax.ShapeDtypeStruct, jnp.int32, jnp.float32
        cfg = self.cfg
        step = StepArrays(
            tile_req=s((self.num_tiles,), i32),
            tile_qstart=s((self.num_tiles,), i32),
            query_start_loc=s((self.num_reqs + 1,), i32),
            seq_lens=s((self.num_reqs,), i32),
            block_table=s((self.num_reqs, self.table_width), i32),
            split_steps=s((1,), i32),
        )
        return (
            s((self.num_tokens, cfg.num_heads, cfg.head_size), jnp.dtype(self.dtype)),
            s(self.cache_shape, jnp.dtype(self.cache_dtype)),
            step,
            s((cfg.num_heads,), f32),
            s((cfg.num_heads,), f32),
        )


@dataclass(frozen=True)
class TritonModule:
    """The kernel as JAX's lowering leaves it for XLA."""

    text: str  # Triton IR (the tt dialect), textual; pointers aligned to DEFAULT_ALIGNMENT
    grid: tuple[int, int, int]


def _lowering_rule_module() -> Any:
    from jax._src.pallas.triton import pallas_call_registration

    module = pallas_call_registration.lowering
    if not callable(getattr(module, "lower_jaxpr_to_triton_module", None)):
        raise AttributeError("jax's Pallas Triton lowering has no lower_jaxpr_to_triton_module")
    return module


@functools.cache
def capture_unavailable() -> str | None:
    """Why this JAX's lowering cannot be caught (the backend then launches through
    JAX), or None."""
    try:
        import triton  # noqa: F401

        _lowering_rule_module()
    except (ImportError, AttributeError) as exc:
        return f"jax {jax.__version__}: the Pallas kernel's Triton module cannot be caught ({exc})"
    return None


LAUNCHERS = ("auto", "jax", "direct")


def resolve_launcher(launcher: str, device: torch.device) -> str:
    """The launcher the option ``launcher`` means on ``device``: "jax" (JAX's runtime;
    CPU tensors always: interpret mode) or "direct" (this module; "auto" on CUDA where
    this JAX's lowering can be caught). An impossible request is UnsupportedError."""
    if launcher not in LAUNCHERS:
        raise ConfigError(f"option launcher={launcher!r}: expected one of {LAUNCHERS}")
    if launcher == "jax" or (launcher == "auto" and device.type != "cuda"):
        return "jax"
    why = capture_unavailable() if device.type == "cuda" else "the direct launcher needs CUDA"
    if why is None:
        return "direct"
    if launcher == "direct":
        raise UnsupportedError(f"option launcher=direct on {device}: {why}")
    return "jax"


def lower(shape: LaunchShape) -> TritonModule:
    """The Triton module JAX's Pallas lowering makes of ``shape``'s kernel (for CUDA; no
    GPU needed)."""
    rules = _lowering_rule_module()
    original = rules.lower_jaxpr_to_triton_module
    caught: list[Any] = []

    def catch(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        caught.append(result)
        return result

    cfg = shape.cfg
    with _LOCK:
        rules.lower_jaxpr_to_triton_module = catch
        try:
            export_kernel(cfg, "cuda", args=shape.abstract_args())
        finally:
            rules.lower_jaxpr_to_triton_module = original
    if len(caught) != 1:
        raise RuntimeError(
            f"{cfg.name}: expected one Triton module from the lowering, got {len(caught)}"
        )
    result = caught[0]
    text = result.module.operation.get_asm(enable_debug_info=False)
    grid = tuple(int(g) for g in result.grid)
    alignment = max(map(int, re.findall(r"tt\.divisibility = (\d+)", text)), default=0)
    if alignment > DEFAULT_ALIGNMENT:  # the builder aligns the step's arrays to that
        raise UnsupportedError(
            f"{cfg.name}: jax {jax.__version__} declares {alignment}-byte aligned pointers; "
            f"the direct launcher aligns to {DEFAULT_ALIGNMENT} (launcher=jax runs it)"
        )
    return TritonModule(text=text, grid=(*grid, *(1,) * (3 - len(grid))))  # type: ignore[arg-type]


class DirectKernel:
    """One compiled variant: ``launch(addresses, stream)`` with the addresses of
    ``kernel.kernel_call``'s parameters in order (inputs, then outputs)."""

    def __init__(self, module: TritonModule, compiled: Any) -> None:
        from pagedkv.toolkit.dispatch import CompiledLaunch

        self.grid = module.grid
        self.compiled = compiled
        self._launch = CompiledLaunch(compiled)

    def launch(self, addresses: list[int], stream: int) -> None:
        self._launch.launch(self.grid, addresses, stream)


def compile_module(module: TritonModule, cfg: KernelConfig, capability: tuple[int, int]) -> Any:
    """Triton's compiled kernel of ``module`` for a GPU of ``capability`` (Triton caches
    the binary on disk by the module's text)."""
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    with tempfile.TemporaryDirectory() as tmp:
        # Triton reads a module from a file; the suffix names its dialect
        path = Path(tmp) / f"{cfg.name}.ttir"
        path.write_text(module.text)
        return triton.compile(
            str(path),
            target=target,
            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
        )


# by shape and device: a compiled kernel's function is loaded into one device's context
_KERNELS: dict[tuple[LaunchShape, int], DirectKernel] = {}


def kernel(shape: LaunchShape, device: torch.device) -> DirectKernel:
    """The compiled variant for ``shape`` on the CUDA ``device`` (made on first use:
    JAX's lowering and Triton's compile, about a second)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (shape, index)
    found = _KERNELS.get(key)
    if found is None:
        module = lower(shape)
        capability = torch.cuda.get_device_capability(index)
        with torch.cuda.device(index):  # Triton loads the binary into the current device
            found = DirectKernel(module, compile_module(module, shape.cfg, capability))
        _KERNELS[key] = found
    return found
