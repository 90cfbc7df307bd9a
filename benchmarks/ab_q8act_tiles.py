"""A / B of qlinear_q8act's ymm tiles (csrc/cpu/qlinear_q8act_ymm.h) against the same file at another commit.

    python benchmarks/ab_q8act_tiles.py --base COMMIT [--rounds 9] [--out FILE]

Two builds of one extension cannot share a process (both register the same ops), so this compiles one
small C++ program from the tile header twice, the --base commit's and the working tree's, each in its own
namespace and translation unit behind one out-of-line call as in the library (the AVX2 tier: Q8ACT_VNNI
0, the tier's own flags), and times both on the same
packed weights and activations, interleaved call by call (the order alternating by round), on one
thread. Shapes are the bundled model's (SmolLM2-135M: hidden 576, MLP 1536, 3 KV heads of 64, vocab
49,152) in its formats at ``precision="q4_1", act="q8"`` (layers Q4_1, LM head Q8_0), at M = 1, 2, 4, 8
and 16 activation rows (a decode step, then verify passes). Per shape and M: the median and best time
over rounds of each side and the ratio of the medians; every output is compared bit for bit. Also the
sum a forward would spend in these products (30 layers of q, k, v, o, gate, up, down, plus the head) at
each M, one thread. The layer weights stay in cache between calls here (the head, 30 MB packed, does not):
this isolates the tiles' compute; bench_q8act.py measures whole decode steps.
Writes benchmarks/results/q8act_tiles_ab_<date>.json.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench.record import cpu_name, git_commit, loadavg  # noqa: E402

HEADER = "csrc/cpu/qlinear_q8act_ymm.h"
FLAGS = ["-O3", "-std=c++17", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]
# name, N, K, bits, Q4_1 mins, times per forward
SHAPES = [("q", 576, 576, 4, True, 30), ("k", 192, 576, 4, True, 30), ("v", 192, 576, 4, True, 30),
          ("o", 576, 576, 4, True, 30), ("gate", 1536, 576, 4, True, 30), ("up", 1536, 576, 4, True, 30),
          ("down", 576, 1536, 4, True, 30), ("head", 49152, 576, 8, False, 1)]
ROWS = (1, 2, 4, 8, 16)

# each side in its own translation unit, one out-of-line entry as the library's q8act_rows_avx2
SIDE = r"""
#define Q8ACT_VNNI 0
#define Q8ACT_NS @NS@
#include "@HDR@"
void @NS@_rows(const specdec::cpu::Q8ActParams& P, int64_t b, int64_t e) { specdec::cpu::@NS@::rows(P, b, e); }
"""
HARNESS = r"""
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include "specdec/cpu_q8act.h"
using namespace specdec::cpu;
void base_q8_rows(const Q8ActParams& P, int64_t b, int64_t e);
void new_q8_rows(const Q8ActParams& P, int64_t b, int64_t e);
using clk = std::chrono::steady_clock;
// argv: N K bits mins M calls; prints "base_us new_us same" per call pair (the order alternating)
int main(int argc, char** argv) {
  const int64_t N = atoll(argv[1]), K = atoll(argv[2]), M = atoll(argv[5]), calls = atoll(argv[6]);
  const int bits = atoi(argv[3]); const bool mins = atoi(argv[4]);
  const int64_t G = K / kQ8Block, T = (N + kQ8Rows - 1) / kQ8Rows, blk = kQ8PackBytes(bits, mins);
  std::mt19937 rng(0);
  std::vector<uint8_t> packed(T * G * blk);
  for (auto& b : packed) b = rng() & 255;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {  // float16 scales / mins of modest size (0x2000.. ~ 2^-7)
      uint16_t* sc = reinterpret_cast<uint16_t*>(packed.data() + (t * G + g) * blk + kQ8CodeBytes(bits));
      for (int j = 0; j < (mins ? 32 : 16); ++j) sc[j] = uint16_t(0x2000 + (rng() & 0x3ff));
    }
  std::vector<int8_t> a(M * K);
  for (auto& v : a) v = int8_t(int(rng() % 255) - 127);
  std::vector<float> d(M * G), s(M * G);
  std::vector<int32_t> R(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      int32_t r = 0;
      for (int j = 0; j < kQ8Block; ++j) r += a[m * K + g * kQ8Block + j];
      R[m * G + g] = r; d[m * G + g] = 0.01f; s[m * G + g] = float(r) * 0.01f;
    }
  std::vector<float> y0(M * N), y1(M * N);
  Q8ActParams P{a.data(), d.data(), R.data(), s.data(), packed.data(), nullptr, y0.data(), N, M, N, K, bits, mins};
  Q8ActParams P1 = P;
  P1.y = y1.data();
  base_q8_rows(P, 0, T); new_q8_rows(P1, 0, T);  // warm
  const bool same = std::memcmp(y0.data(), y1.data(), sizeof(float) * M * N) == 0;
  for (int64_t c = 0; c < calls; ++c) {
    double us[2];
    for (int i = 0; i < 2; ++i) {
      const int side = (c + i) % 2;
      const auto t0 = clk::now();
      if (side == 0) base_q8_rows(P, 0, T); else new_q8_rows(P1, 0, T);
      us[side] = std::chrono::duration<double, std::micro>(clk::now() - t0).count();
    }
    printf("%.3f %.3f %d\n", us[0], us[1], int(same));
  }
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit whose tile header is the A side")
    ap.add_argument("--rounds", type=int, default=9, help="calls of each side per shape and M (interleaved)")
    ap.add_argument("--shapes", default=",".join(x[0] for x in SHAPES), help="a subset of the shapes (comma-separated)")
    ap.add_argument("--cxx", default="c++")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    base_src = subprocess.run(["git", "show", f"{a.base}:{HEADER}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
    base_sha = subprocess.run(["git", "rev-parse", "--short", a.base], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    load = [loadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "base_ymm.h").write_text(base_src)
        (t / "new_ymm.h").write_text((ROOT / HEADER).read_text())
        (t / "ab.cpp").write_text(HARNESS)
        for ns in ("base_q8", "new_q8"):
            (t / f"{ns}.cpp").write_text(SIDE.replace("@NS@", ns).replace("@HDR@", ns.replace("_q8", "_ymm.h")))
        exe = t / "ab"
        subprocess.run([a.cxx, *FLAGS, f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc'}", "-o", str(exe),
                        *(str(t / f) for f in ("ab.cpp", "base_q8.cpp", "new_q8.cpp"))], check=True)
        rows = []
        for name, n, k, bits, mins, per_forward in (x for x in SHAPES if x[0] in a.shapes.split(",")):
            for m in ROWS:
                calls = a.rounds if name != "head" else max(3, a.rounds // 2)
                out = subprocess.run([str(exe), str(n), str(k), str(bits), str(int(mins)), str(m), str(calls)],
                                     capture_output=True, text=True, check=True).stdout.split("\n")
                pairs = [tuple(float(v) for v in line.split()) for line in out if line.strip()]
                base_us, new_us = [p[0] for p in pairs], [p[1] for p in pairs]
                rec = dict(shape=name, N=n, K=k, format="q4_1" if mins else ("q8_0" if bits == 8 else "q4_0"), M=m,
                           per_forward=per_forward, base_us_median=round(statistics.median(base_us), 2),
                           new_us_median=round(statistics.median(new_us), 2), base_us_best=round(min(base_us), 2),
                           new_us_best=round(min(new_us), 2),
                           ratio=round(statistics.median(new_us) / statistics.median(base_us), 3),
                           bit_identical=all(p[2] == 1 for p in pairs), base_us=base_us, new_us=new_us)
                rows.append(rec)
                print(f"{name:5s} M={m:2d}  base {rec['base_us_median']:9.1f} us  new {rec['new_us_median']:9.1f} us"
                      f"  ratio {rec['ratio']:.3f}  same bits {rec['bit_identical']}", flush=True)
    load.append(loadavg())
    forward = {}
    for m in ROWS if len(rows) == len(SHAPES) * len(ROWS) else ():
        sel = [r for r in rows if r["M"] == m]
        b = sum(r["base_us_median"] * r["per_forward"] for r in sel) / 1e3
        n = sum(r["new_us_median"] * r["per_forward"] for r in sel) / 1e3
        forward[str(m)] = dict(base_ms=round(b, 3), new_ms=round(n, 3), ratio=round(n / b, 3))
        print(f"forward's products at M={m:2d}: base {b:.2f} ms, new {n:.2f} ms, ratio {n / b:.3f} (one thread)")
    ratios_1 = {m: forward[str(m)]["new_ms"] / forward["1"]["new_ms"] for m in ("2", "4", "8", "16") if forward}
    res = {"benchmark": "q8act_tiles_ab", "date": _dt.date.today().isoformat(), "commit": git_commit(),
           "base": base_sha, "cpu": cpu_name(), "tier": "avx2", "threads": 1, "loadavg": load, "rounds": a.rounds,
           "compiler_flags": FLAGS, "forward_products_ms": forward,
           "new_m_rows_vs_1_row": {m: round(v, 3) for m, v in ratios_1.items()},
           "all_bit_identical": all(r["bit_identical"] for r in rows), "rows": rows,
           "notes": "one thread, shared 2-core host; the layer weights are cache-resident between calls, the "
                    "head is not: compute of the tiles, not decode steps (bench_q8act.py)"}
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"q8act_tiles_ab_{res['date']}.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
