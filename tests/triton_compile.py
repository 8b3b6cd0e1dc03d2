"""Compile Triton kernel launches for a GPU target without a GPU (CI's compile check).

Triton's interpreter accepts programs the GPU compiler rejects (tl.dot shapes,
layouts, shared memory), so every launch a backend plans is also compiled for
sm_90 here, exactly as ``kernel[grid](*args, **kwargs)`` would specialise it on
a GPU: the same binder (argument types, 16-byte divisibility, ==1 ints), the same
constexprs and options, then ``triton.compile(ASTSource(...), target=...)``.

It runs in a subprocess without TRITON_INTERPRET (kernels must be decorated as
JIT functions there). Each result carries the shared memory, and the registers and
spill bytes ptxas reported (None when the kernel came from Triton's cache). Launches
are described by ``(kernel, args, kwargs)``:
``kernel`` a @triton.jit function (or its interpreted twin: only its module and
name travel), tensors travel as dtype, shape, strides and pointer alignment, TMA
descriptors (Triton's and Gluon's) as their box and layout over such a tensor.

    results = compile_launches([(kernel, args, kwargs), ...])
    assert all(r.ok for r in results), "\\n".join(r.error for r in results if not r.ok)
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# The most dynamic shared memory one block may use on sm_90 (227 KiB).
SM90_MAX_SHARED = 232448


@dataclass(frozen=True)
class _TensorArg:
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    misalignment: int  # data_ptr % 16


@dataclass(frozen=True)
class CompileResult:
    label: str
    ok: bool
    error: str = ""
    shared: int = 0  # bytes of shared memory
    num_warps: int = 0
    num_stages: int = 0
    # from ptxas's report; None when the kernel came from Triton's cache (no ptxas run)
    registers: int | None = None
    spill_bytes: int | None = None  # spill stores
    # ptxas C7514: it runs every wgmma to completion (an accumulator read mid-flight)
    wgmma_serialized: bool | None = None
    # local-memory loads and stores (spills) inside a loop of the SASS; None: no spill,
    # or unknown (no cuobjdump beside Triton's ptxas, or served from Triton's cache)
    loop_spills: int | None = None
    # the PTX's grid dependency controls (programmatic dependent launch): "wait",
    # "launch_dependents"
    grid_dependency: tuple[str, ...] = ()

    def __str__(self) -> str:
        if not self.ok:
            return f"{self.label}: FAILED\n{self.error}"
        regs = "" if self.registers is None else f", {self.registers} registers"
        spills = f", {self.spill_bytes} B spilled" if self.spill_bytes else ""
        if self.spill_bytes and self.loop_spills is not None:
            spills += f" ({self.loop_spills} accesses in loops)"
        serial = ", wgmma serialized (C7514)" if self.wgmma_serialized else ""
        return f"{self.label}: ok, {self.shared} B shared, {self.num_warps} warps{regs}{spills}{serial}"


def describe(launch: Any, label: str = "") -> tuple[str, str, str, tuple, dict]:
    """A picklable description of one launch: a ``pagedkv.toolkit.launch.KernelLaunch``
    or a tuple ``(kernel, args, kwargs)``."""
    from pagedkv.toolkit.launch import KernelLaunch

    if isinstance(launch, KernelLaunch):
        kernel, args, kwargs = launch.kernel, (), launch.kwargs
    else:
        kernel, args, kwargs = launch[0], launch[-2], launch[-1]
    fn = getattr(kernel, "fn", kernel)
    packed = tuple(_pack(a) for a in args)
    packed_kwargs = {k: _pack(v) for k, v in kwargs.items()}
    return (label or fn.__name__, fn.__module__, fn.__qualname__, packed, packed_kwargs)


def compile_launches(
    launches: Iterable[Any],
    *,
    labels: Sequence[str] | None = None,
    arch: int = 90,
    jobs: int | None = None,
    timeout: float = 1800,
) -> list[CompileResult]:
    """Compile each launch for ``sm_<arch>``; one result each, in order.

    A launch is a KernelLaunch, ``(kernel, args, kwargs)`` or ``(kernel, grid, args, kwargs)``.
    ``jobs`` subprocesses share the work (default: the CPU count, at most 4).
    """
    launches = list(launches)
    labels = list(labels) if labels is not None else [""] * len(launches)
    described = [describe(lau, lab) for lau, lab in zip(launches, labels, strict=True)]
    jobs = max(1, min(jobs or min(4, os.cpu_count() or 1), len(described)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DUMP_PTXAS_LOG"] = "1"
    code = (
        f"import sys; sys.path.insert(0, {_HERE!r}); import triton_compile; triton_compile._child()"
    )
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for j in range(jobs):
            inp, out = os.path.join(tmp, f"in{j}"), os.path.join(tmp, f"out{j}")
            with open(inp, "wb") as f:
                pickle.dump((arch, described[j::jobs]), f)
            procs.append(
                (subprocess.Popen([sys.executable, "-c", code, inp, out], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out)
            )  # fmt: skip
        chunks = []
        for proc, out in procs:
            log, _ = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"the compile subprocess failed (exit {proc.returncode}):\n"
                    f"{log.decode(errors='replace')[-4000:]}"
                )
            with open(out, "rb") as f:
                chunks.append(pickle.load(f))
    results: list[CompileResult] = [None] * len(described)  # type: ignore[list-item]
    for j, chunk in enumerate(chunks):
        results[j::jobs] = chunk
    return results


@dataclass(frozen=True)
class _DescriptorArg:
    """A TMA descriptor (Triton's, or Gluon's with its shared layout): what compiles
    from it is its base's dtype and alignment, its box and its layout."""

    base: _TensorArg
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    block_shape: tuple[int, ...]
    gluon_layout: Any  # None: a Triton descriptor


def _pack(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return _TensorArg(arg.dtype, tuple(arg.shape), tuple(arg.stride()), arg.data_ptr() % 16)
    descriptor = _pack_descriptor(arg)
    return arg if descriptor is None else descriptor


def _pack_descriptor(arg: Any) -> _DescriptorArg | None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    except ImportError:  # a Triton without Gluon
        GluonDescriptor = TensorDescriptor
    if not isinstance(arg, (TensorDescriptor, GluonDescriptor)):
        return None
    b = arg.base  # a tensor, or a _FakeTensor
    base = _TensorArg(b.dtype, tuple(b.shape), tuple(b.stride()), b.data_ptr() % 16)
    layout = arg.layout if isinstance(arg, GluonDescriptor) else None
    return _DescriptorArg(
        base, tuple(arg.shape), tuple(arg.strides), tuple(arg.block_shape), layout
    )


def _unpack(arg: Any) -> Any:
    if isinstance(arg, _TensorArg):
        return _FakeTensor(arg)
    if isinstance(arg, _DescriptorArg):
        shape, strides, box = list(arg.shape), list(arg.strides), list(arg.block_shape)
        if arg.gluon_layout is not None:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

            return GluonDescriptor(_FakeTensor(arg.base), shape, strides, box, arg.gluon_layout)
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(_FakeTensor(arg.base), shape, strides, box)
    return arg


_HERE = os.path.dirname(os.path.abspath(__file__))


# -- the subprocess ---------------------------------------------------------------------


class _FakeTensor:
    """What Triton's binder reads from a tensor argument: dtype and data_ptr."""

    def __init__(self, desc: _TensorArg) -> None:
        self.dtype = desc.dtype
        self.shape = desc.shape
        self._strides = desc.strides
        self._ptr = 1 << 20 | desc.misalignment

    def data_ptr(self) -> int:
        return self._ptr

    def stride(self, dim: int | None = None) -> Any:
        return self._strides if dim is None else self._strides[dim]


def _compile_one(module: str, qualname: str, args: tuple, kwargs: dict, arch: int) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = importlib.import_module(module)
    for part in qualname.split("."):
        kernel = getattr(kernel, part)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    real_args = [_unpack(a) for a in args]
    kwargs = {k: _unpack(v) for k, v in kwargs.items()}
    kwargs.setdefault("debug", False)
    bound_args, specialization, options = binder(*real_args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource

        source = GluonASTSource(kernel, signature, constexprs, attrs)
    else:
        source = ASTSource(kernel, signature, constexprs, attrs)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG prints ptxas -v
        compiled = triton.compile(source, target=target, options=options.__dict__)
    registers = re.findall(r"Used (\d+) registers", log.getvalue())
    spills = re.findall(r"(\d+) bytes spill stores", log.getvalue())
    # where the spills are (a disassembly per spilling variant only)
    loop_spills = _loop_spills(compiled.asm["cubin"]) if any(map(int, spills)) else None
    return {
        "shared": int(compiled.metadata.shared),
        "num_warps": int(compiled.metadata.num_warps),
        "num_stages": int(compiled.metadata.num_stages),
        "registers": max(map(int, registers)) if registers else None,
        "spill_bytes": max(map(int, spills)) if spills else None,
        "wgmma_serialized": ("C7514" in log.getvalue()) if registers else None,
        "loop_spills": loop_spills,
        "grid_dependency": tuple(
            sorted(set(re.findall(r"griddepcontrol\.(\w+)", compiled.asm["ptx"])))
        ),
    }


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _loop_spills(cubin: bytes) -> int | None:
    """Local-memory accesses (LDL/STL: spills) inside a loop of ``cubin``'s SASS, a loop
    being the addresses from a backward branch's target to the branch. A spill outside
    every loop costs one access per program; one inside costs one per iteration."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    code = [(int(a, 16), ins) for a, ins in _SASS_LINE.findall(sass)]
    loops = []
    for addr, ins in code:
        target = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins)
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    return sum(
        1
        for addr, ins in code
        if re.search(r"\b(LDL|STL)\b", ins) and any(lo <= addr <= hi for lo, hi in loops)
    )


def _child() -> None:
    import traceback

    with open(sys.argv[1], "rb") as f:
        arch, described = pickle.load(f)
    results = []
    for label, module, qualname, args, kwargs in described:
        try:
            meta = _compile_one(module, qualname, args, kwargs, arch)
        except Exception:
            results.append(CompileResult(label, False, traceback.format_exc(limit=6)))
            continue
        error = ""
        if meta["shared"] > SM90_MAX_SHARED:
            error = f"needs {meta['shared']} B of shared memory (sm_90 allows {SM90_MAX_SHARED})"
        results.append(CompileResult(label, not error, error, **meta))
    with open(sys.argv[2], "wb") as f:
        pickle.dump(results, f)
