"""Training a feature head by self-distillation (EAGLE's recipe, on CPU or GPU).

Data: token sequences (prompt + the target's own answer) and the target's features at every
position (:mod:`.data`). At position ``p`` the head reads ``(token p, target feature p - 1)`` with
causal attention over the earlier positions of the sequence, and is trained for

* the feature loss (style "eagle"): smooth-L1 between its output and the target's feature at ``p``
  (the state the target's LM head reads), weight ``feature_weight`` (EAGLE: 1.0);
* the token loss: cross-entropy of its logits against the next token ``p + 1`` (the target's own
  greedy choice), over the draft vocabulary when the head has one (tokens outside it are skipped),
  weight ``token_weight`` (EAGLE: 0.1).

Training-time test (``unroll`` > 1, as EAGLE-3): the same sequence is run again as drafting would
see it, step s feeding every node the head's own step s - 1 output instead of the target's feature,
with the attention of a drafted chain (:func:`unrolled_outputs`); the losses of the steps are averaged.
Position 0 reads a zero feature, as when drafting.

Optional uniform noise on the input features (EAGLE's robustness trick, ``noise``). Deterministic
from ``seed``: the batches and the noise come from one generator whose state is checkpointed with
the weights and the optimizer, so a resumed run continues exactly as an uninterrupted one (same
threads, same device).
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F

from specdec.drafters.eagle.net import HeadNet, rope_tables

__all__ = ["TrainConfig", "train_head", "head_losses", "evaluate_head", "unrolled_outputs"]


@dataclass
class TrainConfig:
    steps: int = 1000
    lr: float = 1e-3
    warmup: int = 50
    batch: int = 8                 # sequences per step
    max_len: int = 384             # positions per sequence (longer ones are cut at a seeded offset)
    feature_weight: float = 1.0
    token_weight: float = 0.1
    noise: float = 0.0             # uniform noise of this half-width on the input features
    weight_decay: float = 0.0
    clip: float = 0.5
    seed: int = 0
    checkpoint_every: int = 200
    eval_every: int = 0            # > 0 (with held-out sequences): evaluate every this many steps, and at the end
    unroll: int = 1                # drafting steps trained (> 1: training-time test on the head's own features)
    amp: Optional[str] = None      # "bf16": products in bfloat16 under torch.autocast (weights, losses, optimizer fp32)


def head_losses(net: HeadNet, tokens: torch.Tensor, feats: torch.Tensor, lengths: torch.Tensor,
                target_head: Optional[torch.Tensor], cfg: TrainConfig, embed: torch.Tensor,
                start: torch.Tensor, gen: Optional[torch.Generator] = None,
                label_from: Optional[torch.Tensor] = None, counts: bool = False,
                prev: Optional[torch.Tensor] = None):
    """(total, feature loss, token loss, token accuracy) of one padded batch: tokens [B, T] int64, target
    features [B, T, F] float32, real lengths [B], absolute position of column 0 ``start`` [B], the
    target's feature just before column 0 ``prev`` [B, F] (None: zeros, a window at the sequence's start,
    where drafting reads a zero feature too); ``label_from`` [B]: only next tokens at columns >= it
    count in the token loss and accuracy. ``counts``: also return (hits, scored labels, labels in the
    draft vocabulary) as ints. The node at column c reads (token c, target feature c - 1) and is
    trained to give feature c and token c + 1."""
    B, T = tokens.shape
    hc = net.cfg
    dev = tokens.device
    if prev is None:
        prev = torch.zeros(B, feats.shape[2], dtype=feats.dtype, device=dev)
    inp_feat = torch.cat((prev.to(feats.dtype).unsqueeze(1), feats[:, :-1]), dim=1)     # [B, T, F]
    if cfg.noise > 0:
        noise = torch.rand(inp_feat.shape, generator=gen) * 2 - 1
        inp_feat = inp_feat + cfg.noise * noise.to(dev)
    inp_feat = net.input_feature(inp_feat)
    emb = F.embedding(tokens, embed)                                          # [B, T, H]
    pos = start.view(B, 1) + torch.arange(T, device=dev).view(1, T)
    cos, sin = rope_tables(pos, hc.head_dim, hc.rope_theta, emb.dtype)
    col = torch.arange(T, device=dev).view(1, T)
    labels = tokens[:, 1:].clone()                                            # next token of column c
    has_next = (col[:, :-1] + 1) < lengths.view(B, 1)
    if net.lm_head is not None:                                               # target id -> draft id
        t2d = torch.full((hc.vocab_size,), -100, dtype=torch.int64, device=dev)
        ids = net.draft_to_target()
        t2d[ids] = torch.arange(ids.numel(), device=dev)
        labels = t2d[labels]
    if label_from is not None:
        has_next = has_next & ((col[:, :-1] + 1) >= label_from.view(B, 1))
    head_fn = None if target_head is None else (lambda x: x @ target_head.T)
    total = torch.zeros((), device=dev)
    for step, out in enumerate(unrolled_outputs(net, emb, inp_feat, cos, sin, cfg.unroll)):
        valid = (col < lengths.view(B, 1)) & (col >= step)                    # step s needs its root c - s
        fl = torch.zeros((), device=dev)
        if hc.style == "eagle" and cfg.feature_weight:
            per = F.smooth_l1_loss(out.float(), feats.float(), reduction="none").mean(dim=2)
            fl = (per * valid).sum() / valid.sum().clamp(min=1)
        logits = net.logits(out[:, :-1], head_fn).float()
        lab = torch.where(has_next & (col[:, :-1] >= step), labels, -100)
        tl = torch.nan_to_num(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1),
                                              ignore_index=-100))  # nan: no label in the draft vocabulary
        total = total + (cfg.feature_weight * fl + cfg.token_weight * tl) / max(1, cfg.unroll)
        if step == 0:  # reported: the first drafted token's losses and accuracy (teacher-forced)
            feat_loss, tok_loss = fl, tl
            with torch.no_grad():
                hit = (logits.argmax(-1) == lab) & (lab >= 0)
                acc = hit.sum() / (lab >= 0).sum().clamp(min=1)
                first = (hit, has_next, lab)
    if counts:
        hit, scored, lab = first
        return total, feat_loss.detach(), tok_loss.detach(), acc, (int(hit.sum()), int(scored.sum()),
                                                                  int((lab >= 0).sum()))
    return total, feat_loss.detach(), tok_loss.detach(), acc


def unrolled_outputs(net: HeadNet, emb: torch.Tensor, feat_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     unroll: int = 1):
    """The head's outputs [B, N, H] of ``unroll`` drafting steps over a sequence's nodes (a generator).

    Step 0 reads (token p, target feature p - 1) with causal attention. Step s reads the same tokens with
    the head's own step s - 1 output at p - 1, as the s-th drafted token after the committed node p - s:
    its attention sees the committed keys up to p - s and the drafted nodes p - s + 1 .. p (their keys from
    steps 1 .. s) -- what :class:`~specdec.drafters.eagle.lm.HeadLM` computes when drafting a chain."""
    attn = _UnrolledAttention(net.cfg.num_heads, net.cfg.num_kv_heads)
    for step in range(max(1, unroll)):
        out = net.layer(emb, feat_in, cos, sin, attn.step(step))
        yield out
        feat_in = F.pad(out[:, :-1], (0, 0, 1, 0))                            # the head's feature of p - 1


class _UnrolledAttention:
    """Attention of the unrolled drafting steps over one sequence: step 0 is causal over the committed
    nodes; a query of step s at column c sees step 0's keys up to c - s and step t's key at c - s + t
    (t = 1 .. s), the path of drafted nodes it would see when drafting (EAGLE-3's training-time test)."""

    def __init__(self, num_heads: int, num_kv_heads: int) -> None:
        self.rep = num_heads // num_kv_heads
        self.keys: List[torch.Tensor] = []
        self.values: List[torch.Tensor] = []

    def step(self, s: int):
        def attend(q, k, v):
            self.keys.append(k)
            self.values.append(v)
            N = q.shape[1]
            kk, vv = torch.cat(self.keys[:s + 1], dim=1), torch.cat(self.values[:s + 1], dim=1)
            q, kk, vv = (t.transpose(1, 2) for t in (q, kk, vv))               # [B, heads, ., D]
            if self.rep > 1:
                kk, vv = kk.repeat_interleave(self.rep, dim=1), vv.repeat_interleave(self.rep, dim=1)
            if s == 0:
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=True).transpose(1, 2)
            c = torch.arange(N, device=q.device).view(N, 1)
            j = torch.arange(N, device=q.device).view(1, N)
            parts = [j <= c - s] + [j == c - s + t for t in range(1, s + 1)]
            mask = torch.cat(parts, dim=1)                                    # [N, (s + 1) N]
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask).transpose(1, 2)
        return attend


def _batch(tokens: List[torch.Tensor], feats: List[torch.Tensor], cfg: TrainConfig, gen: torch.Generator):
    """A padded batch of cfg.batch sequences drawn with ``gen`` (windows of cfg.max_len at a drawn offset):
    tokens, features, lengths, offsets and the feature before each window (zeros at a sequence's start)."""
    idx = torch.randint(len(tokens), (cfg.batch,), generator=gen).tolist()
    rows = []
    for i in idx:
        n = tokens[i].numel()
        off = int(torch.randint(max(1, n - cfg.max_len + 1), (1,), generator=gen)) if n > cfg.max_len else 0
        rows.append((tokens[i][off:off + cfg.max_len], feats[i][off:off + cfg.max_len], off))
    T = max(r[0].numel() for r in rows)
    Fd = rows[0][1].shape[1]
    tok = torch.zeros(len(rows), T, dtype=torch.int64)
    ft = torch.zeros(len(rows), T, Fd, dtype=torch.float32)
    prev = torch.zeros(len(rows), Fd, dtype=torch.float32)
    for j, ((t, f, off), i) in enumerate(zip(rows, idx)):
        tok[j, :t.numel()] = t
        ft[j, :t.numel()] = f.float()
        if off:
            prev[j] = feats[i][off - 1].float()
    return tok, ft, torch.tensor([r[0].numel() for r in rows]), torch.tensor([r[2] for r in rows]), prev


@torch.no_grad()
def evaluate_head(net: HeadNet, tokens: Sequence[torch.Tensor], feats: Sequence[torch.Tensor], embed: torch.Tensor,
                  target_head: Optional[torch.Tensor], cfg: TrainConfig,
                  answer_from: Optional[Sequence[int]] = None) -> dict:
    """Teacher-forced next-token accuracy (the first drafted token) and losses of ``net`` on held-out
    sequences (each cut to its first cfg.max_len positions, in batches of cfg.batch, no randomness).
    ``answer_from[i]``: score only the tokens of sequence i from this index on (its answer: what drafting
    predicts)."""
    was = net.training
    net.eval()
    one = replace(cfg, unroll=1, noise=0.0)  # what is scored: the first drafted token, teacher-forced
    hits = scored = in_vocab = 0
    tl = fl = 0.0
    for i in range(0, len(tokens), cfg.batch):
        rows = [(t[:cfg.max_len], f[:cfg.max_len]) for t, f in zip(tokens[i:i + cfg.batch], feats[i:i + cfg.batch])]
        T = max(t.numel() for t, _ in rows)
        tok = torch.zeros(len(rows), T, dtype=torch.int64)
        ft = torch.zeros(len(rows), T, rows[0][1].shape[1], dtype=torch.float32)
        for j, (t, f) in enumerate(rows):
            tok[j, :t.numel()], ft[j, :t.numel()] = t, f.float()
        lengths = torch.tensor([t.numel() for t, _ in rows])
        frm = None if answer_from is None else torch.tensor([int(a) for a in answer_from[i:i + cfg.batch]])
        with _autocast(cfg, tok.device):
            _, f_l, t_l, _, (h, n, v) = head_losses(net, tok, ft, lengths, target_head, one, embed,
                                                    torch.zeros(len(rows), dtype=torch.int64), None, frm, counts=True)
        hits, scored, in_vocab = hits + h, scored + n, in_vocab + v
        tl += float(t_l) * v
        fl += float(f_l) * n
    net.train(was)
    # accuracy over every scored next token: one outside the draft vocabulary is a miss, as when drafting
    return dict(val_accuracy=hits / max(scored, 1), val_token_loss=tl / max(in_vocab, 1),
                val_feature_loss=fl / max(scored, 1), val_positions=scored)


def _autocast(cfg: TrainConfig, device: torch.device):
    """torch.autocast for cfg.amp ("bf16"), or a context that changes nothing."""
    if cfg.amp is None:
        return contextlib.nullcontext()
    if cfg.amp != "bf16":
        raise ValueError(f"train_head: amp must be None or 'bf16', got {cfg.amp!r}")
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train_head(net: HeadNet, tokens: Sequence[Sequence[int]], feats: Sequence[torch.Tensor], embed: torch.Tensor,
               target_head: Optional[torch.Tensor] = None, cfg: Optional[TrainConfig] = None,
               checkpoint: Optional[str] = None, resume: bool = True, progress: bool = False,
               on_step: Optional[Callable[[int, dict], None]] = None, val: Optional[tuple] = None) -> List[dict]:
    """Train ``net`` in place; returns the log (one dict per step: loss, feature / token loss, accuracy,
    learning rate, seconds). ``embed``: the target's token embedding [V, H] (frozen); ``target_head``
    [V, H]: the target's LM head weight for a head without its own (frozen). ``checkpoint``: a file
    written every cfg.checkpoint_every steps and at the end (weights, optimizer, generator, log);
    with ``resume`` an existing one is continued. ``val``: held-out ``(sequences, features, answer_from)``
    scored by :func:`evaluate_head` every cfg.eval_every steps and at the end (keys ``val_*`` in the log)."""
    cfg = cfg or TrainConfig()
    if len(tokens) != len(feats) or not tokens:
        raise ValueError(f"train_head: need as many feature tensors as sequences (>= 1), got {len(tokens)} and "
                         f"{len(feats)}")
    toks = [torch.as_tensor(t, dtype=torch.int64) for t in tokens]
    for i, (t, f) in enumerate(zip(toks, feats)):
        if f.dim() != 2 or f.shape[0] != t.numel() or f.shape[1] != net.cfg.feature_size:
            raise ValueError(f"train_head: sequence {i} has {t.numel()} tokens but features {tuple(f.shape)} "
                             f"(expected [{t.numel()}, {net.cfg.feature_size}])")
    net.train()
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    log: List[dict] = []
    step = 0
    if checkpoint and resume and os.path.isfile(checkpoint):
        state = torch.load(checkpoint, weights_only=False)
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        log, step = state["log"], state["step"]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc="train-head", unit="step")
    embed = embed.detach().float()
    head_w = None if target_head is None else target_head.detach().float()
    while step < cfg.steps:
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = _lr(cfg, step)
        tok, ft, lengths, start, prev = _batch(toks, list(feats), cfg, gen)
        with _autocast(cfg, tok.device):
            loss, fl, tl, acc = head_losses(net, tok, ft, lengths, head_w, cfg, embed, start, gen, prev=prev)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        step += 1
        rec = dict(step=step, loss=float(loss.detach()), feature_loss=float(fl), token_loss=float(tl),
                   accuracy=float(acc), lr=opt.param_groups[0]["lr"], seconds=time.perf_counter() - t0)
        if val is not None and cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            v_tok = [torch.as_tensor(t, dtype=torch.int64) for t in val[0]]
            rec.update(evaluate_head(net, v_tok, val[1], embed, head_w, cfg, val[2] if len(val) > 2 else None))
        log.append(rec)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['accuracy']:.2f}",
                            **({"val": f"{rec['val_accuracy']:.3f}"} if "val_accuracy" in rec else {}))
        if on_step is not None:
            on_step(step, rec)
        if checkpoint and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
            tmp = checkpoint + ".tmp"
            torch.save(dict(net=net.state_dict(), opt=opt.state_dict(), gen=gen.get_state(), log=log, step=step,
                            config=net.cfg.to_dict(), train=asdict(cfg)), tmp)
            os.replace(tmp, checkpoint)
    if bar is not None:
        bar.close()
    net.eval()
    return log
