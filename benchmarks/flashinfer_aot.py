"""Build FlashInfer's batch-prefill modules for sm_90a on a machine without a GPU, and
pack them as ``gpu_session.sh jit-save`` packs the GPU host's: the host loads them as
ahead-of-time builds instead of spending its device time in nvcc (docs/gpu-verification.md,
thirty-sixth session: a fresh machine's JIT took a whole call).

    python benchmarks/flashinfer_aot.py --out .gpu-bundles/flashinfer-jit-more NAME...

NAME is a module as FlashInfer names it (the names ``jit-save`` lists, or a GPU log's
"Building JIT module ..."), e.g.
``batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_256_head_dim_vo_256_posenc_0_use_swa_False_use_logits_cap_False_f16qk_False_sm90``.
The suffix picks FlashInfer's generator: ``kv_stride_equal`` (FA2, the tensor-core
decode and the FA2 prefill), ``paged_kv_stride_independent`` (FA2's other page
strides), ``sm90`` (FA3). The flashinfer backend's attention-sink modules
(``pagedkv_attention_sink_...``, backends/flashinfer/sinks.py) are built from its own
``SinkModule``, with FlashInfer's generator for custom variants. FlashInfer's MLA
modules (``batch_mla_attention_...``, ``_sm90`` for FA3; ``pagedkv bench --matrix mla``'s
baseline) from its MLA generator. Needs
flashinfer-python (the bundle's version) importable, a CUDA toolkit of the host's major
version (``CUDA_HOME``) and, for FA3, cuRAND's headers (CUTLASS includes them: ``pip
install --target DIR nvidia-curand``, then ``CPATH=DIR/nvidia/cu13/include``). The
driver's libcuda is not needed: the link takes an empty stand-in whose soname is the
driver's, and the module resolves its symbols from the host's driver when it loads. On
two cores an FA2 module took about 4 minutes (a sink one about 1), an FA3 one 4.5-14.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# the GPU host's architecture; FlashInfer reads it when it generates a module
os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")

NAME = re.compile(
    r"batch_prefill_with_kv_cache_dtype_q_(?P<q>\w+?)_dtype_kv_(?P<kv>\w+?)_dtype_o_(?P<o>\w+?)"
    r"_dtype_idx_(?P<idx>\w+?)_head_dim_qk_(?P<dqk>\d+)_head_dim_vo_(?P<dvo>\d+)"
    r"_posenc_(?P<posenc>\d)_use_swa_(?P<swa>True|False)_use_logits_cap_(?P<cap>True|False)"
    r"_f16qk_(?P<f16qk>True|False)_(?P<kind>kv_stride_equal|paged_kv_stride_independent|sm90)"
)
MLA_NAME = re.compile(
    r"batch_mla_attention_dtype_q_(?P<q>\w+?)_dtype_kv_(?P<kv>\w+?)_dtype_o_(?P<o>\w+?)"
    r"_dtype_idx_(?P<idx>\w+?)_head_dim_ckv_(?P<ckv>\d+)_head_dim_kpe_(?P<kpe>\d+)"
    r"_profiler_(?P<profiler>True|False)_planabi2(?P<sm90>_sm90)?"
)
PART_BYTES = 15 << 20  # a file that comes back from the GPU host holds at most 16 MiB


def jit_spec(name: str):  # -> flashinfer.jit.core.JitSpec
    """FlashInfer's spec of the module called ``name``, from its own generators."""
    from flashinfer.jit.attention import gen_batch_prefill_module
    from flashinfer.jit.utils import filename_safe_dtype_map
    from flashinfer.prefill import (
        _gen_batch_prefill_independent_paged_module,
        _gen_batch_prefill_primary_module,
    )

    if name.startswith("pagedkv_attention_sink_"):
        return sink_jit_spec(name)
    if name.startswith("batch_mla_attention_"):
        return mla_jit_spec(name)
    m = NAME.fullmatch(name)
    if m is None:
        raise SystemExit(f"{name}: not a batch-prefill module name this tool builds")
    dtype_of = {short: dtype for dtype, short in filename_safe_dtype_map.items()}
    dtype = {k: dtype_of[m[k]] for k in ("q", "kv", "o", "idx")}
    args = (dtype["q"], dtype["kv"], dtype["o"], dtype["idx"], int(m["dqk"]), int(m["dvo"]),
            int(m["posenc"]), m["swa"] == "True", m["cap"] == "True", m["f16qk"] == "True")  # fmt: skip
    generate = {
        "kv_stride_equal": lambda: _gen_batch_prefill_primary_module("fa2", *args),
        "paged_kv_stride_independent": lambda: _gen_batch_prefill_independent_paged_module(
            "fa2", *args
        ),
        "sm90": lambda: gen_batch_prefill_module("fa3", *args),
    }[m["kind"]]
    spec = generate()
    if spec.name != name:  # FlashInfer's naming moved: the module would not be found
        raise SystemExit(f"{name}: FlashInfer generates {spec.name} from it")
    return spec


def mla_jit_spec(name: str):  # -> flashinfer.jit.core.JitSpec
    """The spec of one of FlashInfer's MLA modules, from its own generator."""
    from flashinfer.jit import gen_batch_mla_module
    from flashinfer.jit.utils import filename_safe_dtype_map

    m = MLA_NAME.fullmatch(name)
    if m is None:
        raise SystemExit(f"{name}: not an MLA module name this tool builds")
    dtype_of = {short: dtype for dtype, short in filename_safe_dtype_map.items()}
    spec = gen_batch_mla_module(
        "fa3" if m["sm90"] else "fa2",
        *(dtype_of[m[k]] for k in ("q", "kv", "o", "idx")),
        int(m["ckv"]), int(m["kpe"]), m["profiler"] == "True",
    )  # fmt: skip
    if spec.name != name:
        raise SystemExit(f"{name}: FlashInfer generates {spec.name} from it")
    return spec


def sink_jit_spec(name: str):  # -> flashinfer.jit.core.JitSpec
    """The spec of one of the flashinfer backend's attention-sink modules."""
    import flashinfer
    from flashinfer.jit.attention.modules import gen_customize_batch_prefill_module
    from pagedkv.backends.flashinfer.sinks import SinkModule

    module = SinkModule.parse(name)
    args, kwargs = module.jit_args(flashinfer)
    spec = gen_customize_batch_prefill_module(module.backend, *args, **kwargs)
    if spec.name != name:
        raise SystemExit(f"{name}: FlashInfer generates {spec.name} from it")
    return spec


def driver_stand_in(directory: Path) -> None:
    """An empty libcuda.so whose soname is the driver's, for the modules' ``-lcuda``."""
    subprocess.run(
        ["gcc", "-shared", "-x", "c", "-", "-o", str(directory / "libcuda.so"),
         "-Wl,-soname,libcuda.so.1"],
        input=b"", check=True,
    )  # fmt: skip
    os.environ["LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(directory), os.environ.get("LIBRARY_PATH")) if p
    )


def pack(libraries: list[Path], out: Path) -> list[Path]:
    """``<module>/<module>.so`` of each library, an xz tar in parts of 15 MiB, named as
    ``jit-save`` names them (``setup`` unpacks every part it finds)."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as archive:
        with tarfile.open(fileobj=archive, mode="w:xz") as tar:
            for library in libraries:
                tar.add(library, arcname=f"./{library.stem}/{library.name}")
        archive.seek(0)
        parts = []
        while chunk := archive.read(PART_BYTES):
            suffix = "a" + "abcdefghijklmnopqrstuvwxyz"[len(parts)]
            parts.append(out / f"flashinfer-jit.txz.part-{suffix}")
            parts[-1].write_bytes(chunk)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", metavar="NAME")
    parser.add_argument("--out", type=Path, required=True, help="folder for the parts")
    args = parser.parse_args()
    specs = [jit_spec(name) for name in args.names]
    with tempfile.TemporaryDirectory() as stand_in:
        driver_stand_in(Path(stand_in))
        for spec in specs:
            print(f"building {spec.name}", file=sys.stderr, flush=True)
            spec.build(verbose=False)
    parts = pack([Path(spec.get_library_path()) for spec in specs], args.out)
    for part in parts:
        print(f"{part} ({part.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
