"""Run every CUDA op once on small cases: the workload for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize_ops.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python benchmarks/sanitize_ops.py --ops verify_attention

Cases cover every head dim / dtype instantiation of the attention kernel, masks
present and absent, prefix 0 / 1 / a few hundred (several key tiles and the split-KV
combine path), N = 1 / 13 / 64, sampling with and without draft rows, greedy in the three
logit dtypes, kv_commit with real moves. Then, with strict checks OFF (their default on
CUDA), inputs whose VALUES are invalid (lengths past capacity, out-of-range parents,
tokens, paths, uniforms): the contract says the kernels stay memory-safe for any value,
and memcheck is what can tell. Inputs are built on the CPU and copied, so the sanitized
launches are the specdec kernels (plus copies). Results are compared with the reference
on the valid cases as a smoke check (the real comparisons live in tests/).

Uses PYTORCH_NO_CUDA_MEMORY_CACHING=1 when run by gpu_check.sh so that an out-of-bounds
access is not hidden inside a larger cached block.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import specdec
from specdec import ops, reference

DEV = "cuda"
QUICK = False
FAILURES = []


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def check(name: str, ok: bool) -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if not ok:
        FAILURES.append(name)


def tree(B, N, g, ragged=True):
    parents = torch.full((B, N), -1, dtype=torch.int32)
    for b in range(B):
        n = int(torch.randint(1, N + 1, (1,), generator=g)) if ragged else N
        for i in range(1, n):
            parents[b, i] = int(torch.randint(max(0, i - 3), i, (1,), generator=g))
    return parents


def attention_case(g, D, dtype, lens, Nq, Nkv, mask, label):
    """append_kv of the step's last Nq new nodes at offset Nkv - Nq, then verify_attention of their
    queries (mask [B, Nq, Nkv] or None: causal), against the reference; the caches must match too."""
    B, Hq, Hkv = len(lens), 4, 2
    S = max(lens) + Nkv + 3
    q = torch.randn(B, Nq, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    kn = torch.randn(B, Hkv, Nq, D, generator=g).to(dtype)
    vn = torch.randn(B, Hkv, Nq, D, generator=g).to(dtype)
    cl = torch.tensor(lens, dtype=torch.int32)
    kd, vd = k.to(DEV, copy=True), v.to(DEV, copy=True)
    ops.append_kv(kd, vd, kn.to(DEV), vn.to(DEV), cl.to(DEV), offset=Nkv - Nq)
    out = ops.verify_attention(q.to(DEV), kd, vd, cl.to(DEV), None if mask is None else mask.to(DEV))
    sync()
    reference.append_kv(k, v, kn, vn, cl, Nkv - Nq)
    want = reference.verify_attention(q, k, v, cl, mask, D ** -0.5)
    err = (out.cpu().float() - want.float()).abs().max().item()
    same_cache = torch.equal(kd.cpu(), k) and torch.equal(vd.cpu(), v)
    check(f"D={D} {dtype} {label}: max |err| {err:.2e}",
          same_cache and err < (1e-4 if dtype == torch.float32 else 5e-2))


def run_attention(g):
    print("verify_attention / append_kv")
    for D in (64, 80, 96, 128, 256):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            configs = ((13, [0, 1, 300], True), (1, [5, 0, 700], False), (64, [0, 129, 40], True))
            for N, lens, masked in configs[:1] if QUICK else configs:
                mask = reference.tree_attention_mask(tree(len(lens), N, g)) if masked else None
                attention_case(g, D, dtype, lens, N, N, mask, f"N={N} mask={masked}")
            # frontier form (dynamic draft trees): the step's first Nkv - Nq nodes are already in the cache,
            # append_kv writes the last Nq at offset Nkv - Nq, queries see mask [B, Nq, Nkv] (70: two mask words)
            for Nq, Nkv in ((3, 13),) if QUICK else ((3, 13), (1, 5), (4, 70)):
                lens = [0, 17, 300]
                mask = reference.tree_attention_mask(tree(len(lens), Nkv, g, ragged=False))[:, Nkv - Nq:].contiguous()
                attention_case(g, D, dtype, lens, Nq, Nkv, mask,
                               f"frontier Nq={Nq} Nkv={Nkv} (append_kv offset {Nkv - Nq})")


def run_sampling(g):
    print("rejection_sample / greedy_verify")
    for B, N, V in ((3, 13, 111), (2, 64, 4097), (1, 1, 7)):
        parents = tree(B, N, g)
        tokens = torch.randint(0, V, (B, N), generator=g)
        tokens[parents < 0] = -1
        tokens[:, 0] = 0
        p = torch.softmax(torch.randn(B, N, V, generator=g) * 3, -1)
        q = torch.softmax(torch.randn(B, N, V, generator=g) * 3, -1)
        u = torch.rand(B, N, generator=g, dtype=torch.float64)
        for qq in (q, None):
            got = ops.rejection_sample(tokens.to(DEV), parents.to(DEV), p.to(DEV), None if qq is None else qq.to(DEV),
                                       u.to(DEV))
            want = reference.rejection_sample(tokens, parents, p, qq, u)
            check(f"rejection_sample B={B} N={N} V={V} q={'yes' if qq is not None else 'None'}",
                  all(torch.equal(a.cpu(), b) for a, b in zip(got, want)))
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            logits = torch.randn(B, N, V, generator=g).to(dtype)
            got = ops.greedy_verify(tokens.to(DEV), parents.to(DEV), logits.to(DEV))
            want = reference.greedy_verify(tokens, parents, logits)
            check(f"greedy_verify B={B} N={N} V={V} {dtype}", all(torch.equal(a.cpu(), b) for a, b in zip(got, want)))


def run_commit(g):
    print("kv_commit")
    B, N, S = 4, 9, 40
    accepted = torch.tensor([[0, 2, 3, 4, 5, 6, 7, 8, -1], [0, -1, -1, -1, -1, -1, -1, -1, -1],
                             [0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 3, 8, -1, -1, -1, -1, -1, -1]], dtype=torch.int32)
    num = torch.tensor([7, 0, 8, 2], dtype=torch.int32)
    for L in (1, 3, 70):
        for dtype in (torch.float32, torch.bfloat16):
            ks = [torch.randn(B, 2, S, 80, generator=g).to(dtype) for _ in range(L)]
            vs = [torch.randn(B, 2, S, 64, generator=g).to(dtype) for _ in range(L)]
            lens = torch.tensor([0, 5, S - N, 17], dtype=torch.int32)
            kd, vd, ld = [t.to(DEV, copy=True) for t in ks], [t.to(DEV, copy=True) for t in vs], lens.to(DEV, copy=True)
            ops.kv_commit(kd, vd, ld, accepted.to(DEV), num.to(DEV))
            reference.kv_commit(ks, vs, lens, accepted, num)
            ok = torch.equal(ld.cpu(), lens) and all(torch.equal(a.cpu(), b) for a, b in zip(kd + vd, ks + vs))
            check(f"kv_commit L={L} {dtype}", ok)


def run_paged(g):
    """The paged ops on shuffled, non-contiguous pages (page sizes 1 and 16), as NHD pools and as the
    strided halves of one combined HND pool [pages, 2, Hkv, ps, D] (no copy): append_kv_paged of a
    step's nodes, verify_attention_paged with a tree mask, kv_commit_paged with real moves."""
    from specdec import paged_ops, reference_paged

    print("paged ops")
    B, Hq, Hkv, D, N = 3, 4, 2, 64, 9
    lens = torch.tensor([0, 17, 40], dtype=torch.int32)
    accepted = torch.tensor([[0, 2, 3, -1, -1, -1, -1, -1, -1], [0, -1, -1, -1, -1, -1, -1, -1, -1],
                             [0, 1, 4, 8, -1, -1, -1, -1, -1]], dtype=torch.int32)
    num = torch.tensor([2, 0, 3], dtype=torch.int32)
    mask = reference.tree_attention_mask(tree(B, N, g, ragged=False))
    for ps, dtype, layout in [(ps, dt, lay) for ps in (1, 16) for dt in (torch.float32, torch.bfloat16)
                              for lay in ("nhd", "combined_hnd")]:
        per_row = -(-(int(lens.max()) + N) // ps)
        pages = B * per_row + 2
        table = torch.randperm(pages, generator=g)[:B * per_row].view(B, per_row).to(torch.int32)
        kp = torch.randn(pages, ps, Hkv, D, generator=g).to(dtype)
        vp = torch.randn(pages, ps, Hkv, D, generator=g).to(dtype)
        kn = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
        vn = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
        q = torch.randn(B, N, Hq, D, generator=g).to(dtype)
        kd, vd, td, ld = kp.to(DEV, copy=True), vp.to(DEV, copy=True), table.to(DEV), lens.to(DEV, copy=True)
        if layout == "combined_hnd":  # one buffer, K and V interleaved per page, heads before slots
            pool = torch.stack([kd, vd], 1).transpose(2, 3).contiguous()
            kd, vd = pool[:, 0].transpose(1, 2), pool[:, 1].transpose(1, 2)
        paged_ops.append_kv_paged(kd, vd, kn.to(DEV), vn.to(DEV), td, ld)
        reference_paged.append_kv_paged(kp, vp, kn, vn, table, lens)
        out = paged_ops.verify_attention_paged(q.to(DEV), kd, vd, td, ld, mask.to(DEV), D ** -0.5)
        ref = reference_paged.verify_attention_paged(q, kp, vp, table, lens, mask, D ** -0.5)
        tol = 2e-2 if dtype != torch.float32 else 1e-4
        check(f"append_kv_paged + verify_attention_paged ps={ps} {dtype} {layout}",
              torch.equal(kd.cpu(), kp) and bool(torch.allclose(out.cpu().float(), ref.float(), atol=tol,
                                                                rtol=tol)))
        paged_ops.kv_commit_paged([kd], [vd], td, ld, accepted.to(DEV), num.to(DEV))
        lr = lens.clone()
        reference_paged.kv_commit_paged([kp], [vp], table, lr, accepted, num)
        check(f"kv_commit_paged ps={ps} {dtype} {layout}",
              torch.equal(ld.cpu(), lr) and torch.equal(kd.cpu(), kp) and torch.equal(vd.cpu(), vp))


def run_linear(g):
    print("linear")
    for wd in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
        for M in (1, 3, 16, 17):
            for K, N in ((77, 13), (576, 130), (64, 8)):
                xdt = torch.bfloat16 if wd == torch.int8 else wd
                x = torch.randn(M, K, generator=g).to(xdt)
                w = torch.randn(N, K, generator=g)
                if wd == torch.int8:
                    w, sc = ops.quantize_weight_int8(w)
                else:
                    w, sc = w.to(wd), None
                bias = torch.randn(N, generator=g).to(xdt)
                y = ops.linear(x.to(DEV), w.to(DEV), bias.to(DEV), None if sc is None else sc.to(DEV))
                ref = reference.linear(x, w, bias, sc)
                tol = 5e-2 if xdt != torch.float32 else 1e-3
                check(f"linear {wd} M={M} K={K} N={N}",
                      bool(torch.allclose(y.cpu().float(), ref.float(), atol=tol, rtol=tol)))


def run_qlinear(g):
    print("qlinear")
    for fmt, bits in (("q8_0", 8), ("q4_0", 4), ("q4_1", 4)):
        for M in (1, 3, 16, 17):
            for K, N in ((32, 13), (576, 130)):
                qw, d, m = ops.quantize_weight_groups(torch.randn(N, K, generator=g), fmt)
                x = torch.randn(M, K, generator=g).to(torch.bfloat16)
                bias = torch.randn(N, generator=g).to(torch.bfloat16)
                y = ops.qlinear(x.to(DEV), qw.to(DEV), d.to(DEV), None if m is None else m.to(DEV), bias.to(DEV), bits)
                ref = reference.qlinear(x, qw, d, m, bias, bits)
                check(f"qlinear {fmt} M={M} K={K} N={N}",
                      bool(torch.allclose(y.cpu().float(), ref.float(), atol=5e-2, rtol=5e-2)))


def run_qlinear_q8act(g):
    print("qlinear_q8act")
    from specdec import reference_q8act

    for fmt, bits in (("q8_0", 8), ("q4_0", 4), ("q4_1", 4)):
        for M in (1, 17):
            for K, N in ((32, 13), (544, 70)):  # G = 1 and 17 blocks (an odd tail of the four-block step)
                qw, d, m = ops.quantize_weight_groups(torch.randn(N, K, generator=g), fmt)
                x = torch.randn(M, K, generator=g)
                bias = torch.randn(N, generator=g)
                y = ops.qlinear(x.to(DEV), qw.to(DEV), d.to(DEV), None if m is None else m.to(DEV), bias.to(DEV), bits,
                                act="q8")
                check(f"qlinear_q8act {fmt} M={M} K={K} N={N}",
                      bool(torch.equal(y.cpu(), reference_q8act.qlinear_q8act(x, qw, d, m, bias, bits))))


def run_fused(g):
    print("rms_norm / add_rms_norm / rope / silu_mul")
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for shape in ((1, 576), (3, 7, 33), (70, 1000)):
            x = torch.randn(*shape, generator=g).to(dt)
            r = torch.randn(*shape, generator=g).to(dt)
            w = torch.rand(shape[-1], generator=g).to(dt)
            out, s = ops.add_rms_norm(x.to(DEV), r.to(DEV), w.to(DEV), 1e-5)
            ref_out, ref_s = reference.add_rms_norm(x, r, w, 1e-5)
            tol = 1e-4 if dt == torch.float32 else 3e-2
            check(f"add_rms_norm {dt} {shape}", torch.equal(s.cpu(), ref_s) and
                  bool(torch.allclose(out.cpu().float(), ref_out.float(), atol=tol, rtol=tol)))
            y = ops.rms_norm(x.to(DEV), w.to(DEV), 1e-5)
            check(f"rms_norm {dt} {shape}", bool(torch.allclose(y.cpu().float(), reference.rms_norm(x, w, 1e-5).float(),
                                                                 atol=tol, rtol=tol)))
            y = ops.silu_mul(x.to(DEV), r.to(DEV))
            check(f"silu_mul {dt} {shape}", bool(torch.allclose(y.cpu().float(), reference.silu_mul(x, r).float(),
                                                                 atol=tol, rtol=tol)))
        for B, N, Hq, Hkv, D in ((1, 1, 9, 3, 64), (2, 5, 4, 2, 8), (3, 40, 2, 1, 6)):
            q = torch.randn(B, N, Hq, D, generator=g).to(dt)
            k = torch.randn(B, N, Hkv, D, generator=g).to(dt)
            c, s_ = torch.randn(B, N, D, generator=g).to(dt), torch.randn(B, N, D, generator=g).to(dt)
            gq, gk = ops.rope(q.to(DEV), k.to(DEV), c.to(DEV), s_.to(DEV))
            wq, wk = reference.rope(q, k, c, s_)
            check(f"rope {dt} B={B} N={N} D={D} (bit-identical)",
                  torch.equal(gq.cpu(), wq) and torch.equal(gk.cpu(), wk))


def run_decoder_layer(g):
    """decoder_layer on the device vs the separate ops on the device (bit-identical) in each layout."""
    print("decoder_layer")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_ops_decoder_layer import LAYOUTS, _case

    for layout in LAYOUTS:
        for dt in (torch.float32, torch.bfloat16):
            for B, N, frontier in ((1, 1, False), (2, 5, False), (2, 3, True)):
                args = _case(DEV, dt, layout, B=B, N=N, frontier=frontier, bias=B > 1, seed=B * 7 + N)
                a = dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone())
                b = dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone())
                got = ops.decoder_layer(**a)
                want = reference.decoder_layer_with(ops, **b)
                same = all(torch.equal(x, y) for x, y in zip(got, want)) and torch.equal(a["k_cache"], b["k_cache"])
                check(f"decoder_layer {layout} {dt} B={B} N={N}{' frontier' if frontier else ''} (bit-identical)", same)


def run_bad_values(g):
    """Strict checks off: invalid VALUES must not make any kernel touch memory out of bounds
    (outputs are unspecified; compute-sanitizer judges)."""
    print("invalid values, strict checks off (memory safety only)")
    ops.set_strict_checks(False)
    B, N, Hq, Hkv, D, S, V = 2, 5, 4, 2, 64, 16, 11
    q = torch.randn(B, N, Hq, D, device=DEV)
    k = torch.randn(B, Hkv, S, D, device=DEV)
    v = torch.randn(B, Hkv, S, D, device=DEV)
    for lens in ([-7, 3], [S, 0], [S - 1, 2], [2 ** 30, -2 ** 30]):
        cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
        ops.verify_attention(q, k, v, cl, None)
        ops.append_kv(k, v, torch.randn(B, Hkv, N, D, device=DEV), torch.randn(B, Hkv, N, D, device=DEV), cl)
        torch.cuda.synchronize()
        check(f"attention / append_kv with cache_lens {lens}", True)
    tokens = torch.tensor([[0, 3, 99, -5, 2], [1, 2, 3, 4, 5]], device=DEV)
    bad_parents = [[[-1, 0, 7, -9, 3], [4, 0, 0, 1, 1]], [[-1, 0, 0, 0, 0], [-1, 2 ** 30, -2 ** 30, 1, 4]]]
    for par in bad_parents:
        parents = torch.tensor(par, dtype=torch.int32, device=DEV)
        p = torch.rand(B, N, V, device=DEV)
        qd = torch.rand(B, N, V, device=DEV)
        u = torch.tensor([[2.0, -1.0, float("nan"), 1e300, 0.5], [0.1] * 5], dtype=torch.float64, device=DEV)
        ops.rejection_sample(tokens, parents, p, qd, u)
        ops.rejection_sample(tokens, parents, p, None, u)
        ops.greedy_verify(tokens, parents, p)
        torch.cuda.synchronize()
        check(f"sampling with parents {par}", True)
    for acc, num, lens in (([[0, 9, 2, -1, -1], [3, 1, 0, 0, 0]], [4, 2], [0, 0]),
                           ([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]], [9, -3], [15, 14]),
                           ([[0, 1, 2, 3, 4], [0, 2 ** 30, -2 ** 30, 3, 4]], [4, 4], [-5, 2 ** 30])):
        ks = [torch.randn(B, Hkv, S, D, device=DEV) for _ in range(2)]
        vs = [torch.randn(B, Hkv, S, D, device=DEV) for _ in range(2)]
        ops.kv_commit(ks, vs, torch.tensor(lens, dtype=torch.int32, device=DEV),
                      torch.tensor(acc, dtype=torch.int32, device=DEV),
                      torch.tensor(num, dtype=torch.int32, device=DEV))
        torch.cuda.synchronize()
        check(f"kv_commit with accepted {acc} num {num} lens {lens}", True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="*", default=["verify_attention", "sampling", "kv_commit", "linear", "qlinear",
                                                 "qlinear_q8act", "fused", "decoder_layer", "paged", "bad_values"],
                    help="subset of: verify_attention sampling kv_commit linear qlinear qlinear_q8act fused "
                         "decoder_layer paged bad_values")
    ap.add_argument("--quick", action="store_true", help="attention: one case per head dim x dtype (for racecheck)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself (bad_values skipped)")
    args = ap.parse_args(argv)
    global DEV, QUICK
    DEV, QUICK = args.device, args.quick
    if DEV == "cuda" and not (torch.cuda.is_available() and specdec.build_info().get("cuda")):
        print("needs a GPU and a CUDA build of specdec", file=sys.stderr)
        return 2
    if DEV != "cuda" and "bad_values" in args.ops:
        args.ops.remove("bad_values")  # CPU always value-checks: those inputs raise there
    g = torch.Generator().manual_seed(0)
    steps = {"verify_attention": run_attention, "sampling": run_sampling, "kv_commit": run_commit, "linear": run_linear,
             "qlinear": run_qlinear, "qlinear_q8act": run_qlinear_q8act,
             "fused": run_fused, "decoder_layer": run_decoder_layer, "paged": run_paged,
             "bad_values": run_bad_values}
    for name in args.ops:
        steps[name](g)
    sync()
    print(f"{len(FAILURES)} failing checks" + (": " + "; ".join(FAILURES) if FAILURES else ""))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
