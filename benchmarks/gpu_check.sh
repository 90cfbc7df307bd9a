#!/usr/bin/env bash
# GPU check of the specdec ops, for a machine with a GPU and NO network (its own torch):
#   1. build specdec._C in place with the CUDA kernels (pip -e, no build isolation, no deps)
#   2. build_info() must report cuda
#   3. the op tests on CUDA (pytest -k cuda; TESTS_K="" runs everything)
#   4. compute-sanitizer on every CUDA kernel: memcheck (small cases + invalid values with
#      strict checks off), racecheck, synccheck and initcheck (quick cases); a tool the
#      image lacks is skipped with a note
#   5. a CPU vs CUDA agreement sweep of the samplers (benchmarks/sweep_sampling.py, short)
#   6. kernel benchmarks on CUDA (one table)
#   7. SmolLM2 decoding with CUDA-graph replays vs eager forwards (benchmarks/bench_graphs.py)
# Everything (logs, junit XML, bench JSON, summary) goes to
# benchmarks/results/gpu_<date>_<shortcommit>/. A failing stage does not stop the later
# ones; each stage's status is in summary.txt. Whole script < 8 minutes: every stage has
# its own time limit and none may run past the overall budget (GPU_CHECK_BUDGET seconds).
#
# Environment: PYTHON (default python), TESTS_K (default "cuda and not inductor"),
# BENCH_ARGS (extra bench_ops.py arguments, e.g. --quick), GPU_CHECK_BUDGET (default 465),
# TORCH_CUDA_ARCH_LIST (default: this GPU's compute capability only), MAX_JOBS.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python}"
BUDGET="${GPU_CHECK_BUDGET:-480}"
START=$(date +%s)
DATE="$(date +%Y%m%d-%H%M%S)"
COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if ! git diff --quiet HEAD -- 2>/dev/null; then COMMIT="${COMMIT}-dirty"; fi
OUT="benchmarks/results/gpu_${DATE}_${COMMIT}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"

GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || true)"
GPU_NAME="${GPU_NAME:-unknown GPU}"
nvidia-smi --query-gpu=name --format=csv >"$OUT/gpu_name.csv" 2>&1 || true
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true

NAMES=()
RESULTS=()

# run_stage NAME LIMIT_S CMD... : run with a time limit (clipped to the overall budget),
# log to $OUT/NAME.log, record the status, never abort the script.
run_stage() {
  local name="$1" limit="$2"
  shift 2
  local left=$((START + BUDGET - $(date +%s) - 5))
  if [ "$left" -lt "$limit" ]; then limit="$left"; fi
  if [ "$limit" -lt 10 ]; then
    NAMES+=("$name"); RESULTS+=("SKIPPED (overall budget spent)")
    echo "== [$name] skipped: overall budget of ${BUDGET}s spent"
    return 0
  fi
  echo "== [$name] (limit ${limit}s) $*"
  local t0 rc=0
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  local dt=$(($(date +%s) - t0)) status="PASS"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="TIMEOUT"; elif [ "$rc" -ne 0 ]; then status="FAIL (rc=$rc)"; fi
  NAMES+=("$name"); RESULTS+=("$status ${dt}s")
  echo "   -> $status in ${dt}s, log $OUT/$name.log"
  tail -n 4 "$OUT/$name.log" | sed 's/^/      /' || true
  return 0
}

skip_stage() {
  NAMES+=("$1"); RESULTS+=("SKIPPED ($2)")
  echo "== [$1] skipped: $2"
}

find_sanitizer() {
  if command -v compute-sanitizer >/dev/null 2>&1; then command -v compute-sanitizer; return 0; fi
  local top=""
  if command -v nvcc >/dev/null 2>&1; then  # nvcc on PATH may be a wrapper: ask it for its toolkit
    top="$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/.*TOP=\([^ ]*\).*/\1/p' | head -n 1 || true)"
  fi
  local d
  for d in "${SPECDEC_CUDA_HOME:-}" "${CUDA_HOME:-}" "$top" /usr/local/cuda /usr/local/cuda-*; do
    [ -n "$d" ] || continue
    for c in "$d/bin/compute-sanitizer" "$d/compute-sanitizer/compute-sanitizer"; do
      if [ -x "$c" ]; then echo "$c"; return 0; fi
    done
  done
  "$PY" - <<'EOF' 2>/dev/null || true
import glob, site, sys
for base in site.getsitepackages():
    for c in glob.glob(base + "/nvidia/**/compute-sanitizer", recursive=True):
        print(c); sys.exit(0)
sys.exit(1)
EOF
}

# ---------------------------------------------------------------------------- stages
run_stage env 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv; \
  $PY -c 'import torch, sys; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'"

ARCH="${TORCH_CUDA_ARCH_LIST:-$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))' 2>/dev/null || echo 9.0)}"
run_stage build 170 env SPECDEC_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
  "$PY" -m pip install -e . --no-build-isolation --no-deps -v

run_stage build_info 30 "$PY" -c "import json, specdec; i = specdec.build_info(); print(json.dumps(i)); \
assert i['cuda'], 'specdec was built without its CUDA kernels'"

TESTS_K="${TESTS_K-cuda and not inductor}"
PYTEST_ARGS=(-q -rfEs -p no:cacheprovider --junitxml="$OUT/pytest_cuda.xml")
if [ -n "$TESTS_K" ]; then PYTEST_ARGS+=(-k "$TESTS_K"); fi
run_stage tests 120 env SPECDEC_FUZZ_EXAMPLES="${SPECDEC_FUZZ_EXAMPLES:-150}" "$PY" -m pytest tests/test_ops_attention.py tests/test_ops_sampling.py tests/test_ops_kv_commit.py \
  tests/test_ops_linear.py tests/test_ops_qlinear.py tests/test_ops_fused.py tests/test_ops_decoder_layer.py tests/test_ops_errors.py tests/test_ops_compile.py tests/test_statistical.py \
  tests/test_fuzz_ops.py tests/test_graphs.py "${PYTEST_ARGS[@]}"

SAN="$(find_sanitizer || true)"
if [ -n "$SAN" ]; then
  echo "compute-sanitizer: $SAN" >"$OUT/sanitizer_path.txt"
  # no caching allocator: an out-of-bounds access cannot hide inside a larger cached block
  run_stage memcheck 50 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SAN" --tool memcheck --error-exitcode 1 \
    --print-limit 50 "$PY" benchmarks/sanitize_ops.py
  for tool in racecheck synccheck initcheck; do
    extra=()
    # initcheck: fresh allocations (no caching allocator) so that reads of never-written memory are seen
    if [ "$tool" = initcheck ]; then extra=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1); fi
    if "$SAN" --tool "$tool" --help >/dev/null 2>&1; then
      run_stage "$tool" 30 "${extra[@]}" "$SAN" --tool "$tool" --error-exitcode 1 --print-limit 50 \
        "$PY" benchmarks/sanitize_ops.py --quick --ops verify_attention sampling kv_commit linear qlinear fused decoder_layer
    else
      skip_stage "$tool" "this compute-sanitizer has no $tool tool"
    fi
  done
else
  skip_stage memcheck "compute-sanitizer not found"
  for tool in racecheck synccheck initcheck; do skip_stage "$tool" "compute-sanitizer not found"; done
fi

run_stage sweep 30 "$PY" benchmarks/sweep_sampling.py --requests "${SWEEP_REQUESTS:-512}" --out "$OUT/sweep_sampling.json"

# shellcheck disable=SC2086
run_stage bench 60 "$PY" benchmarks/bench_ops.py --device cuda --out "$OUT/bench_ops.json" ${BENCH_ARGS:-}

run_stage graphs 60 "$PY" benchmarks/bench_graphs.py --rounds 2 --out "$OUT/graphs.json"

# ---------------------------------------------------------------------------- summary
{
  echo "specdec GPU check — $(date '+%Y-%m-%d %H:%M:%S') — commit $COMMIT — $GPU_NAME"
  echo "results: $OUT   total $(($(date +%s) - START))s (budget ${BUDGET}s)"
  if [ -f "$OUT/build_info.log" ]; then echo "build_info: $(grep -E '^\{' "$OUT/build_info.log" | tail -n 1 || true)"; fi
  echo
  printf '%-12s %s\n' stage status
  for i in "${!NAMES[@]}"; do printf '%-12s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"; done
  if [ -f "$OUT/tests.log" ]; then
    echo
    echo "pytest: $(grep -E '^=* ?[0-9]+ (passed|failed|skipped|errors?|deselected)' "$OUT/tests.log" | tail -n 1 || true)"
    grep -E '^(FAILED|ERROR) ' "$OUT/tests.log" | head -n 30 || true
  fi
  for s in memcheck racecheck synccheck initcheck; do
    if [ -f "$OUT/$s.log" ]; then echo "$s: $(grep -E 'ERROR SUMMARY|failing checks' "$OUT/$s.log" | tr '\n' ' ' || true)"; fi
  done
  if [ -f "$OUT/bench.log" ]; then
    echo
    sed -n '/^# specdec kernel benchmarks/,/^# wrote/p' "$OUT/bench.log"
  fi
  if [ -f "$OUT/graphs.log" ]; then
    echo
    sed -n '/^# SmolLM2/,/^# wrote/p' "$OUT/graphs.log"
  fi
} | tee "$SUMMARY"

FAILED=0
for r in "${RESULTS[@]}"; do case "$r" in PASS*) ;; *) FAILED=1 ;; esac; done
exit "$FAILED"
