#!/usr/bin/env bash
# The GPU verification of a change, in sections (docs/gpu-verification.md): run from the
# repository root on the GPU host, results under $OUT.
#
#   bash benchmarks/gpu_session.sh setup check bench ...
#
# Sections that only check correctness run concurrently (each its own process on the
# one GPU, logs in $OUT/<name>.log); timing sections run alone, after them. Every
# section prints one PASS/FAIL line to $OUT/summary.txt; the script ends with it.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SUMMARY=$OUT/summary.txt
PY=python3
# each section stops after this many seconds (the device tool allows 10 minutes a call)
LIMIT=${LIMIT:-500}
# where FlashInfer keeps the kernels it compiles on first use
FLASHINFER_CACHE=${FLASHINFER_CACHE:-$HOME/.cache/flashinfer}
# the vendor libraries unpacked by earlier calls (shared/gpu/install.sh)
if [[ -d /tmp/gpu-site ]]; then
  export PYTHONPATH=/tmp/gpu-site:/tmp/gpu-site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
fi

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$SUMMARY"; }

run() {  # run NAME CMD...: one section, its log in $OUT/NAME.log, its status in the summary
  local name=$1; shift
  local start=$SECONDS
  if timeout "$LIMIT" "$@" >"$OUT/$name.log" 2>&1; then
    log "PASS $name ($((SECONDS - start)) s)"
  else
    log "FAIL $name ($((SECONDS - start)) s): $(tail -n 3 "$OUT/$name.log" | tr '\n' ' ' | cut -c1-300)"
  fi
}

conform() {  # conform BACKEND LEVEL [pytest args]
  local backend=$1 level=$2; shift 2
  local tag
  tag=$(echo "$backend" | tr -c 'a-zA-Z0-9_\n' '-' | cut -c1-40)
  run "conform-$tag-$level" $PY -m pytest -q -p no:cacheprovider conformance \
    --backend "$backend" --conformance-level "$level" --device cuda \
    --conformance-report "$OUT/conform-$tag-$level" "$@"
}

conform_parallel() {  # conform_parallel BACKEND LEVEL N [pytest args]: N processes, for
  # backends that compile kernels on first use (FlashInfer's JIT), so the compiles overlap
  local backend=$1 level=$2 n=$3; shift 3
  local tag ids
  tag=$(echo "$backend" | tr -c 'a-zA-Z0-9_\n' '-' | cut -c1-40)
  ids=$OUT/ids-$tag-$level.txt
  $PY -m pytest -q -p no:cacheprovider --collect-only conformance --backend "$backend" \
    --conformance-level "$level" --device cuda "$@" 2>/dev/null | grep '::' >"$ids"
  # the processes share the cores: ninja's jobs in each are capped so that n concurrent
  # builds do not oversubscribe them (FlashInfer's sm90 units take minutes each)
  export MAX_JOBS=$(( $(nproc) / n > 0 ? $(nproc) / n : 1 ))
  for ((i = 0; i < n; i++)); do
    awk -v n="$n" -v i="$i" 'NR % n == i' "$ids" >"$ids.$i"
    run "conform-$tag-$level-$i" $PY -m pytest -q -p no:cacheprovider --backend "$backend" \
      --conformance-level "$level" --device cuda "$@" $(cat "$ids.$i") &
  done
  wait
}

conform_groups() {  # conform_groups BACKEND LEVEL EXPR...: one process per -k expression (FlashInfer:
  # each group owns its kernel variants, so no two processes build the same module). Each
  # group's report is named by its expression, so that the groups of several calls (one
  # cut by its limit, run again on the next call's warm cache) merge into one report
  local backend=$1 level=$2; shift 2
  local tag expr
  tag=$(echo "$backend" | tr -c 'a-zA-Z0-9_\n' '-' | cut -c1-40)
  export MAX_JOBS=$(( $(nproc) / $# > 0 ? $(nproc) / $# : 1 ))
  for expr in "$@"; do
    local name
    name=conform-$tag-$level-k-$(echo "$expr" | tr -c 'a-zA-Z0-9_\n' '-' | cut -c1-60)
    run "$name" $PY -m pytest -q -p no:cacheprovider conformance \
      --backend "$backend" --conformance-level "$level" --device cuda \
      --conformance-report "$OUT/$name" -k "$expr" &
  done
  wait
  # one report of the groups that finished (pagedkv conform --merge)
  local reports=("$OUT"/conform-"$tag"-"$level"-k-*.json)
  if [[ -f ${reports[0]} ]]; then
    $PY -m pagedkv.cli conform --merge "${reports[@]}" --report "$OUT/conform-$tag-$level" \
      >>"$SUMMARY" 2>&1
  else
    log "no group of $backend $level finished: no report to merge"
  fi
}

memcheck() {  # memcheck BACKEND TOOL [pytest -k expression]: the quick suite and the
  # graph captures and replays (a reservation's persistent buffers, its staged parts)
  local backend=$1 tool=$2 select=${3:-}
  # cuda-python probes driver entry points at import (cuGetProcAddress): API errors that
  # are not the kernels' are left out of the report
  run "$tool-$backend${OUT_TAG:+-$OUT_TAG}" compute-sanitizer --tool "$tool" --target-processes all \
    --report-api-errors no --error-exitcode 99 $PY -m pytest -q -p no:cacheprovider conformance/test_suite.py \
    conformance/test_graphs.py --backend "$backend" --conformance-level quick --device cuda \
    ${select:+-k "$select"}
}

models() {  # models BACKEND: model-level conformance (tiny HF models) through BACKEND
  run "models-$1" $PY -m pytest -q -p no:cacheprovider conformance/test_models.py \
    --backend "$1" --device cuda --conformance-models
}

convert_all() {  # conversion between every ordered pair of the installed backends
  local backends=(--backend torch --backend triton --backend pallas --backend mla)
  $PY -c "import flashinfer" 2>/dev/null && backends+=(--backend flashinfer --backend "flashinfer(kv_layout=HND)")
  $PY -c "import flash_attn.cute" 2>/dev/null && backends+=(--backend flash_attn)
  run convert-all $PY -m pytest -q -p no:cacheprovider conformance/test_convert.py \
    --device cuda "${backends[@]}"
}

for section in "$@"; do
  case $section in
    setup)  # unpack the carried bundles (they accumulate in /tmp/gpu-site), install pagedkv
      for bundle in .gpu-bundles/*/; do
        [[ -f $bundle/install.sh ]] && bash "$bundle/install.sh" "$bundle" 2>/dev/null
      done
      export PYTHONPATH=/tmp/gpu-site:/tmp/gpu-site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
      # FlashInfer's compiled kernels from an earlier call or session (section jit-save)
      # or built offline (benchmarks/flashinfer_aot.py): a fresh machine otherwise spends
      # many minutes in nvcc. They go where FlashInfer looks for ahead-of-time builds
      # (flashinfer/data/aot/<module>/<module>.so), which it loads without a build step;
      # the JIT cache would rebuild a .so whose object files are missing. Each carried
      # .gpu-bundles/flashinfer-jit*/ folder holds one xz archive in parts (xz, not gzip:
      # the modules take less than half the room, so they fit one carry with the bundle)
      aot=$($PY -c "import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)" 2>/dev/null)
      for folder in .gpu-bundles/flashinfer-jit*/; do
        parts=("$folder"flashinfer-jit.txz.part-*)
        if [[ -n $aot && -f ${parts[0]} ]]; then
          mkdir -p "$aot" && cat "${parts[@]}" | tar -xJf - -C "$aot"
          log "restored the FlashInfer modules of $folder: $(ls "$aot" | wc -l) in $aot"
        fi
      done
      $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$SUMMARY"
      $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$SUMMARY"
      ;;
    check)  # correctness, concurrently (FlashInfer's too when it is installed)
      run gpu-tests $PY -m pytest -q -p no:cacheprovider tests/test_triton_gpu.py \
        tests/test_triton_kv_write.py tests/test_triton_batch_invariance.py \
        tests/test_mla_gpu.py tests/test_mla_graph.py tests/test_pallas_gpu.py \
        tests/test_split_kv.py -k "not sweep" &
      conform triton full &
      conform "triton(batch_invariant=true)" quick &
      conform mla full &
      conform torch quick &
      conform pallas full &
      conform "pallas(launcher=jax)" quick &  # the default is the direct launcher
      if $PY -c "import flashinfer" 2>/dev/null; then
        run flashinfer-tests $PY -m pytest -q -p no:cacheprovider tests/test_flashinfer_gpu.py &
        conform flashinfer full &
        conform "flashinfer(kv_layout=HND)" quick -k "graph or decode or mixed" &
      fi
      wait
      ;;
    convert-all)
      convert_all
      ;;
    fuzz)  # drawn scenarios and CUDA-graph reservations (docs/conformance.md), FUZZ of
      # each a backend (default 100) with seed FUZZ_SEED (default 0), each installed
      # backend in its own process
      backends=(torch triton pallas mla)
      $PY -c "import flashinfer" 2>/dev/null && backends+=(flashinfer)
      $PY -c "import flash_attn.cute" 2>/dev/null && backends+=(flash_attn)
      for backend in "${backends[@]}"; do
        run "fuzz-$backend" $PY -m pytest -q -p no:cacheprovider conformance --backend "$backend" \
          --device cuda --conformance-fuzz "${FUZZ:-100}" --conformance-fuzz-seed "${FUZZ_SEED:-0}" -k fuzz &
      done
      wait
      ;;
    check-flash-attn)
      run flash-attn-tests $PY -m pytest -q -p no:cacheprovider tests/test_flash_attn_gpu.py &
      conform flash_attn full &
      conform "split(decode=triton,prefill=flash_attn)" full &
      wait
      ;;
    memcheck)
      memcheck triton memcheck &
      memcheck mla memcheck &
      memcheck torch memcheck "decode or mixed" &
      wait
      memcheck triton racecheck "decode or mixed or prefill" &
      memcheck mla racecheck "decode or mixed or block-size-64" &
      wait
      ;;
    verify)  # this change's correctness runs, concurrently (needs both bundles)
      run gpu-tests $PY -m pytest -q -p no:cacheprovider tests/test_triton_gpu.py \
        tests/test_triton_kv_write.py tests/test_triton_batch_invariance.py \
        tests/test_split_kv.py tests/test_flashinfer_gpu.py tests/test_flash_attn_gpu.py \
        tests/test_models_hf.py -k "not sweep" &
      conform_parallel triton full 2 &
      conform_parallel flashinfer full 4 &
      conform "split(decode=triton,prefill=flash_attn)" full &
      for backend in torch triton pallas mla flashinfer flash_attn; do
        models "$backend" &
      done
      convert_all &
      memcheck triton memcheck &
      memcheck pallas memcheck "decode or mixed" &
      memcheck flashinfer memcheck &
      memcheck flash_attn memcheck &
      memcheck triton racecheck "decode or mixed or prefill" &
      wait
      ;;
    vendor-verify)  # the FlashInfer and FA4 runs, concurrently: FlashInfer's JIT compiles
      # overlap across the processes (then jit-save: the next call starts from them)
      run vendor-tests $PY -m pytest -q -p no:cacheprovider tests/test_flashinfer_gpu.py \
        tests/test_serving_graphs.py tests/test_triton_gluon_prefill_gpu.py &
      # two processes: more, each with its own nvcc build, oversubscribed the cores
      # (docs/gpu-verification.md, third session)
      conform_parallel flashinfer full 2 &
      conform triton quick &
      models flashinfer &
      models flash_attn &
      convert_all &
      memcheck flashinfer memcheck &
      wait
      ;;
    flashinfer-full)  # full conformance of flashinfer, four processes by kernel variant;
      # FLASHINFER_GROUPS picks some by index, e.g. "1 3": those a call before did not
      # finish (on a fresh machine FlashInfer's JIT builds take most of a call)
      groups=(
        "not (bfloat16 or head-size or window or soft-cap or sinks or non-causal or fp8)"
        "(bfloat16 or head-size-64 or soft-cap) and not fp8"  # fp8 over bf16: group 2
        "head-size-256 or non-causal or fp8"
        "(sinks or window) and not head-size"  # the modifiers at head size 64: group 1
      )
      picked=()
      for i in ${FLASHINFER_GROUPS:-0 1 2 3}; do picked+=("${groups[$i]}"); done
      conform_groups flashinfer full "${picked[@]}"
      ;;
    memcheck-flashinfer)  # FlashInfer's quick scenarios under memcheck, in two processes (the
      # sanitizer instruments each FlashInfer module as it loads: one process took > 390 s)
      memcheck flashinfer memcheck "decode or mixed or spec or gqa or mqa or block" &
      OUT_TAG=b memcheck flashinfer memcheck "not (decode or mixed or spec or gqa or mqa or block)" &
      wait
      ;;
    flashinfer-rest)  # FlashInfer's model conformance, HND layout, GPU tests (its memcheck:
      # memcheck-flashinfer)
      models flashinfer &
      conform "flashinfer(kv_layout=HND)" quick &
      run flashinfer-tests $PY -m pytest -q -p no:cacheprovider tests/test_flashinfer_gpu.py &
      wait
      ;;
    triton-graphs)  # the triton backend's CUDA-graph plans (per-step splits): GPU tests and
      # full conformance, concurrently
      run triton-gpu-tests $PY -m pytest -q -p no:cacheprovider tests/test_triton_gpu.py \
        tests/test_serving_graphs.py tests/test_triton_batch_invariance.py -k "not sweep" &
      conform triton full &
      wait
      ;;
    host)  # the host's side of a step: the builders' build (eager and under a reservation,
      # the device's real copies) and a forward's Python with Triton's launcher stubbed
      run host-build $PY benchmarks/build_overhead.py --backends torch,triton --device cuda
      run host-build-mla $PY benchmarks/build_overhead.py --layer mla --backends mla --device cuda
      run host-forward env TRITON_INTERPRET=1 $PY benchmarks/build_overhead.py --forward --sms 132
      tail -n 12 "$OUT/host-build.log" "$OUT/host-build-mla.log" "$OUT/host-forward.log"
      ;;
    sweep)  # the Triton tile sweep (docs/triton.md); SWEEP_WORKLOADS, SWEEP_ARGS select
      run sweep $PY benchmarks/triton_sweep.py --workloads "${SWEEP_WORKLOADS:-decode-256x1024}" \
        ${SWEEP_ARGS:-} --json "$OUT/sweep.json"
      tail -n 60 "$OUT/sweep.log"
      ;;
    convert)
      run convert $PY benchmarks/convert_throughput.py --json "$OUT/convert.json"
      tail -n 20 "$OUT/convert.log"
      ;;
    ab)  # the tree before a change against this one, in the same call: AB_OLD, a copy of
      # the old tree (`git archive REV | tar -x -C build/oldtree`, carried), installed apart
      # (/tmp/oldsite, first on PYTHONPATH for its runs); `pagedkv bench $AB_ARGS` for each,
      # alternating AB_RUNS times (default 3: the fewest a side that can pass the
      # comparison's rank test), one JSON each ($OUT/ab-{old,new}-N.json); then `pagedkv
      # bench --before ... --after ...` ($OUT/ab.md): each time's change and its verdict
      $PY -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/oldsite \
        "${AB_OLD:-build/oldtree}" 2>&1 | grep -v -i warning
      log "old tree: $(cd /tmp && PYTHONPATH=/tmp/oldsite${PYTHONPATH:+:$PYTHONPATH} $PY -c \
        'import pagedkv.backends.triton as t; print(t.__file__)')"
      for ((i = 1; i <= ${AB_RUNS:-3}; i++)); do
        # (from /tmp: the repository root would put this tree's sources first)
        (cd /tmp && PYTHONPATH=/tmp/oldsite${PYTHONPATH:+:$PYTHONPATH} \
          run "ab-old-$i" $PY -m pagedkv.cli bench ${AB_ARGS:-} --json "$OUT/ab-old-$i.json")
        run "ab-new-$i" $PY -m pagedkv.cli bench ${AB_ARGS:-} --json "$OUT/ab-new-$i.json"
      done
      tail -n 30 "$OUT"/ab-*.log
      $PY -m pagedkv.cli bench --before "$OUT"/ab-old-*.json --after "$OUT"/ab-new-*.json \
        --markdown "$OUT/ab.md"
      ;;
    bench)  # BENCH_BACKENDS, BENCH_MATRIX, BENCH_WORKLOADS select; BENCH_ARGS: more options
      run bench $PY -m pagedkv.cli bench --backends "${BENCH_BACKENDS:-triton,flashinfer}" \
        --matrix "${BENCH_MATRIX:-standard}" --workloads "${BENCH_WORKLOADS:-}" ${BENCH_ARGS:-} \
        --json "$OUT/bench.json" --markdown "$OUT/bench.md" --plot "$OUT/bench.png"
      tail -n 60 "$OUT/bench.log"
      ;;
    matrix)  # the whole matrix, one bench run per group of backend configs (MATRIX_GROUPS:
      # space-separated --backends values; with MATRIX_MLA=1 also the MLA matrix against
      # FlashInfer's MLA), each its own LIMIT and JSON, so that a group that runs out of
      # time loses only its rows (the standard matrix of triton with FlashInfer's raw
      # baseline ran past 280 s in the twenty-ninth session); then one table of them,
      # each row against the flashinfer backend of its own run ($OUT/matrix.md).
      # MATRIX_WORKLOADS selects rows; MATRIX_ARGS: more options
      for group in ${MATRIX_GROUPS:-triton,flashinfer pallas flash_attn}; do
        tag=$(echo "$group" | tr -c 'a-zA-Z0-9_\n' '-' | cut -c1-40)
        run "matrix-$tag" $PY -m pagedkv.cli bench --backends "$group" --baseline none \
          --workloads "${MATRIX_WORKLOADS:-}" ${MATRIX_ARGS:-} --json "$OUT/matrix-$tag.json"
      done
      if [[ ${MATRIX_MLA:-0} == 1 ]]; then
        run matrix-mla $PY -m pagedkv.cli bench --backends mla --matrix mla ${MATRIX_ARGS:-} \
          --json "$OUT/matrix-mla.json"
      fi
      jsons=("$OUT"/matrix-*.json)
      [[ -f ${jsons[0]} ]] && $PY -m pagedkv.cli bench --merge "${jsons[@]}" \
        --reference flashinfer --markdown "$OUT/matrix.md" | tail -n 40
      ;;
    bench-fp8)  # the fp8 rows against the flashinfer backend, FlashInfer's fp8 modules
      # built alone first (in the fourteenth session its D 64 / D 256 builds took the call
      # before the fp8 rows came)
      MAX_JOBS=$(nproc) run fi-warm-fp8 $PY -m pagedkv.cli bench --backends flashinfer \
        --baseline none --no-check --no-graph --workloads 'fp8-*'
      run bench-fp8 $PY -m pagedkv.cli bench --backends triton,flashinfer --workloads 'fp8-*' \
        --json "$OUT/bench-fp8.json" --markdown "$OUT/bench-fp8.md"
      tail -n 20 "$OUT/bench-fp8.log"
      ;;
    chunk-sweep)  # a mixed step's chunk: Gluon beside the decodes or the portable split
      # (the rule's data, docs/triton.md); CHUNK_SHAPES: the shapes
      run chunk-sweep $PY benchmarks/mixed_chunk_sweep.py ${CHUNK_SHAPES:+--shapes "$CHUNK_SHAPES"}
      tail -n 20 "$OUT/chunk-sweep.log"
      ;;
    bench-mla)
      run bench-mla $PY benchmarks/mla.py
      tail -n 30 "$OUT/bench-mla.log"
      ;;
    serving)  # SERVING_BACKENDS, SERVING_REQUESTS select
      for backend in ${SERVING_BACKENDS:-triton}; do
        run "serving-$backend" $PY benchmarks/serving_throughput.py --backend "$backend" \
          --requests ${SERVING_REQUESTS:-64} ${SERVING_ARGS:-}
        tail -n 20 "$OUT/serving-$backend.log"
      done
      ;;
    serving-async)  # the serving loop's correctness on the GPU, then the triton table with
      # synchronous and async scheduling (docs/benchmarks.md)
      LIMIT=100 run serving-tests $PY -m pytest -q -p no:cacheprovider tests/test_serving_graphs.py \
        tests/test_serving_async.py tests/test_serving_engine.py
      for n in 64 256; do
        LIMIT=${SERVING_LIMIT:-200} run "serving-triton-$n" $PY benchmarks/serving_throughput.py \
          --backend triton --requests $n --scheduling sync async --no-compare
      done
      ;;
    serving-profile)  # where the 8B decode step's device time goes (64 requests, async):
      # kernels by kind and the top ones, eager model then compiled (docs/benchmarks.md)
      LIMIT=${SERVING_LIMIT:-150} run serving-profile-triton-64 $PY benchmarks/serving_throughput.py \
        --backend triton --requests 64 --scheduling async --no-compare --kernel-profile 5
      ;;
    serving-compile)  # the compiled model (HFModel(compile="inductor")) under async scheduling:
      # the first compile of the 8B graph and the seven decode-graph captures take minutes
      LIMIT=120 run compile-tests $PY -m pytest -q -p no:cacheprovider tests/test_models_compile.py
      for n in 64 256; do
        LIMIT=${SERVING_LIMIT:-360} run "serving-compiled-triton-$n" $PY benchmarks/serving_throughput.py \
          --backend triton --requests $n --scheduling async --compile inductor --no-compare \
          --kernel-profile 5
      done
      ;;
    serving-matrix)  # the serving table (docs/benchmarks.md), one run at a time;
      # TRITON_CONFIG: the triton backend's config string
      triton_config=${TRITON_CONFIG:-triton}
      LIMIT=130 run serving-triton-64 $PY benchmarks/serving_throughput.py \
        --backend "$triton_config" --requests 64
      LIMIT=90 run serving-triton-256 $PY benchmarks/serving_throughput.py \
        --backend "$triton_config" --requests 256 --no-compare
      for backend in flash_attn flashinfer; do  # FlashInfer last: its JIT compiles first
        LIMIT=85 run "serving-$backend-64" $PY benchmarks/serving_throughput.py \
          --backend "$backend" --requests 64 --no-compare
      done
      ;;
    gluon)  # the Gluon prefill through the backend: correctness, then timing
      LIMIT=70 conform triton quick &
      LIMIT=70 run graph-tests $PY -m pytest -q -p no:cacheprovider tests/test_serving_graphs.py \
        tests/test_triton_backend.py -k "graph or gluon or two or scales" &
      wait
      LIMIT=45 run bench-prefill $PY -m pagedkv.cli bench --backends triton --baseline none \
        --workloads prefill-8x2048,prefill-2x8192,chunked-prefill-4x2048+8k \
        --json "$OUT/bench-prefill.json" --markdown "$OUT/bench-prefill.md"
      ;;
    jit-save)  # the FlashInfer modules built on this machine (their .so files only, in
      # parts of 15 MiB: a file that comes back holds at most 16 MiB); keep the parts in
      # .gpu-bundles/flashinfer-jit/ and carry that folder: setup installs them
      list=$(cd "$FLASHINFER_CACHE" 2>/dev/null &&
        find . -path '*/cached_ops/*' -name '*.so' -printf '%P\n' 2>/dev/null)
      if [[ -n $list ]]; then
        staging=/tmp/flashinfer-aot && rm -rf "$staging" && mkdir -p "$staging"
        while read -r so; do  # .../cached_ops/<module>/<module>.so -> <module>/<module>.so
          module=$(basename "$(dirname "$so")")
          mkdir -p "$staging/$module" && cp "$FLASHINFER_CACHE/$so" "$staging/$module/"
        done <<<"$list"
        tar -cf - -C "$staging" . | xz -9 -T0 | split -b 15m - "$OUT/flashinfer-jit.txz.part-" &&
          log "saved $(ls "$staging" | wc -l) FlashInfer modules: $(cat "$OUT"/flashinfer-jit.txz.part-* | wc -c) bytes in $(ls "$OUT"/flashinfer-jit.txz.part-* | wc -l) parts"
      else
        log "jit-save: no FlashInfer module built under $FLASHINFER_CACHE"
      fi
      ;;
    pack)  # at most 8 files come back from a call: every log and report in one archive
      # (files only are deleted, then the folders left empty: a folder that still holds
      # a summary must not stop the archive from coming back)
      (cd "$OUT" && tar -czf /tmp/results.tgz --exclude 'flashinfer-jit.txz.part-*' --exclude summary.txt . &&
        mv /tmp/results.tgz "$OUT/results.tgz.tmp" &&
        { find . -mindepth 1 -type f -not -name 'flashinfer-jit.txz.part-*' -not -name summary.txt \
            -not -name results.tgz.tmp -delete; find . -mindepth 1 -type d -empty -delete; true; } &&
        mv results.tgz.tmp results.tgz)
      ;;
    *) log "unknown section $section" ;;
  esac
done
echo "=== summary"
cat "$SUMMARY"
