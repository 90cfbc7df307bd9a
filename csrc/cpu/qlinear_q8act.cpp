// qlinear_q8act, CPU backend: group-quantized weights (Q8_0 / Q4_0 / Q4_1) times activations
// quantized per row and block of 32 to int8 (the definition: csrc/include/specdec/cpu_q8act.h).
// This file: validation, the activation quantization (once per call: M * K values, on the calling thread, or
// from 5 rows on every thread inside the products' parallel region), the scalar tier, the tier choice and the
// parallel split over output rows. The vector
// tiers live in qlinear_q8act_avx2.cpp / _avxvnni.cpp / _avx512.cpp; all give the same bits.
//
// Compiled with -ffp-contract=off (CMakeLists.txt): the definition's fused multiply-adds are explicit
// (std::fma here, fma intrinsics in the vector tiers); every other product and sum rounds on its own.
#include <ATen/Parallel.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/head_argmax.h"
#include "cpu/raw.h"
#include "q8act.h"
#include "specdec/cpu_isa.h"
#include "specdec/cpu_q8act.h"
#include "specdec/cpu_vec.h"

namespace specdec {
namespace cpu {

void q8_quantize_scalar(const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* a, float* dq, int32_t* R,
                        float* s) {
  const int64_t G = K / kQ8Block;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xb = x + m * x_stride + g * kQ8Block;
      int8_t* ab = a + m * K + g * kQ8Block;
      float amax = 0.0f;
      for (int64_t j = 0; j < kQ8Block; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.0f, inv = 127.0f / amax, id = std::isfinite(inv) ? inv : 0.0f;
      int32_t sum = 0;
      for (int64_t j = 0; j < kQ8Block; ++j) {
        const float q = std::nearbyint(xb[j] * id);  // the default rounding mode: half to even
        ab[j] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q)));
        sum += ab[j];
      }
      dq[m * G + g] = d;
      R[m * G + g] = sum;
      s[m * G + g] = static_cast<float>(sum) * d;
    }
  }
}

void q8_pack(const void* qw, const uint16_t* scales, const uint16_t* mins, int64_t N, int64_t K, int bits,
             uint8_t* out) {
  const int64_t G = K / kQ8Block, T = (N + kQ8Rows - 1) / kQ8Rows, row_bytes = bits == 8 ? K : K / 2;
  const int64_t code = kQ8CodeBytes(bits), blk = kQ8PackBytes(bits, mins != nullptr), vecs = code / 64;
  const uint8_t* w = static_cast<const uint8_t*>(qw);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* b = out + (t * G + g) * blk;
      uint16_t* sc = reinterpret_cast<uint16_t*>(b + code);
      uint16_t* mn = mins ? sc + kQ8Rows : nullptr;
      for (int64_t j = 0; j < kQ8Rows; ++j) {
        const int64_t n = t * kQ8Rows + j;
        const bool real = n < N;
        for (int64_t k = 0; k < vecs; ++k)
          for (int i = 0; i < 4; ++i) {
            const uint8_t v = real ? w[n * row_bytes + g * (code / kQ8Rows) + 4 * k + i] : 0;
            b[64 * k + 4 * j + i] = bits == 8 ? uint8_t(v ^ 0x80u) : v;
          }
        sc[j] = real ? scales[n * G + g] : 0;
        if (mn) mn[j] = real ? mins[n * G + g] : 0;
      }
    }
}

namespace {

// Code e (0..31) of block g of weight row n, read from the packed layout (Q8_0: q; Q4_0: q - 8; Q4_1: q).
inline int32_t packed_code(const Q8ActParams& P, const uint8_t* b, int64_t j, int e) {
  if (P.bits == 8) return int32_t(b[64 * (e / 4) + 4 * j + e % 4]) - 128;
  const int i = e & 15;
  const uint8_t v = b[64 * (i / 4) + 4 * j + i % 4];
  const int32_t q = e < 16 ? (v & 15) : (v >> 4);
  return P.mins ? q : q - 8;
}

}  // namespace

void q8act_rows_scalar(const Q8ActParams& P, int64_t t_begin, int64_t t_end) {
  const int64_t G = P.K / kQ8Block, blk = kQ8PackBytes(P.bits, P.mins), code = kQ8CodeBytes(P.bits);
  for (int64_t t = t_begin; t < t_end; ++t)
    for (int64_t j = 0; j < kQ8Rows && t * kQ8Rows + j < P.N; ++j) {
      const int64_t n = t * kQ8Rows + j;
      for (int64_t m = 0; m < P.M; ++m) {
        const int8_t* am = P.a + m * P.K;
        float acc = 0.0f;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* b = P.packed + (t * G + g) * blk;
          const uint16_t* sc = reinterpret_cast<const uint16_t*>(b + code);
          int32_t p = 0;
          for (int e = 0; e < kQ8Block; ++e) p += packed_code(P, b, j, e) * am[g * kQ8Block + e];
          acc = std::fma(static_cast<float>(p), half_to_float(sc[j]) * P.d[m * G + g], acc);
          if (P.mins) acc = std::fma(half_to_float(sc[kQ8Rows + j]), P.s[m * G + g], acc);
        }
        P.y[m * P.y_stride + n] = acc + (P.bias ? P.bias[n] : 0.0f);
      }
    }
}

namespace {

std::atomic<int> g_tier{kQ8TierAuto};
std::atomic<int64_t> g_prefetch{kQ8PrefetchBlocks};
// The AVX-512 VNNI tier's one- and two-row Q4 passes over two weight groups at once: measured faster on an
// Intel AVX-512 VNNI CPU (docs/benchmarks.md), slower on an AMD one (family 25: a decode step 0.79x, a two-row
// pass 0.77x with one group at a time, benchmarks/results/q8act_pairs_ab_2026-12-07.json), where the weights
// stream from DRAM; so off on AMD CPUs, on elsewhere.
bool amd_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();  // a static initializer may run before libgcc's own
  return __builtin_cpu_is("amd");
#else
  return false;
#endif
}
bool default_group_pairs() { return !amd_cpu(); }
std::atomic<bool> g_group_pairs{default_group_pairs()};
// The AVX-512 VNNI tiles' prefetch distances: measured best per CPU vendor (cpu_q8act.h); the same bits at any.
std::atomic<int64_t> g_block_prefetch{amd_cpu() ? kQ8BlockPrefetch : kQ8BlockPrefetchOther};
std::atomic<int64_t> g_stream_prefetch{amd_cpu() ? kQ8StreamPrefetch : kQ8StreamPrefetchOther};
std::atomic<int64_t> g_prefetch_level{1};
std::atomic<int64_t> g_amx_rows{kQ8AmxRows};
std::atomic<bool> g_parallel_quantize{true};
std::atomic<int64_t> g_many_q8{kQ8ManyRowsQ8}, g_many_q4{kQ8ManyRowsQ4};

bool tier_supported(int t) {
#if defined(__x86_64__) || defined(__i386__)
  switch (t) {
    case kQ8Avx512Vnni: {
      static const bool ok = has_avx2_fma_f16c() && __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                             __builtin_cpu_supports("avx512vnni");
      return ok;
    }
    case kQ8AvxVnni: {
      static const bool ok = has_avx2_fma_f16c() && __builtin_cpu_supports("avxvnni");
      return ok;
    }
    case kQ8Avx2: return has_avx2_fma_f16c();
    default: return t == kQ8Scalar;
  }
#else
  return t == kQ8Scalar;
#endif
}

constexpr const char* kTierNames[] = {"avx512_vnni", "avx_vnni", "avx2", "scalar"};

int active_tier() {
  const int forced = g_tier.load(std::memory_order_relaxed);
  if (forced != kQ8TierAuto) return forced;
  for (int t = kQ8Avx512Vnni; t <= kQ8Scalar; ++t)
    if (tier_supported(t)) return t;
  return kQ8Scalar;
}

}  // namespace

std::string set_q8act_tier(const std::string& name) {
  const std::string previous = g_tier.load() == kQ8TierAuto ? "auto" : kTierNames[g_tier.load()];
  if (name == "auto") {
    g_tier.store(kQ8TierAuto);
    return previous;
  }
  for (int t = kQ8Avx512Vnni; t <= kQ8Scalar; ++t) {
    if (name != kTierNames[t]) continue;
    TORCH_CHECK(tier_supported(t), "set_q8act_tier: this CPU does not run the ", name, " tier; it runs ",
                q8act_tiers());
    g_tier.store(t);
    return previous;
  }
  TORCH_CHECK(false, "set_q8act_tier: tier must be one of auto, avx512_vnni, avx_vnni, avx2, scalar; got '", name,
              "'");
  return previous;
}

std::string q8act_tier() { return kTierNames[active_tier()]; }

namespace {
// A prefetch distance switch: `blocks` checked against 0..hi, stored; the previous value returned.
int64_t exchange_blocks(std::atomic<int64_t>& knob, int64_t blocks, int64_t hi, const char* name) {
  TORCH_CHECK(blocks >= 0 && blocks <= hi, name, ": blocks must be in 0..", hi, ", got ", blocks);
  return knob.exchange(blocks);
}
}  // namespace

int64_t set_q8act_prefetch(int64_t blocks) { return exchange_blocks(g_prefetch, blocks, 4096, "set_q8act_prefetch"); }

bool set_q8act_group_pairs(bool on) { return g_group_pairs.exchange(on); }

bool set_q8act_parallel_quantize(bool on) { return g_parallel_quantize.exchange(on); }

std::tuple<int64_t, int64_t> set_q8act_many_rows(int64_t q8_rows, int64_t q4_rows) {
  TORCH_CHECK(q8_rows >= 1 && q8_rows <= 9 && q4_rows >= 1 && q4_rows <= 9,
              "set_q8act_many_rows: q8_rows and q4_rows must be in 1..9 (9: never, tiles hold at most 8 rows), got ",
              q8_rows, " and ", q4_rows);
  return {g_many_q8.exchange(q8_rows), g_many_q4.exchange(q4_rows)};
}

int64_t set_q8act_block_prefetch(int64_t blocks) {
  return exchange_blocks(g_block_prefetch, blocks, 64, "set_q8act_block_prefetch");
}

int64_t set_q8act_stream_prefetch(int64_t blocks) {
  return exchange_blocks(g_stream_prefetch, blocks, 64, "set_q8act_stream_prefetch");
}

int64_t set_q8act_amx_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= 65, "set_q8act_amx_rows: rows must be in 0..65 (0: never AMX), got ", rows);
  return g_amx_rows.exchange(rows);
}

bool q8act_amx() { return amx_available(); }

int64_t set_q8act_prefetch_level(int64_t level) {
  TORCH_CHECK(level == 1 || level == 2, "set_q8act_prefetch_level: level must be 1 (L1) or 2 (L2), got ", level);
  return g_prefetch_level.exchange(level);
}

std::string q8act_tiers() {
  std::string out;
  for (int t = kQ8Avx512Vnni; t <= kQ8Scalar; ++t)
    if (tier_supported(t)) out += (out.empty() ? "" : ",") + std::string(kTierNames[t]);
  return out;
}

namespace {

void quantize_rows(int tier, const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* a, float* d, int32_t* R,
                   float* s) {
  if (M <= 0) return;
  if (tier == kQ8Scalar) q8_quantize_scalar(x, x_stride, M, K, a, d, R, s);
  else q8_quantize_avx2(x, x_stride, M, K, a, d, R, s);
}

// The product's parameters: Q's shapes, bias and output, the quantized activations, the packed weight and the
// process-wide tuning switches (none changes a bit).
Q8ActParams params_of(const QLinearParams& Q, const uint8_t* packed, const int8_t* a, const float* d,
                      const int32_t* R, const float* s) {
  Q8ActParams P;
  P.a = a;
  P.d = d;
  P.R = R;
  P.s = s;
  P.packed = packed;
  P.bias = Q.bias;
  P.y = Q.y;
  P.y_stride = Q.y_stride;
  P.M = Q.M;
  P.N = Q.N;
  P.K = Q.K;
  P.bits = Q.bits;
  P.mins = Q.mins != nullptr;
  P.prefetch = g_prefetch.load(std::memory_order_relaxed);
  P.group_pairs = g_group_pairs.load(std::memory_order_relaxed);
  P.many_rows_q8 = g_many_q8.load(std::memory_order_relaxed);
  P.many_rows_q4 = g_many_q4.load(std::memory_order_relaxed);
  P.block_prefetch = g_block_prefetch.load(std::memory_order_relaxed);
  P.stream_prefetch = g_stream_prefetch.load(std::memory_order_relaxed);
  P.prefetch_l1 = g_prefetch_level.load(std::memory_order_relaxed) == 1;
  P.amx_rows = g_amx_rows.load(std::memory_order_relaxed);
  return P;
}

using Q8Rows = void (*)(const Q8ActParams&, int64_t, int64_t);

Q8Rows rows_of_tier(int tier) {
  return tier == kQ8Avx512Vnni ? &q8act_rows_avx512vnni
         : tier == kQ8AvxVnni  ? &q8act_rows_avxvnni
         : tier == kQ8Avx2     ? &q8act_rows_avx2
                               : &q8act_rows_scalar;
}

}  // namespace

void qlinear_q8act_raw(const float* x, int64_t x_stride, const QLinearParams& Q) {
  const int64_t M = Q.M, K = Q.K, G = K / kQ8Block, T = (Q.N + kQ8Rows - 1) / kQ8Rows;
  const int tier = active_tier();
  const bool mins = Q.mins != nullptr;
  // one scratch per calling thread, kept across calls (no allocation per decode step once it has grown):
  // codes [M, K], then R [M, G], d / s [M, G] (4-byte aligned: K % 32 == 0), then the packed weight when
  // the caller passes the usual layout
  thread_local std::vector<int32_t> scratch;
  const size_t act = size_t(M * K / 4 + 3 * M * G);
  const size_t pack = Q.q8packed ? 0 : size_t(T * G * kQ8PackBytes(Q.bits, mins) / 4);
  if (scratch.size() < act + pack) scratch.resize(act + pack);
  int8_t* a = reinterpret_cast<int8_t*>(scratch.data());
  int32_t* R = scratch.data() + M * K / 4;
  float* d = reinterpret_cast<float*>(R + M * G);
  float* s = d + M * G;
  const uint8_t* packed = Q.q8packed;
  if (packed == nullptr) {
    uint8_t* out = reinterpret_cast<uint8_t*>(scratch.data() + act);
    q8_pack(Q.qw, Q.scales, Q.mins, Q.N, K, Q.bits, out);
    packed = out;
  }
  auto quantize = [&](int64_t m0, int64_t m1) {  // rows m0..m1 of the activations
    quantize_rows(tier, x + m0 * x_stride, x_stride, m1 - m0, K, a + m0 * K, d + m0 * G, R + m0 * G, s + m0 * G);
  };
  const Q8ActParams P = params_of(Q, packed, a, d, R, s);
  const Q8Rows rows = rows_of_tier(tier);
  // tasks of >= ~128K integer multiply-adds: a 576 x 576 decode-step weight splits over 2 threads
  const int64_t grain = std::max<int64_t>(1, (int64_t(128) << 10) / std::max<int64_t>(1, kQ8Rows * K * M));
#ifdef _OPENMP
  // Five activation rows or more: the threads quantize a share of the rows each, meet at a barrier, then take
  // the weight groups as at::parallel_for would split them (one parallel region; the quantization on the calling
  // thread alone kept the others waiting: 8-node passes 0.95x / 0.92x in two runs, 16 nodes 0.94x, 5 nodes 0.94x;
  // 4 nodes 0.97x / 1.05x; at 2 rows the barrier cost more than it saved, 1.09x:
  // benchmarks/results/q8act_pquant_prefetch_2026-12-07*.json). The same bits either way: each row is quantized
  // by itself (set_q8act_parallel_quantize(false): the calling thread quantizes, for A/Bs).
  const int64_t nthreads = at::get_num_threads();
  if (M >= 5 && nthreads > 1 && T > grain && !at::in_parallel_region() &&
      g_parallel_quantize.load(std::memory_order_relaxed)) {
#pragma omp parallel num_threads(static_cast<int>(nthreads))
    {
      const int64_t n = omp_get_num_threads(), tid = omp_get_thread_num();
      quantize(M * tid / n, M * (tid + 1) / n);
#pragma omp barrier
      const int64_t workers = std::min<int64_t>(n, (T + grain - 1) / grain), chunk = (T + workers - 1) / workers;
      const int64_t t0 = tid * chunk;
      if (tid < workers && t0 < T) rows(P, t0, std::min(T, t0 + chunk));
    }
    return;
  }
#endif
  quantize(0, M);
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) { rows(P, begin, end); });
}

}  // namespace cpu

at::Tensor qlinear_q8act_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                             int64_t bits) {
  checks::qlinear_q8act(x, qweight, scales, mins, bias, bits);
  if (auto y = checks::linear_trivial(x, scales, bias)) return *y;  // scales: [N, K / 32]
  const int64_t K = x.size(-1), N = scales.size(0);
  const int64_t M = checks::linear_rows(x);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor x2 = x.reshape({M, K}).to(at::kFloat).contiguous();
  std::optional<at::Tensor> b32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const bool packed = qweight.dim() == 3;
  cpu::QLinearParams Q;
  Q.x = nullptr;
  Q.x_stride = K;
  Q.xsum = nullptr;
  Q.qw = packed ? nullptr : qweight.data_ptr();
  Q.q8packed = packed ? qweight.data_ptr<uint8_t>() : nullptr;
  Q.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  Q.mins = mins.has_value() ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr;
  Q.bias = b32.has_value() ? b32->data_ptr<float>() : nullptr;
  Q.y = y.data_ptr<float>();
  Q.y_stride = N;
  Q.M = M;
  Q.N = N;
  Q.K = K;
  Q.bits = int(bits);
  cpu::qlinear_q8act_raw(x2.data_ptr<float>(), K, Q);
  if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
  return y.view(out_shape);
}

at::Tensor pack_q8act_cpu(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                          int64_t bits) {
  checks::pack_q8act(qweight, scales, mins, bits);
  const int64_t N = qweight.size(0), G = scales.size(1), K = G * cpu::kQ8Block;
  const int64_t T = (N + cpu::kQ8Rows - 1) / cpu::kQ8Rows;
  at::Tensor out = at::empty({T, G, cpu::kQ8PackBytes(int(bits), mins.has_value())}, qweight.options().dtype(at::kByte));
  if (out.numel() > 0)
    cpu::q8_pack(qweight.data_ptr(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                 mins.has_value() ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr, N, K,
                 int(bits), out.data_ptr<uint8_t>());
  return out;
}

std::tuple<at::Tensor, at::Tensor> quantize_q8_cpu(const at::Tensor& x) {
  checks::quantize_q8(x);
  const int64_t K = x.size(-1), M = checks::linear_rows(x), G = K / cpu::kQ8Block;
  const at::Tensor x2 = x.reshape({M, K}).to(at::kFloat).contiguous();
  at::Tensor a = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, G}, x.options().dtype(at::kFloat));
  std::vector<float> s(M * G);
  std::vector<int32_t> R(M * G);
  if (M > 0 && K > 0) {
    if (cpu::q8act_tier() == "scalar")
      cpu::q8_quantize_scalar(x2.data_ptr<float>(), K, M, K, a.data_ptr<int8_t>(), d.data_ptr<float>(), R.data(),
                              s.data());
    else
      cpu::q8_quantize_avx2(x2.data_ptr<float>(), K, M, K, a.data_ptr<int8_t>(), d.data_ptr<float>(), R.data(),
                            s.data());
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  std::vector<int64_t> dshape = shape;
  dshape.back() = G;
  return {a.view(shape), d.view(dshape)};
}

at::Tensor qlinear_argmax_q8act_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                    const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                                    int64_t bits) {
  const char* op = "qlinear_argmax";
  cpu::checked_as(op, "qlinear_q8act", [&] { checks::qlinear_q8act(x, qweight, scales, mins, bias, bits); });
  const int64_t K = x.size(-1), N = scales.size(0), M = checks::linear_rows(x), G = K / cpu::kQ8Block;
  cpu::check_argmax_columns(op, N);
  const std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end() - 1);
  // the blocked argmax over the CPU's packed layout, at decode and verify sizes; otherwise (the usual layout,
  // packed per call, or more rows) the argmax of the materialised product
  if (M == 0 || K == 0 || qweight.dim() != 3 || M > cpu::kArgmaxQ8Rows)
    return cpu::argmax_rows_cpu(qlinear_q8act_cpu(x, qweight, scales, mins, bias, bits)).view(out_shape);
  const at::Tensor x2 = x.reshape({M, K}).to(at::kFloat).contiguous();
  std::optional<at::Tensor> b32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  const int tier = cpu::active_tier();
  // the quantized activations (codes [M, K], then R, d, s [M, G]): one scratch per calling thread, kept across
  // calls as qlinear_q8act_raw keeps its own
  thread_local std::vector<int32_t> scratch;
  if (scratch.size() < size_t(M * K / 4 + 3 * M * G)) scratch.resize(size_t(M * K / 4 + 3 * M * G));
  int8_t* a = reinterpret_cast<int8_t*>(scratch.data());
  int32_t* R = scratch.data() + M * K / 4;
  float* d = reinterpret_cast<float*>(R + M * G);
  float* s = d + M * G;
  cpu::quantize_rows(tier, x2.data_ptr<float>(), K, M, K, a, d, R, s);
  cpu::QLinearParams Q;
  Q.bias = b32.has_value() ? b32->data_ptr<float>() : nullptr;
  Q.mins = mins.has_value() ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr;
  Q.y = nullptr;
  Q.y_stride = 0;
  Q.M = M;
  Q.N = N;
  Q.K = K;
  Q.bits = int(bits);
  const uint8_t* packed = qweight.data_ptr<uint8_t>();
  const cpu::Q8ActParams P = cpu::params_of(Q, packed, a, d, R, s);
  const cpu::Q8Rows rows = cpu::rows_of_tier(tier);
  const int64_t blk = cpu::kQ8PackBytes(int(bits), mins.has_value());
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  cpu::blocked_argmax(M, N, x.scalar_type(), [&](int64_t n0, int64_t n1, float* y, int64_t y_stride) {
    cpu::Q8ActParams S = P;
    S.packed = packed + (n0 / cpu::kQ8Rows) * G * blk;
    S.bias = P.bias ? P.bias + n0 : nullptr;
    S.N = n1 - n0;
    S.y = y;
    S.y_stride = y_stride;
    rows(S, 0, (S.N + cpu::kQ8Rows - 1) / cpu::kQ8Rows);
  }, out.data_ptr<int64_t>());
  return out.view(out_shape);
}

}  // namespace specdec
