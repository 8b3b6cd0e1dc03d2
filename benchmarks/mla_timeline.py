"""Where a program of the Gluon MLA kernel spends its time: a per-program timeline.

A copy of ``backends/mla/gluon_kernels.py`` is stamped at six points of each program
(``%globaltimer`` and ``%clock64``, plus ``%smid``): its start, the query landed in
shared memory, each warpgroup's first scores (the first tile landed), each warpgroup's
loop end and each one's end (its output stores issued). The copy runs the step the
backend plans (``benchmarks/mla.py``'s problem) and the phases are summarised over the
programs, with each SM's gaps between programs and its idle tail:

    python benchmarks/mla_timeline.py                       # 256x1024, 64x4096, 4x32k
    python benchmarks/mla_timeline.py --batch 256 --context 1024 --ragged

The stamps cost about 2% (the copy is also timed against the kernel). The copy is
made by text substitutions at fixed anchors of the kernel's source; each must match
once, so a change of the kernel that moves one fails here loudly
(``tests/test_mla_compile.py`` compiles the copy for sm_90 on every CI run). The
seventeenth session's output-store and query-load changes were found with it
(docs/mla.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys
import tempfile
from types import ModuleType

import numpy as np
import torch

KERNEL_SOURCE = pathlib.Path(__file__).resolve().parent.parent / "backends/mla/gluon_kernels.py"
SLOTS = 32  # int64 per program: 16 of globaltimer (ns), then 16 of clock64
# slot: what was stamped (a warpgroup-specific point: its warpgroup 0 slot + step * WG)
SMID, START, QUERY, FIRST_S0, LOOP0, END0, LOOP1, END1, FIRST_S1, TILES = range(10)

_STAMP = f"""
@gluon.jit
def _stamp(Stamps, prog, slot):
    t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                  is_pure=False, pack=1)
    c = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64,
                                  is_pure=False, pack=1)
    gl.store(Stamps + prog * {SLOTS} + slot, t)
    gl.store(Stamps + prog * {SLOTS} + {SLOTS // 2} + slot, c)


"""

# (anchor, replacement): each anchor must occur exactly once in the kernel's source
_PATCHES = [
    ("# shared-memory barriers between the two warpgroups\n",
     _STAMP + "# shared-memory barriers between the two warpgroups\n"),
    ("stride_o_h) = a", "stride_o_h, Stamps, prog) = a"),
    ("        s = warpgroup_mma_wait(0, deps=[s])\n",
     "        s = warpgroup_mma_wait(0, deps=[s])\n"
     "        if i == 0:\n"
     f"            _stamp(Stamps, prog, {FIRST_S0} + {FIRST_S1 - FIRST_S0} * WG)\n"),
    ("    # each warpgroup summed the probabilities of its own tiles\n",
     f"    _stamp(Stamps, prog, {LOOP0} + {LOOP1 - LOOP0} * WG)\n"
     "    # each warpgroup summed the probabilities of its own tiles\n"),
    ("\n\n@gluon.jit\ndef _warpgroup0",
     f"\n    _stamp(Stamps, prog, {END0} + {END1 - END0} * WG)\n\n\n@gluon.jit\ndef _warpgroup0"),
    ("    oob_row,  # a cache row past the last one (TMA reads zeros there)\n",
     "    oob_row,  # a cache row past the last one (TMA reads zeros there)\n    Stamps,\n"),
    ("    item = gl.program_id(0)\n",
     "    item = gl.program_id(0)\n    prog = item\n"
     f"    _stamp(Stamps, prog, {START})\n"
     f"    gl.store(Stamps + prog * {SLOTS} + {SMID}, gl.inline_asm_elementwise('mov.u32 $0, %smid;', '=r', [],"
     " dtype=gl.int32, is_pure=True, pack=1).to(gl.int64))\n"),
    ("    table_row = BlockTable + req.to(gl.int64) * stride_bt\n",
     "    table_row = BlockTable + req.to(gl.int64) * stride_bt\n"
     f"    gl.store(Stamps + prog * {SLOTS} + {TILES}, n_iter.to(gl.int64))\n"),
    ("    mbarrier.wait(q_bar, 0, pred=n_iter > 0)\n",
     "    mbarrier.wait(q_bar, 0, pred=n_iter > 0)\n"
     "    if WG == 0:\n"
     f"        _stamp(Stamps, prog, {QUERY})\n"),
    ("stride_o_h)  # fmt: skip", "stride_o_h, Stamps, prog)  # fmt: skip"),
]  # fmt: skip


def stamped_source(source: str | None = None) -> str:
    """The kernel's source with the stamps (an extra ``Stamps`` pointer argument:
    ``[programs * SLOTS]`` int64)."""
    text = KERNEL_SOURCE.read_text() if source is None else source
    for anchor, replacement in _PATCHES:
        found = text.count(anchor)
        if found != 1:
            raise RuntimeError(
                f"mla_timeline: the anchor {anchor.strip()[:60]!r} occurs {found} times in "
                f"{KERNEL_SOURCE.name} (expected once): update _PATCHES to the kernel"
            )
        text = text.replace(anchor, replacement)
    return text


def stamped_module(directory: str | None = None) -> ModuleType:
    """The stamped kernel as an importable module (written to ``directory``, default a
    temporary one: Triton reads a JIT function's source from its file)."""
    directory = directory or tempfile.mkdtemp(prefix="mla_timeline_")
    path = pathlib.Path(directory) / "mla_timeline_kernel.py"
    path.write_text(stamped_source())
    if directory not in sys.path:
        sys.path.insert(0, directory)
    spec = importlib.util.spec_from_file_location("mla_timeline_kernel", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mla_timeline_kernel"] = module
    spec.loader.exec_module(module)
    return module


def summarise(label: str, stamps: np.ndarray) -> str:
    """The phases of ``stamps`` ([programs, SLOTS]) as a table, in microseconds."""
    st = stamps.astype(np.int64)
    sm, start, tiles = st[:, SMID], st[:, START], st[:, TILES]
    end = np.maximum(st[:, END0], st[:, END1])
    clock = st[:, SLOTS // 2 :]
    c_end = np.maximum(clock[:, END0], clock[:, END1])
    ghz = float(np.median((c_end - clock[:, START]) / np.maximum(end - start, 1)))

    def cycles(x: np.ndarray) -> np.ndarray:
        return x / ghz / 1000.0

    phases = {
        "program": cycles(c_end - clock[:, START]),
        "start -> query landed": cycles(clock[:, QUERY] - clock[:, START]),
        "query -> first scores (wg0)": cycles(clock[:, FIRST_S0] - clock[:, QUERY]),
        "query -> first scores (wg1)": cycles(clock[:, FIRST_S1] - clock[:, QUERY]),
        "query -> loop end (wg0)": cycles(clock[:, LOOP0] - clock[:, QUERY]),
        "a tile after the first pair": cycles(clock[:, LOOP0] - clock[:, FIRST_S0])
        / np.maximum(tiles - 2, 1),
        "loop end -> end": cycles(c_end - np.maximum(clock[:, LOOP0], clock[:, LOOP1])),
    }
    gaps, tails = [], []
    for s in np.unique(sm):
        mine = np.flatnonzero(sm == s)
        mine = mine[np.argsort(start[mine])]
        gaps += (start[mine[1:]] - end[mine[:-1]]).tolist()
        tails.append(end.max() - end[mine[-1]])
    phases["gap to the SM's next program"] = np.array(gaps, dtype=np.float64) / 1000.0
    phases["SM idle after its last"] = np.array(tails, dtype=np.float64) / 1000.0
    lines = [
        f"{label}: {len(st)} programs on {len(np.unique(sm))} SMs, {int(np.median(tiles))} "
        f"tiles a program (median), span {(end.max() - start.min()) / 1000:.1f} us, "
        f"SM clock {ghz:.3f} GHz",
        f"  {'phase (us)':32s} {'median':>8s} {'mean':>8s} {'p10':>8s} {'p90':>8s}",
    ]
    for name, values in phases.items():
        if len(values):
            q = np.percentile(values, [50, 10, 90])
            lines.append(f"  {name:32s} {q[0]:8.2f} {values.mean():8.2f} {q[1]:8.2f} {q[2]:8.2f}")
    return "\n".join(lines)


def timeline(shape, kernel_module: ModuleType) -> str:
    """Run ``shape`` (``benchmarks/mla.py``'s Shape) through the stamped kernel, after
    timing it against the backend's own launches."""
    import mla

    problem = mla.make_problem(shape)
    _, metadata, impl = mla.ours(problem)
    out = torch.empty(shape.batch, shape.heads, mla.LORA, dtype=problem.query.dtype, device="cuda")
    q = problem.query
    launches = impl.plan_attention(
        q[..., : mla.LORA], q[..., mla.LORA :], problem.cache, metadata, out
    )
    attention, rest = launches[0], launches[1:]
    if attention.kernel.fn.__name__ != "_mla_attention_sm90":
        return f"{shape}: the backend plans {attention.kernel.fn.__name__}, not the Gluon kernel"
    programs = attention.grid[0]
    stamps = torch.zeros(programs * SLOTS, dtype=torch.int64, device="cuda")
    kwargs = dict(attention.kwargs, Stamps=stamps)

    def stamped() -> torch.Tensor:
        kernel_module._mla_attention_sm90[attention.grid](**kwargs)
        for launch in rest:
            launch()
        return out

    def plain() -> torch.Tensor:
        for launch in launches:
            launch()
        return out

    error = mla.rel_error(stamped(), mla.reference(problem))
    plain_us, stamped_us = mla.bench(plain), mla.bench(stamped)
    for _ in range(3):  # the summarised run follows warm ones, as a graph replay does
        stamped()
    torch.cuda.synchronize()
    head = (
        f"{shape}: grid {attention.grid}, {len(launches)} launch(es); kernel {plain_us:.1f} us, "
        f"stamped {stamped_us:.1f} us (L2 flushed), rel. error {error:.1e}"
    )
    return head + "\n" + summarise(str(shape), stamps.view(programs, SLOTS).cpu().numpy())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, help="requests (default: three decode shapes)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--ragged", action="store_true", help="lognormal lengths of mean --context")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("benchmarks/mla_timeline.py needs an sm_90 GPU (the Gluon kernel)", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mla

    if args.batch:
        shapes = [mla.Shape(args.batch, args.context, args.heads, ragged=args.ragged)]
    else:
        shapes = [mla.Shape(256, 1024), mla.Shape(64, 4096), mla.Shape(4, 32768)]
    module = stamped_module()
    for shape in shapes:
        print(timeline(shape, module), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
