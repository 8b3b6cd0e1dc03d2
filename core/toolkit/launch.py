"""A planned kernel launch: decided by the builder or the impl's planning, run later."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from pagedkv.intmath import cdiv
from pagedkv.toolkit import dispatch
from pagedkv.toolkit.dispatch import LaunchArgs

# CUDA's largest grid along its second and third axes (the first takes 2**31 - 1)
MAX_GRID_Y = 65535


@dataclass(frozen=True)
class KernelLaunch:
    """``kernel[grid](**kwargs)``.

    Arguments are passed by keyword only, so that a swapped stride or a missing
    argument is a TypeError at launch instead of a numeric mismatch.
    """

    kernel: Any
    grid: tuple[int, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    # ``kwargs`` as shared launch arguments, specialised once (``run_with``)
    _shared: LaunchArgs | None = field(default=None, init=False, repr=False, compare=False)

    def __call__(self) -> Any:
        return self.kernel[self.grid](**self.kwargs)

    def run_with(
        self,
        *more: LaunchArgs,
        call: Mapping[str, Any] | dispatch.CallArgs,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """This launch completed with ``more`` shared arguments (a layer's) and ``call``'s
        per-call ones (a forward's tensors and their strides), without Triton's per-call
        dispatch once the variant is known (``pagedkv.toolkit.dispatch``), on ``stream``
        (default: the current one). The template's ``kwargs`` must not change after the
        first call."""
        shared = self._shared
        if shared is None:
            shared = LaunchArgs(self.kwargs)
            object.__setattr__(self, "_shared", shared)
        dispatch.launch(self.kernel, self.grid, (shared, *more), call, stream)


def run_launches(launches: list[KernelLaunch]) -> Any:
    """Run in order; returns the first launch's compiled handle (or None)."""
    first = None
    for i, launch in enumerate(launches):
        handle = launch()
        if i == 0:
            first = handle
    return first


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def programmatic_launch(device: torch.device | str) -> bool:
    """Whether Triton kernels on ``device`` may be launched as programmatic dependents
    (``launch_pdl=True``): compiled (not interpreted) on an sm_90 or newer GPU. Such a
    launch may start while the kernel before it finishes its last programs, so it must
    call ``tl.extra.cuda.gdc_wait()`` before reading what that kernel wrote; the kernel
    before it lets it start early with ``gdc_launch_dependents()``."""
    from pagedkv.toolkit.interpreter import interpreting

    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return programmatic_capability(_capability(index))


def programmatic_capability(capability: tuple[int, int] | None) -> bool:
    """Whether a GPU of compute ``capability`` takes programmatic dependent launches
    (sm_90 or newer; None: no GPU, or Triton's interpreter). For a plan made for a
    device other than the one present (the sm_90 compile checks); ``programmatic_launch``
    asks the device itself."""
    return capability is not None and capability[0] >= 9


@dataclass(frozen=True)
class KernelFit:
    """How a compiled kernel fits on its GPU's SMs."""

    registers: int  # per thread, as the compiler allocated them
    spill_bytes: int  # local memory per thread (spilled registers)
    shared_bytes: int  # per program
    programs_per_sm: int  # programs one SM holds at once, by registers, shared memory, threads


def compiled_fit(launch: KernelLaunch, device: torch.device | str) -> KernelFit | None:
    """Compile ``launch``'s Triton kernel variant for ``device`` without running it and
    read how it fits there (what a tile rule's register estimate stands for). None where
    nothing is compiled: not CUDA, or Triton's interpreter. The variant goes to Triton's
    caches, so the launch that runs it later does not compile it again."""
    from pagedkv.toolkit.interpreter import interpreting

    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        compiled = launch.kernel.warmup(grid=launch.grid, **launch.kwargs)
        # the registers and spills are read when the binary is loaded, which warmup skips
        compiled._init_handles()
    props = torch.cuda.get_device_properties(index)
    return kernel_fit(compiled, launch.kwargs.get("num_warps", 4), props)


def kernel_fit(compiled: Any, num_warps: int, props: Any) -> KernelFit:
    """``KernelFit`` of a loaded Triton ``CompiledKernel`` on a GPU of properties ``props``
    (``torch.cuda.get_device_properties``)."""
    registers = int(compiled.n_regs)
    shared = int(compiled.metadata.shared)
    return KernelFit(
        registers=registers,
        spill_bytes=4 * int(compiled.n_spills),  # Triton counts spilled 32-bit words
        shared_bytes=shared,
        programs_per_sm=occupancy(registers, shared, num_warps, props),
    )


def occupancy(registers: int, shared_bytes: int, num_warps: int, props: Any = None) -> int:
    """Programs of ``num_warps`` warps, ``registers`` a thread and ``shared_bytes`` of
    shared memory that one SM of a GPU of properties ``props`` holds at once (None, or a
    limit this torch does not report: sm_90's). Registers are allocated in 8s per thread;
    each program's shared memory also takes the 1 KiB the SM reserves per block."""
    threads = 32 * num_warps
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    shared_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    threads_per_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    by_registers = regs_per_sm // max(1, cdiv(registers, 8) * 8 * threads)
    by_shared = shared_per_sm // (shared_bytes + 1024)
    return min(by_registers, by_shared, threads_per_sm // threads)
