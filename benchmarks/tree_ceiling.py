"""How much can ANY token tree gain over a chain for a given draft / target pair, under sampling or greedy?

The issue asks a sampled dynamic tree of 16 nodes to reach 1.2x the mean accepted length of a
16-node chain. This script measures what bounds that ratio and computes the best tree that the
measured acceptances allow:

1. the target samples text (temperature 1) from open prompts;
2. along that text, from the two models' distributions p (target) and q (draft, computed one token
   per forward as the loop does), exactly (no sampling of the draft: sums over the vocabulary): P(a drawn child
   is accepted) = sum min(p, q),
   and for siblings drawn without replacement after r rejections, P(the next one is accepted | the
   earlier ones were rejected) (Monte Carlo over the rejected tokens, the residual norm(max(0, p - q))
   and q renormalised without them, as the sampler verifies them);
3. the loop's own chain (DraftModel(k=15), policy fixed) gives P(position d accepted | d - 1 accepted);
4. scheduler.plan_tree finds the tree of n nodes with the largest E[accepted length] under those
   acceptances (independence across positions assumed, as Sequoia does), for n = 8 / 16 / 32,
   against the chain of n nodes under the same model; once with the sibling rates as measured,
   once scaled by (the loop's first-position acceptance / the offline first-child acceptance).
   A tree that adapts its shape to each step's draft probabilities can beat this static optimum,
   by as much as the draft's confidence predicts acceptance.

Greedy (``--mode greedy``): the same with the target's greedy text, and a sibling of rank r (the
draft's r-th most probable token, as the greedy rule's deterministic children) accepted exactly when
it is the target's argmax: P(rank r | ranks 0 .. r - 1 were not) from the rank of the target's
token in the draft's distribution at every position.

Writes benchmarks/results/tree_ceiling_<date>.json.
Run: python benchmarks/tree_ceiling.py [--draft int8] [--mode greedy]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_e2e import OPEN, cpu_name, encode, git_commit  # noqa: E402
from specdec.decoding import SpeculativeDecoder  # noqa: E402
from specdec.drafters import DraftModel  # noqa: E402
from specdec.models.bundled import load_bundled  # noqa: E402
from specdec.models.hf import HFCausalLM  # noqa: E402
from specdec.scheduler import plan_tree  # noqa: E402


def sibling_acceptance(p: torch.Tensor, q: torch.Tensor, ranks: int, draws: int, gen: torch.Generator):
    """[ranks] P(the r-th drawn child is accepted | children 0..r-1 were rejected), one position."""
    out, weight = torch.zeros(ranks, dtype=torch.float64), torch.zeros(ranks, dtype=torch.float64)
    first = torch.clamp(p / q.clamp_min(1e-30), max=1.0)
    out[0], weight[0] = float((q * first).sum()), 1.0
    for _ in range(draws):
        pr, qr, alive = p.clone(), q.clone(), 1.0
        for r in range(ranks - 1):
            x = int(torch.multinomial(qr, 1, generator=gen))
            acc_x = min(1.0, float(pr[x] / qr[x].clamp_min(1e-30)))
            alive *= 1.0 - acc_x           # weight of "x rejected" (importance weight, no second draw)
            if alive <= 1e-12:
                break
            res = torch.clamp(pr - qr, min=0.0)
            if float(res.sum()) <= 0:
                break
            pr = res / res.sum()
            qr = qr.clone()
            qr[x] = 0.0
            if float(qr.sum()) <= 0:
                break
            qr = qr / qr.sum()
            a = float((qr * torch.clamp(pr / qr.clamp_min(1e-30), max=1.0)).sum())
            out[r + 1] += alive * a
            weight[r + 1] += alive
    return out, weight


def incremental_q(draft: HFCausalLM, prompt, out) -> torch.Tensor:
    """The draft's next-token distributions along prompt + out [len(out), V], computed as the loop computes
    them: the prompt in one forward, then one token per forward over the cache. (A dynamically quantized
    draft, the bundled int8 one, scales its activations per call: one forward over the whole text, whose
    first positions carry outsized activations, gives a coarser q than the loop's and understates the
    acceptance -- 0.37 against 0.58 for the first drafted token here.)"""
    n = len(prompt)
    cache = draft.new_cache(1, n + len(out) + 2)
    ids = torch.tensor([list(prompt)])
    rows = [draft.forward(cache, ids, torch.arange(n, dtype=torch.int32).view(1, n))[0, -1]]
    cache.lens += n
    for t in out[:-1]:
        rows.append(draft.forward(cache, torch.tensor([[int(t)]]), torch.zeros(1, 1, dtype=torch.int32))[0, -1])
        cache.lens += 1
    return torch.softmax(torch.stack(rows).float(), -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="int8", choices=["int8", "w8", "bf16"])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--draws", type=int, default=4, help="Monte Carlo draws per position for the siblings")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="sampling", choices=["sampling", "greedy"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    greedy = args.mode == "greedy"
    if greedy:
        args.seeds = 1
    torch.set_num_threads(args.threads)
    t0, load0 = time.perf_counter(), os.getloadavg()
    model, tok, draft_model = load_bundled("smollm2-135m", draft=args.draft)
    target, draft = HFCausalLM(model), HFCausalLM(draft_model)
    prompts = [encode(tok, t) for t in OPEN[:args.prompts]]
    b = len(prompts)
    max_len = max(len(p) for p in prompts) + args.max_new_tokens + 8
    # (3) the loop's chain: per-position acceptance
    chain = SpeculativeDecoder(target, DraftModel(draft, k=15), max_batch=b, max_len=max_len, policy="fixed")
    pos_acc, pos_n = [0.0] * 15, [0.0] * 15
    texts = []
    for s in range(args.seeds):
        g = chain.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=0.0 if greedy else 1.0,
                           seed=4321 + s, eos_token_id=tok.eos_token_id)
        texts += list(zip(prompts, g.tokens))  # target-distributed text (exact sampling), or its greedy text
        steps = sum(g.metrics["per_request"]["target_passes"])
        for i, a in enumerate(g.metrics["accepted_per_position"]):
            pos_acc[i] += a * steps
            pos_n[i] += steps
    uncond = [a / n if n else 0.0 for a, n in zip(pos_acc, pos_n)]
    cond = [uncond[0]] + [uncond[i] / uncond[i - 1] if uncond[i - 1] > 0 else 0.0 for i in range(1, 15)]
    # (2) siblings, from the distributions along the sampled text
    gen = torch.Generator().manual_seed(7)
    tot = torch.zeros(args.ranks, dtype=torch.float64)
    wts = torch.zeros(args.ranks, dtype=torch.float64)
    positions = 0
    with torch.no_grad():
        for p_ids, o_ids in texts:
            ids = torch.tensor([list(p_ids) + list(o_ids)])
            P = torch.softmax(model(ids).logits[0].float(), -1)[len(p_ids) - 1:-1]
            Q = incremental_q(draft, p_ids, o_ids)
            for t in range(P.shape[0]):
                if greedy:   # rank of the target's token among the draft's: rank r accepted iff r == that rank
                    rank = int((Q[t] > Q[t, int(o_ids[t])]).sum())
                    a = torch.zeros(args.ranks, dtype=torch.float64)
                    w = torch.zeros(args.ranks, dtype=torch.float64)
                    w[:min(rank + 1, args.ranks)] = 1.0
                    if rank < args.ranks:
                        a[rank] = 1.0
                    tot += a
                    wts += w
                    positions += 1
                    continue
                a, w = sibling_acceptance(P[t].double(), Q[t].double(), args.ranks, args.draws, gen)
                tot += a
                wts += w
                positions += 1
    sib = (tot / wts.clamp_min(1e-12)).tolist()   # sib[0]: first child; sib[r]: r-th sibling given rejections
    # conditional acceptance by depth (from the loop; depths past the measured ones keep the last measured)
    measured = [c for c, n in zip(cond, uncond) if n > 0.005]
    depth_acc = measured + [measured[-1]] * (64 - len(measured))

    # the offline first-child acceptance (one row per forward) runs above the loop's first position (batched
    # draft forwards share the int8 draft's activation scale; steps start after rejections more often):
    # the ceiling is computed with the siblings as measured and scaled by the loop / offline ratio
    scale = min(1.0, measured[0] / sib[0]) if sib[0] > 0 else 1.0
    variants = {"siblings_as_measured": sib, "siblings_scaled_to_the_loop": [x * scale for x in sib]}
    rows = []
    for variant, sv in variants.items():
        def acc(d: int, r: int, sv=sv) -> float:
            a = depth_acc[d - 1]
            if r == 0:
                return a
            if r >= len(sv):
                return 0.0
            reach = 1.0 - a                       # first child rejected
            for i in range(1, r):
                reach *= 1.0 - sv[i]              # and every sibling before r
            return reach * sv[r]

        for n in (8, 16, 32):
            E_chain = 1.0 + sum(math.prod(depth_acc[:d]) for d in range(1, n))
            _, slots, E_tree = plan_tree(acc, n, max_depth=n - 1)
            rows.append(dict(variant=variant, nodes=n, chain_mean_accepted_length=round(E_chain, 4),
                             best_tree_mean_accepted_length=round(E_tree, 4), ratio=round(E_tree / E_chain, 4),
                             best_tree_depth=max(d for d, _ in slots)))
            print(f"{variant}: {n:3d} nodes: chain {E_chain:.3f}, best tree {E_tree:.3f} "
                  f"({E_tree / E_chain:.3f}x), depth {rows[-1]['best_tree_depth']}")
    print("P(accept) first child / later siblings given rejections:", [round(x, 3) for x in sib])
    print("chain: P(position d accepted | d - 1 accepted):", [round(x, 3) for x in measured])
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"tree_ceiling_{_dt.date.today()}.json"
    out.write_text(json.dumps(dict(
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), commit=git_commit(), cpu=cpu_name(),
        threads=args.threads, load_average_start=load0, load_average_end=os.getloadavg(),
        seconds=round(time.perf_counter() - t0, 1), settings=vars(args), positions=positions,
        sibling_acceptance=sib, sibling_scale=scale, chain_conditional_acceptance=measured,
        chain_accepted_per_position=uncond,
        ceiling=rows), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
