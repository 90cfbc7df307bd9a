#!/usr/bin/env bash
# Long profile of the op fuzz harness (tests/fuzz_ops.py): every op, several seeds, many
# examples, each batch in its own process (a crash fails that batch with its last case).
#   bash benchmarks/fuzz_ops.sh                 # CPU; EXAMPLES=5000 SEEDS="1 2 3"
#   DEVICES="cpu cuda" bash benchmarks/fuzz_ops.sh
# Writes benchmarks/results/fuzz_<date>_<commit>.txt; exit status 1 if any batch failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python}"
EXAMPLES="${EXAMPLES:-5000}"
SEEDS="${SEEDS:-1 2 3}"
DEVICES="${DEVICES:-cpu}"
OPS="verify_attention append_kv rejection_sample greedy_verify kv_commit linear qlinear rms_norm add_rms_norm rope silu_mul"
OUT="benchmarks/results/fuzz_$(date +%Y%m%d-%H%M%S)_$(git rev-parse --short HEAD 2>/dev/null || echo unknown).txt"
mkdir -p benchmarks/results
fail=0
{
  echo "specdec op fuzz, long profile — $(date '+%Y-%m-%d %H:%M:%S') — commit $(git rev-parse --short HEAD 2>/dev/null)"
  echo "examples per batch $EXAMPLES, seeds $SEEDS, devices $DEVICES, load average $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT"
for dev in $DEVICES; do
  for op in $OPS; do
    for s in $SEEDS; do
      log="$(mktemp)"
      if "$PY" tests/fuzz_ops.py --op "$op" --examples "$EXAMPLES" --seed "$s" --device "$dev" --show-errors 3 \
          2>"$log" | tee -a "$OUT"; then :; else
        rc=${PIPESTATUS[0]}
        fail=1
        { echo "FAIL $op $dev seed $s (exit $rc); last case:"; grep "^$op:" "$log" | tail -n 1
          grep -v "^$op:" "$log" | tail -n 40; } | tee -a "$OUT"
      fi
      rm -f "$log"
    done
  done
done
echo "wrote $OUT"
exit $fail
