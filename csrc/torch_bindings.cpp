// The one registration file: every op schema of the `specdec` torch library, its
// CPU and CUDA implementations, and the pybind11 module `specdec._C`.
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/raw.h"
#include "ops.h"
#include "q8act.h"
#include "specdec/cpu_isa.h"
#include "specdec/cuda_plan.h"

namespace specdec {
void bind_suffix_index(pybind11::module_& m);  // csrc/host/suffix_index_bindings.cpp
void bind_recycling(pybind11::module_& m);     // csrc/host/recycling.cpp
void bind_sglang_host(pybind11::module_& m);   // csrc/host/sglang_host.cpp
void bind_vllm_host(pybind11::module_& m);     // csrc/host/vllm_host.cpp
}

#ifndef SPECDEC_TORCH_VERSION
#define SPECDEC_TORCH_VERSION "unknown"
#endif
#ifndef SPECDEC_CUDA_VERSION
#define SPECDEC_CUDA_VERSION ""
#endif
#ifndef SPECDEC_CUDA_ARCHS
#define SPECDEC_CUDA_ARCHS ""
#endif

TORCH_LIBRARY(specdec, m) {
  // Attention of the last Nq of a step's Nkv new tree nodes over the committed KV prefix + the new nodes
  // (tree_mask [B, Nq, Nkv] among the new nodes; None: causal chain, Nkv = Nq).
  m.def("verify_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_lens, Tensor? tree_mask, "
        "float scale) -> Tensor");
  // Write the new nodes' K/V at cache_lens[b] + offset + j (cache_lens unchanged).
  m.def("append_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k_new, Tensor v_new, Tensor cache_lens, "
        "int offset=0) -> ()");
  // Tree speculative sampling (min(1, p/q), residual norm(max(0, p - q)), bonus draw).
  m.def("rejection_sample(Tensor tokens, Tensor parents, Tensor target_probs, Tensor? draft_probs, "
        "Tensor uniforms) -> (Tensor, Tensor, Tensor)");
  // Greedy tree verification: accept the child equal to the target argmax.
  m.def("greedy_verify(Tensor tokens, Tensor parents, Tensor target_logits) -> (Tensor, Tensor, Tensor)");
  // In-place compaction of the accepted path in every layer's cache; cache_lens += num_accepted + 1.
  m.def("kv_commit(Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor(c!) cache_lens, Tensor accepted, "
        "Tensor num_accepted) -> ()");
  // y = x W^T (* weight_scale per output row for int8 W) (+ bias), float32 accumulation; few-row x.
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, Tensor? weight_scale) -> Tensor");
  m.def("qlinear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, int bits) -> Tensor");
  // qlinear with activations quantized per row and block of 32 to int8 (csrc/include/specdec/cpu_q8act.h)
  m.def("qlinear_q8act(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, int bits) -> Tensor");
  m.def("quantize_q8(Tensor x) -> (Tensor, Tensor)");
  // argmax over the last dim of linear's / qlinear's (q8act: qlinear_q8act's) result, without the logits on the
  // CPU (vocabulary slabs); int64 [...]
  m.def("linear_argmax(Tensor x, Tensor weight, Tensor? bias, Tensor? weight_scale) -> Tensor");
  m.def("qlinear_argmax(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, int bits, "
        "bool q8act) -> Tensor");
  // the CPU tiers' packed weight layout for qlinear_q8act (made once per model; csrc/include/specdec/cpu_q8act.h)
  m.def("pack_q8act(Tensor qweight, Tensor scales, Tensor? mins, int bits) -> Tensor");
  // The fused small ops of a Llama-style layer (transformers' rounding steps, one call each).
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // (rms_norm(x + residual), x + residual)
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  // rotate-half RoPE of q [B, N, Hq, D] and k [B, N, Hkv, D] with the model's cos / sin [B, N, D]
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  // One Llama-style decoder layer (the ops above in sequence, one call): x normed input, h residual
  // stream; projections in 7 slots (q, k, v, o, gate, up, down) or 4 (qkv, o, gate_up, down), bits 0 =
  // linear, 4 / 8 = qlinear. Returns (next normed input, residual stream); writes the new K/V.
  m.def("decoder_layer(Tensor x, Tensor h, Tensor[] weights, Tensor?[] scales, Tensor?[] mins, Tensor?[] biases, "
        "int[] bits, Tensor post_norm_weight, float post_norm_eps, Tensor next_norm_weight, float next_norm_eps, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_lens, Tensor cos, Tensor sin, Tensor? tree_mask, "
        "int kv_offset, float scale, int num_heads, int num_kv_heads) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("verify_attention", &specdec::verify_attention_cpu);
  m.impl("append_kv", &specdec::append_kv_cpu);
  m.impl("rejection_sample", &specdec::rejection_sample_cpu);
  m.impl("greedy_verify", &specdec::greedy_verify_cpu);
  m.impl("kv_commit", &specdec::kv_commit_cpu);
  m.impl("linear", &specdec::linear_cpu);
  m.impl("qlinear", &specdec::qlinear_cpu);
  m.impl("qlinear_q8act", &specdec::qlinear_q8act_cpu);
  m.impl("quantize_q8", &specdec::quantize_q8_cpu);
  m.impl("linear_argmax", &specdec::linear_argmax_cpu);
  m.impl("qlinear_argmax", &specdec::qlinear_argmax_cpu);
  m.impl("pack_q8act", &specdec::pack_q8act_cpu);
  m.impl("rms_norm", &specdec::rms_norm_cpu);
  m.impl("add_rms_norm", &specdec::add_rms_norm_cpu);
  m.impl("rope", &specdec::rope_cpu);
  m.impl("silu_mul", &specdec::silu_mul_cpu);
  m.impl("decoder_layer", &specdec::decoder_layer);
}

#ifdef SPECDEC_WITH_CUDA
TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("verify_attention", &specdec::verify_attention_cuda);
  m.impl("append_kv", &specdec::append_kv_cuda);
  m.impl("rejection_sample", &specdec::rejection_sample_cuda);
  m.impl("greedy_verify", &specdec::greedy_verify_cuda);
  m.impl("kv_commit", &specdec::kv_commit_cuda);
  m.impl("linear", &specdec::linear_cuda);
  m.impl("qlinear", &specdec::qlinear_cuda);
  m.impl("qlinear_q8act", &specdec::qlinear_q8act_cuda);
  m.impl("quantize_q8", &specdec::quantize_q8_cuda);
  m.impl("linear_argmax", &specdec::linear_argmax_cuda);
  m.impl("qlinear_argmax", &specdec::qlinear_argmax_cuda);
  m.impl("pack_q8act", &specdec::pack_q8act_cpu);  // refuses CUDA tensors with a message naming the layout
  m.impl("rms_norm", &specdec::rms_norm_cuda);
  m.impl("add_rms_norm", &specdec::add_rms_norm_cuda);
  m.impl("rope", &specdec::rope_cuda);
  m.impl("silu_mul", &specdec::silu_mul_cuda);
  m.impl("decoder_layer", &specdec::decoder_layer);
}
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "specdec compiled ops (registered as torch.ops.specdec.*)";
  m.def("build_info", []() {
    pybind11::dict info;
#ifdef SPECDEC_WITH_CUDA
    info["cuda"] = true;
#else
    info["cuda"] = false;
#endif
    info["cuda_archs"] = std::string(SPECDEC_CUDA_ARCHS);
    info["cuda_version"] = std::string(SPECDEC_CUDA_VERSION);
    info["torch_version"] = std::string(SPECDEC_TORCH_VERSION);
    info["cpu_avx2"] = specdec::cpu::has_avx2_fma_f16c();  // this CPU runs the AVX2 / FMA / F16C kernels
    info["cpu_avx512"] = specdec::cpu::has_avx512();       // ... and the AVX-512 F / DQ / VL ones
    return info;
  }, "What this build of specdec._C contains: CUDA kernels or not, archs, torch/CUDA versions.");
  m.def("cuda_plan", [](int64_t dtype_bytes, int64_t head_dim, int64_t capacity, int64_t rows,
                        int64_t batch_rows) {
    // the launch plans of the CUDA kernels (specdec/cuda_plan.h), computed by the same code on any build
    TORCH_CHECK(dtype_bytes == 2 || dtype_bytes == 4, "cuda_plan: dtype_bytes must be 2 or 4, got ", dtype_bytes);
    TORCH_CHECK(head_dim > 0 && head_dim % 16 == 0 && head_dim <= 256, "cuda_plan: head_dim must be a multiple "
                "of 16 in [16, 256], got ", head_dim);
    TORCH_CHECK(capacity >= 1 && rows >= 1 && batch_rows >= 1, "cuda_plan: capacity, rows and batch_rows must "
                "be >= 1, got ", capacity, ", ", rows, ", ", batch_rows);
    const auto p = specdec::plan::attention_plan(dtype_bytes == 2, int(head_dim), capacity, rows, batch_rows);
    pybind11::dict attn;
    attn["invariant"] = p.invariant;
    attn["min_chunk"] = p.min_chunk;
    attn["chunk"] = p.chunk;
    attn["splits"] = p.splits;
    attn["key_warps"] = p.wk;
    attn["row_warps"] = p.wm;
    attn["rows_per_tile"] = p.rows_per_tile;
    attn["row_tiles"] = p.row_tiles;
    attn["key_block"] = specdec::plan::attn_key_block(dtype_bytes == 2, int(head_dim));
    attn["key_step"] = specdec::plan::attn_key_step(dtype_bytes == 2);
    pybind11::dict info;
    info["attention"] = attn;
    info["linear_row_block"] = specdec::plan::linear_row_block(batch_rows);  // 0: cuBLAS
    info["linear_invariant_rows"] = specdec::plan::kLinearInvariantRows;
    return info;
  }, pybind11::arg("dtype_bytes"), pybind11::arg("head_dim"), pybind11::arg("capacity"), pybind11::arg("rows"),
     pybind11::arg("batch_rows"),
     "The CUDA verify_attention / linear launch plans (specdec/cuda_plan.h) for one shape: rows = G * N query "
     "rows per (request, KV head), batch_rows = B * N (the linear calls' rows); computed on any build.");
  m.def("set_strict_checks", &specdec::checks::set_strict, pybind11::arg("on"),
        "Check tensor VALUES (lengths, tokens, paths) of CUDA inputs too (costs a host sync per op).");
  m.def("strict_checks", &specdec::checks::strict, "Whether strict value checks are on.");
  m.def("set_cpu_gemm", &specdec::cpu::set_gemm, pybind11::arg("on"),
        "Prefill-size linears on the CPU (AVX2): specdec's GEMM tiles (True, the default) for float32 "
        "weights at 65-256 rows and half, int8 and group-quantized weights above 64 rows, or (False) torch's "
        "BLAS GEMM and the few-row kernels. For benchmarks and tests.");
  m.def("cpu_gemm", &specdec::cpu::gemm_enabled, "Whether prefill-size CPU linears use specdec's GEMM tiles.");
  m.def("set_cpu_prefill", &specdec::cpu::set_prefill, pybind11::arg("on"),
        "Prefill rows on this thread (default off): CPU linears take the GEMM tiles at every row count, so "
        "a prompt's rows do not depend on its length or batch, but differ in rounding from the few-row "
        "kernels of decode and verify. Returns the previous value. Use specdec.ops.prefill_rows().");
  m.def("cpu_prefill", &specdec::cpu::prefill_enabled, "Whether prefill rows are on for this thread.");
  m.def("set_cpu_avx512", &specdec::cpu::set_avx512, pybind11::arg("on"),
        "The AVX-512 few-row linear / qlinear kernels at verify sizes, 4 or 5 to 32 rows (True, the default, where the "
        "CPU has AVX-512) or the AVX2 ones (False): the same bits either way. Returns the previous value. For A/Bs and tests.");
  m.def("set_attention_prefetch", &specdec::cpu::set_attention_prefetch, pybind11::arg("blocks"),
        "How many key blocks (64 keys) of K / V the CPU verify_attention requests ahead of the block it computes "
        "(0: none; the default 2). Returns the previous value. The same bits at any distance; for A/Bs.");
  m.def("set_q8act_tier", &specdec::cpu::set_q8act_tier, pybind11::arg("name"),
        "The CPU tier of qlinear_q8act: auto (the default: the best this CPU runs), avx512_vnni, avx_vnni, avx2 "
        "or scalar; the same bits in every tier. Returns the previous setting. For A/Bs and tests.");
  m.def("set_q8act_prefetch", &specdec::cpu::set_q8act_prefetch, pybind11::arg("blocks"),
        "How many packed weight blocks ahead qlinear_q8act's AVX2 tier prefetches (0: none; the default 16). "
        "Returns the previous value. The same bits at any distance; for A/Bs.");
  m.def("set_q8act_group_pairs", &specdec::cpu::set_q8act_group_pairs, pybind11::arg("on"),
        "Whether qlinear_q8act's AVX-512 VNNI tier runs one- and two-row passes over Q4 weights on two groups of 16 "
        "weight rows at once (True) or one group at a time (False). Returns the previous value. The same bits "
        "either way; for A/Bs.");
  m.def("set_q8act_many_rows", &specdec::cpu::set_q8act_many_rows, pybind11::arg("q8_rows"), pybind11::arg("q4_rows"),
        "From how many activation rows qlinear_q8act's AVX-512 VNNI tiles count as many (the block prefetch) rather "
        "than few (the stream prefetch), for Q8_0 and for Q4 weights (defaults 4 and 6; 9: never). Returns the "
        "previous pair. The same bits either way; for A/Bs.");
  m.def("set_stack_buffers", &specdec::set_stack_buffers, pybind11::arg("on"),
        "Whether DecoderStack's float32 CPU layers write their outputs into two pairs of tensors made once per "
        "forward, alternating (True, the default), or allocate them per layer (False). Returns the previous value. "
        "The same bits either way; for A/Bs.");
  m.def("set_fused_row_elems", &specdec::cpu::set_fused_row_elems, pybind11::arg("elems"),
        "Elements per task of the CPU rms_norm / add_rms_norm / rope (rows of H elements: elems / H rows per task; "
        "default 32768: one-row decode steps and small verify passes on the calling thread). Returns the previous "
        "value. The same bits for any value (rows never interact); for A/Bs.");
  m.def("set_q8act_parallel_quantize", &specdec::cpu::set_q8act_parallel_quantize, pybind11::arg("on"),
        "Whether qlinear_q8act on the CPU quantizes five activation rows or more on all its threads, in the parallel "
        "region of the products (True, the default), or on the calling thread before it (False). Returns the "
        "previous value. The same bits either way; for A/Bs.");
  m.def("set_q8act_block_prefetch", &specdec::cpu::set_q8act_block_prefetch, pybind11::arg("blocks"),
        "How many packed blocks ahead qlinear_q8act's AVX-512 VNNI tiles of many activation rows (Q8_0 from 4, Q4 "
        "from 6) prefetch every line of a block (0: the one-line hint two blocks ahead; the default 8 on AMD CPUs, "
        "16 elsewhere). Returns the previous value. The same bits at any distance; for A/Bs.");
  m.def("set_q8act_stream_prefetch", &specdec::cpu::set_q8act_stream_prefetch, pybind11::arg("blocks"),
        "How many packed blocks ahead qlinear_q8act's AVX-512 VNNI tiles of few activation rows (Q8_0 below 4, Q4 "
        "below 6) prefetch every line of a block into L2, into the next weight group past a group's end (0: the "
        "one-line hint two blocks ahead; the default 2 on AMD CPUs, 32 elsewhere). Returns the previous value. The "
        "same bits at any distance; for A/Bs.");
  m.def("set_q8act_amx_rows", &specdec::cpu::set_q8act_amx_rows, pybind11::arg("rows"),
        "From how many activation rows qlinear_q8act's AVX-512 VNNI tier multiplies on AMX tiles where the CPU and "
        "OS have AMX-INT8 (0: never). Returns the previous value. The same bits either way.");
  m.def("q8act_amx", &specdec::cpu::q8act_amx, "Whether this CPU and OS run qlinear_q8act's AMX path.");
  m.def("set_q8act_prefetch_level", &specdec::cpu::set_q8act_prefetch_level, pybind11::arg("level"),
        "The cache level qlinear_q8act's AVX2 / AVX-VNNI tiers prefetch their weight into: 1 (L1, the default) or 2 "
        "(L2). Returns the previous value. The same bits either way; for A/Bs.");
  m.def("q8act_tier", &specdec::cpu::q8act_tier, "The CPU tier qlinear_q8act calls take now.");
  m.def("q8act_tiers", &specdec::cpu::q8act_tiers, "The qlinear_q8act tiers this CPU runs, best first.");
  m.def("cpu_avx512", &specdec::cpu::avx512_active, "Whether verify-size CPU linears take the AVX-512 kernels.");
  specdec::bind_suffix_index(m);
  specdec::bind_recycling(m);
  specdec::bind_sglang_host(m);
  specdec::bind_vllm_host(m);
}

// ---------------------------------------------------------------- paged KV ops
// The dense KV ops over k_pages / v_pages [num_pages, page_size, Hkv, D] through block_tables
// [B, max_blocks] int32 (see csrc/ops.h and specdec/paged_ops.py).
TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("verify_attention_paged(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_tables, Tensor cache_lens, "
        "Tensor? tree_mask, float scale) -> Tensor");
  m.def("append_kv_paged(Tensor(a!) k_pages, Tensor(b!) v_pages, Tensor k_new, Tensor v_new, Tensor block_tables, "
        "Tensor cache_lens, int offset=0) -> ()");
  m.def("kv_commit_paged(Tensor(a!)[] k_pages, Tensor(b!)[] v_pages, Tensor block_tables, Tensor(c!) cache_lens, "
        "Tensor accepted, Tensor num_accepted) -> ()");
  // decoder_layer on a paged cache (k_pages / v_pages through block_tables): the paged engine's layer op
  m.def("decoder_layer_paged(Tensor x, Tensor h, Tensor[] weights, Tensor?[] scales, Tensor?[] mins, "
        "Tensor?[] biases, int[] bits, Tensor post_norm_weight, float post_norm_eps, Tensor next_norm_weight, "
        "float next_norm_eps, Tensor(a!) k_pages, Tensor(b!) v_pages, Tensor cache_lens, Tensor cos, Tensor sin, "
        "Tensor? tree_mask, int kv_offset, float scale, int num_heads, int num_kv_heads, Tensor block_tables) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("verify_attention_paged", &specdec::verify_attention_paged_cpu);
  m.impl("append_kv_paged", &specdec::append_kv_paged_cpu);
  m.impl("kv_commit_paged", &specdec::kv_commit_paged_cpu);
  m.impl("decoder_layer_paged", &specdec::decoder_layer_paged);
}

#ifdef SPECDEC_WITH_CUDA
TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("verify_attention_paged", &specdec::verify_attention_paged_cuda);
  m.impl("append_kv_paged", &specdec::append_kv_paged_cuda);
  m.impl("kv_commit_paged", &specdec::kv_commit_paged_cuda);
  m.impl("decoder_layer_paged", &specdec::decoder_layer_paged);
}
#endif
