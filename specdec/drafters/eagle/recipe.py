"""``specdec train-head``: train a feature head for a model by self-distillation, start to end.

1. prompts: standard-library docstrings turned into instructions (:func:`~.data.stdlib_prompts`), the
   model's chat template applied; 2. the model's greedy answers (plain decoding, batches); 3. its
   features at every position (one prefill each); 4. the draft vocabulary: the most frequent tokens
   of the answers; 5. :func:`~.train.train_head`; 6. the head folder (:func:`~.checkpoint.save_head`),
   the training log (JSON) and its curve (PNG). Steps 2-3 are saved to ``OUT/data.pt`` and step 5
   checkpoints to ``OUT/train.ckpt``: running the same command again resumes.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import List, Optional

import torch

from specdec.drafters.eagle.corpus import CORPORA

__all__ = ["add_arguments", "run"]

CORPUS_TEXT = {"stdlib": "standard-library docstring prompts", "general": "everyday requests (templates x subjects)",
               "mixed": "everyday requests and standard-library docstring prompts, alternating",
               "wide": "everyday requests, requests about the tokenizer's vocabulary words and standard-library "
                       "docstring prompts, in turn"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output folder (head, data, checkpoint, log); default: the bundled model's head folder in "
                        "specdec's cache, where load_bundled(..., draft='head') and --draft head find it")
    p.add_argument("--model", default="smollm2-135m", help="a bundled model name (default smollm2-135m)")
    p.add_argument("--precision", default="q4_1", choices=["fp32", "q8_0", "q4_1"],
                   help="the target's weights while generating the data (default q4_1, the checkpoint's own)")
    p.add_argument("--act", default="auto", choices=["auto", "none", "q8"],
                   help="the target's activations while generating the data: auto (the default) is q8 with a "
                        "quantized precision, as specdec generate runs the target, so the head learns the features "
                        "it will be fed")
    p.add_argument("--corpus", default="mixed", choices=list(CORPORA),
                   help="prompt corpus: everyday requests (general), standard-library docstrings (stdlib), both "
                        "alternating (mixed, the default), or those two and requests about the tokenizer's vocabulary "
                        "words in turn (wide); none of them holds a benchmark prompt")
    # the defaults are the recorded recipe (docs/benchmarks.md, eagle_train_2026-12-06c.json): ~35 min on 2 cores
    p.add_argument("--prompts", type=int, default=2000, help="prompts to answer (default 2000)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="answer length cap (default 128)")
    p.add_argument("--doc-chars", type=int, default=600, help="longest docstring paragraph in a prompt (default 600)")
    p.add_argument("--batch", type=int, default=16, help="requests per generation batch (default 16)")
    p.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
    p.add_argument("--train-batch", type=int, default=8, help="sequences per training step (default 8)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="reduced draft vocabulary (most frequent answer tokens; 0 = the target's LM head)")
    p.add_argument("--unroll", type=int, default=2,
                   help="drafting steps trained (> 1: training-time test on the head's own features; default 2)")
    p.add_argument("--noise", type=float, default=0.0, help="uniform feature noise half-width (default 0)")
    p.add_argument("--token-weight", type=float, default=0.1,
                   help="weight of the next-token cross-entropy (default 0.1, EAGLE's)")
    p.add_argument("--feature-weight", type=float, default=1.0,
                   help="weight of the smooth-L1 feature loss (default 1.0, EAGLE's; 0 trains on tokens only)")
    p.add_argument("--amp", default="none", choices=["none", "bf16"],
                   help="bf16: the training's products in bfloat16 under torch.autocast, weights, losses and optimizer "
                        "in float32 (default none)")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="sequences held out to score the head's next-token accuracy on answers (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt choice, the init and the batches")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _load(args, act):
    from specdec.models import HFCausalLM
    from specdec.models.bundled import load_bundled

    model, tok = load_bundled(args.model, precision=args.precision, act=act)
    return model, tok, HFCausalLM(model)


def _data(args, act, model, tok, target, path: str):
    """The generated answers with the target's states (``act``: the target's activations, None or "q8")."""
    from tqdm import tqdm

    from specdec.drafters.eagle.corpus import corpus_prompts
    from specdec.drafters.eagle.data import generate_with_features

    if os.path.isfile(path):  # a resumed run: the data must come from the target this run asks for
        data = torch.load(path, weights_only=False)
        have = (data.get("precision"), data.get("act"))
        if have != (args.precision, act):
            raise SystemExit(f"specdec train-head: {path} was generated with precision {have[0]} and activations "
                             f"{have[1] or 'float'}; this run asks for {args.precision} and {act or 'float'} "
                             f"(pass the matching --precision / --act, or remove the file)")
        return data
    t0 = time.perf_counter()
    texts = corpus_prompts(args.corpus, args.prompts, seed=args.seed, max_chars=args.doc_chars, tokenizer=tok)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for t in texts]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    eos = tok.eos_token_id
    with tqdm(total=len(prompts), desc="generate", unit="prompt") as bar:
        seqs, feats = generate_with_features(target, prompts, args.max_new_tokens, batch=args.batch,
                                             eos_token_id=eos, progress=bar.update)
    data = dict(sequences=seqs, features=feats, prompt_lengths=[len(p) for p in prompts],
                seconds=time.perf_counter() - t0, precision=args.precision, model=args.model, act=act)
    torch.save(data, path)
    return data


def _make_net(args, model, seqs: List[List[int]], tok):
    from specdec.drafters.eagle.data import frequent_tokens
    from specdec.drafters.eagle.net import HeadConfig, HeadNet

    cfg = model.config
    V = int(model.get_input_embeddings().weight.shape[0])
    hc = HeadConfig(hidden_size=int(cfg.hidden_size), num_heads=int(cfg.num_attention_heads),
                    num_kv_heads=int(cfg.num_key_value_heads), intermediate_size=int(cfg.intermediate_size),
                    vocab_size=V, draft_vocab=int(args.draft_vocab), rms_eps=float(cfg.rms_norm_eps),
                    rope_theta=float(getattr(cfg, "rope_theta", None) or 10000.0))
    torch.manual_seed(args.seed)
    net = HeadNet(hc)
    with torch.no_grad():  # fc starts as "take the feature": the head begins as the target's last state
        net.fc.weight.zero_()
        net.fc.weight[:, hc.hidden_size:] = torch.eye(hc.hidden_size)
        net.fc.bias.zero_()
    head = _target_head_weight(model)
    if args.draft_vocab:
        special = [t for t in (tok.eos_token_id, tok.bos_token_id) if t is not None]
        ids = frequent_tokens(seqs, args.draft_vocab, V, always=special)
        net.set_vocab(ids)
        with torch.no_grad():
            net.lm_head.weight.copy_(head[ids])
    return net, head


def _target_head_weight(model) -> torch.Tensor:
    """The target's LM head as a float matrix [V, H] (tied models: the embedding)."""
    out = model.get_output_embeddings()
    w = getattr(out, "weight", None)
    if isinstance(w, torch.Tensor) and w.dtype.is_floating_point:
        return w.detach().float()
    return model.get_input_embeddings().weight.detach().float()  # quantized head: a tied model's embedding


def _plot(log: List[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps = [r["step"] for r in log]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot(steps, [r["feature_loss"] for r in log], label="feature (smooth L1)")
    ax[0].plot(steps, [r["token_loss"] for r in log], label="token (CE)")
    ax[0].set_xlabel("step")
    ax[0].legend()
    ax[1].plot(steps, [r["accuracy"] for r in log], label="train batch")
    val = [(r["step"], r["val_accuracy"]) for r in log if "val_accuracy" in r]
    if val:
        ax[1].plot([v[0] for v in val], [v[1] for v in val], marker="o", label="held-out answers")
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("next-token accuracy")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run(args: argparse.Namespace, argv: Optional[List[str]] = None) -> int:
    from specdec.drafters.eagle.checkpoint import save_head
    from specdec.drafters.eagle.train import TrainConfig, train_head

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.out is None:
        from specdec.models.bundled import bundled_head_dir

        args.out = str(bundled_head_dir(args.model))
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    from specdec.cli import resolve_act

    act = resolve_act(args.act, args.precision)
    model, tok, target = _load(args, act)
    data = _data(args, act, model, tok, target, os.path.join(args.out, "data.pt"))
    seqs, feats, plen = data["sequences"], data["features"], data["prompt_lengths"]
    if not 0 <= args.val_fraction < 1:
        raise SystemExit(f"specdec train-head: --val-fraction must lie in [0, 1), got {args.val_fraction}")
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(args.seed)).tolist()
    n_val = int(round(len(seqs) * args.val_fraction))
    val_idx, train_idx = sorted(order[:n_val]), sorted(order[n_val:])
    train_seqs = [seqs[i] for i in train_idx]
    net, head = _make_net(args, model, train_seqs, tok)
    if args.token_weight < 0 or args.feature_weight < 0 or not (args.token_weight or args.feature_weight):
        raise SystemExit(f"specdec train-head: --token-weight and --feature-weight must be >= 0 and not both 0, got "
                         f"{args.token_weight} and {args.feature_weight}")
    if args.unroll < 1:
        raise SystemExit(f"specdec train-head: --unroll must be >= 1, got {args.unroll}")
    cfg = TrainConfig(steps=args.steps, lr=args.lr, batch=args.train_batch, seed=args.seed, noise=args.noise,
                      unroll=args.unroll, token_weight=args.token_weight, feature_weight=args.feature_weight,
                      amp=None if args.amp == "none" else args.amp,
                      warmup=max(1, args.steps // 20), checkpoint_every=max(1, args.steps // 10),
                      eval_every=max(1, args.steps // 20) if n_val else 0)
    val = ([seqs[i] for i in val_idx], [feats[i] for i in val_idx], [plen[i] for i in val_idx]) if n_val else None
    t1 = time.perf_counter()
    log = train_head(net, train_seqs, [feats[i] for i in train_idx], model.get_input_embeddings().weight,
                     None if args.draft_vocab else head, cfg, checkpoint=os.path.join(args.out, "train.ckpt"),
                     progress=True, val=val)
    train_s = time.perf_counter() - t1
    meta = dict(model=args.model, precision=args.precision, act=act, seed=args.seed, command=argv,
                data=f"{len(seqs)} greedy answers of the model to {CORPUS_TEXT[args.corpus]} ({n_val} held out)",
                positions=sum(len(s) for s in train_seqs), held_out_sequences=n_val)
    save_head(net, os.path.join(args.out, "head"), meta=meta)
    _plot(log, os.path.join(args.out, "train_curve.png"))
    summary = dict(meta, data_seconds=data.get("seconds"), train_seconds=train_s,
                   total_seconds=time.perf_counter() - t0, train=vars(args), log=log)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    held = f", held-out answer accuracy {log[-1]['val_accuracy']:.3f}" if "val_accuracy" in log[-1] else ""
    print(f"head written to {os.path.join(args.out, 'head')} ({len(train_seqs)} sequences, {args.steps} steps, "
          f"final loss {log[-1]['loss']:.4f}, accuracy {log[-1]['accuracy']:.3f}{held})")
    return 0
