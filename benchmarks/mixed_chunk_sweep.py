"""A mixed step's chunk: the Gluon kernel beside the decodes, or the portable split.

    python benchmarks/mixed_chunk_sweep.py                       # the default shapes
    python benchmarks/mixed_chunk_sweep.py --shapes 16:2048:16384:256,64:1024:2048:256

The triton backend gives a two-part step's chunk the Gluon kernel unsplit, though its
programs leave SMs idle, when one Gluon program takes no longer than the model's time
for both parts on the portable kernel (``builder._gluon_beside_decodes``,
docs/triton.md). Per shape this times three builders: ``portable`` (the rule off: the
chunk split on the portable kernel), ``rule`` (as committed) and ``gluon`` (forced),
eager as ``pagedkv bench`` times it (L2 flushed) and back to back (no flush or sync),
with each output's max |diff| against the portable plan's: the data to fit the rule's
Gluon rate to (the fourteenth session's run:
docs/results/bench-h200-fourteenth-gluon-beside-decodes.md). A shape is
``decodes:median context:chunk context:chunk queries[:head size]``
(``pagedkv.bench.workloads.mixed_shape``). Needs an sm_90 GPU.
"""

from __future__ import annotations

import argparse

import torch
from pagedkv.backends.triton.builder import TritonMetadataBuilder
from pagedkv.bench import select_workloads
from pagedkv.bench.problem import build_problem, fill_cache
from pagedkv.bench.timing import host_floor_us, steady_us, time_us
from pagedkv.bench.workloads import Workload, mixed_shape
from pagedkv.selection import select_backend

DEFAULT_SHAPES = (
    "64:1024:2048:256,128:1024:4096:128,16:2048:8192:128,16:2048:16384:256,"
    "16:2048:32768:64,32:2048:4096:256:256"
)
MODES = {
    "portable": lambda self, step, first, end: False,
    "rule": TritonMetadataBuilder._gluon_beside_decodes,
    "gluon": lambda self, step, first, end: True,
}


def time_modes(w: Workload, device: torch.device) -> str:
    """One shape under each mode's builder: a table row."""
    problem = build_problem(w, "cuda")
    spec = problem.spec
    backend = select_backend("triton", spec, device)
    cache = backend.allocate_kv_cache(problem.num_blocks, spec, device)
    fill_cache(backend, cache, problem)
    impl = backend.make_impl(spec)
    query, reference, cells = problem.query, None, []
    for mode, choose in MODES.items():
        TritonMetadataBuilder._gluon_beside_decodes = choose
        md = backend.make_builder(spec, device).build(problem.common)
        out = query.new_empty(query.shape[0], spec.num_heads, spec.head_size_v)

        def forward(md=md, out=out) -> None:
            impl.forward(query, None, None, cache, md, out)

        forward()
        torch.cuda.synchronize()
        reference = out.clone() if reference is None else reference
        diff = float((out.float() - reference.float()).abs().max())
        kernel = "gluon" if md.parts[-1].gluon is not None else "split"
        eager, steady = time_us(forward, device), steady_us(forward, device)
        cells.append(f"{mode}[{kernel}] {eager:6.1f}/{steady:6.1f} d{diff:.0e}")
    return f"{w.name:24s} " + "   ".join(cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated shapes (see above)")
    p.add_argument("--matrix-rows", default="mixed-16d+1chunk,d256-mixed",
                   help="standard-matrix mixed rows to time too (empty: none)")  # fmt: skip
    args = p.parse_args()
    device = torch.device("cuda")
    print(f"host: {host_floor_us(device):.1f} us to enqueue a one-element torch op")
    print("each cell: mode[the chunk's kernel] eager (L2 flushed) / back to back us, max |diff|")
    rows = [r for r in args.matrix_rows.split(",") if r]
    workloads = (select_workloads("standard", rows) if rows else []) + [
        mixed_shape(s) for s in args.shapes.split(",") if s
    ]
    rule = TritonMetadataBuilder._gluon_beside_decodes
    try:
        for w in workloads:
            print(time_modes(w, device), flush=True)
    finally:
        TritonMetadataBuilder._gluon_beside_decodes = rule


if __name__ == "__main__":
    main()
