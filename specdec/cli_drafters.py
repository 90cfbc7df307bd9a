"""The drafter presets of ``specdec generate`` / ``serve`` (``--draft``): which drafter each name builds from
the options, the checks of the drafter options, and loading a local Hugging Face model folder."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List

__all__ = ["DRAFTER_PRESETS", "DraftSource", "check_draft_options", "is_bundled", "load_hf_folder",
           "preset_file_as_option", "BUNDLED_DRAFT_DEFAULTS"]


def is_bundled(name: str) -> bool:
    from specdec.models.bundled import BUNDLED

    return name in BUNDLED


def load_hf_folder(path: str):
    """(model, tokenizer) from a local Hugging Face causal-LM folder, through transformers only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(path)
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a bundled model name ({', '.join(_bundled_names())}) nor a "
                                f"Hugging Face model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
    model.eval()
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError):
        tok = None
    return model, tok


def _bundled_names():
    from specdec.models.bundled import BUNDLED

    return sorted(BUNDLED)


#: (k, candidates per depth, stop threshold) of the bundled model's draft copies; docs/serving.md says where
#: these defaults come from
BUNDLED_DRAFT_DEFAULTS = {"int8": (6, 4, 0.3), "w8": (6, 1, None), "bf16": (8, 1, None)}


@dataclass
class DraftSource:
    """What a drafter preset may build from: the options, the tokenizer, the bundled model's draft copy
    (loaded for int8 / w8 / bf16 / auto) and the document files of ``--draft docs``."""

    args: argparse.Namespace
    name: str
    tok: object
    bundled_draft: object
    doc_files: List[str]


def _bundled_copy(src: DraftSource):
    from specdec.drafters import DraftModel
    from specdec.models.hf import HFCausalLM

    k, tree, stop = BUNDLED_DRAFT_DEFAULTS[src.name]
    stop = stop if src.args.stop is None else (src.args.stop or None)
    return DraftModel(HFCausalLM(src.bundled_draft), k=src.args.k or k, top_k=src.args.tree or tree,
                      stop_threshold=stop)


def _auto(src: DraftSource):
    """Free candidates first; the w8 chain runs only for a request whose lookup is not trusted (MultiDraft
    escalation: fewer than 2 accepted tokens per proposing step recently). With a quantized target (q8_0 /
    q4_1) there is no w8 copy (``auto_uses_w8``): it reads about as many bytes per token as the target, so it
    cannot pay there, and auto is prompt lookup alone."""
    from specdec.drafters import DraftModel, MultiDraft, PromptLookup
    from specdec.models.hf import HFCausalLM

    a = src.args
    if a.head_opt:  # the feature head beside prompt lookup (tokens lookup gets accepted reach the head too)
        return MultiDraft([PromptLookup(ngram=a.ngram, k=10), _head(src)], escalate=2.0)
    if src.bundled_draft is None:
        return PromptLookup(ngram=a.ngram, k=a.k or 10)
    return MultiDraft([PromptLookup(ngram=a.ngram, k=10),
                       DraftModel(HFCausalLM(src.bundled_draft), k=a.k or 6, top_k=a.tree or 1,
                                  stop_threshold=a.stop or None)], escalate=2.0)


def _head(src: DraftSource):
    from specdec.drafters import EagleHead
    from specdec.drafters.eagle import load_head

    a = src.args
    # default: one head forward per step and its two most likely tokens as siblings (a spine tree of 3 nodes):
    # on open prompts at Q4_1 it measured 1.12-1.21x plain against 1.04-1.06x for one token and below plain for
    # a chain of 5 (benchmarks/results/eagle_open_q4_1_q8act_2026-12-07*.json); --k / --tree choose others
    # (--tree W > 2: a dynamic tree of W candidates per depth)
    w = a.tree or 2
    return EagleHead(load_head(a.head_opt), k=a.k or 1, top_k=w, precision="q8_0", act="q8",
                     tree="dynamic" if a.tree is not None and w > 2 else "spine")


def _folder_model(src: DraftSource):
    from specdec.drafters import DraftModel
    from specdec.models.hf import HFCausalLM

    a = src.args
    dmodel, _ = load_hf_folder(a.draft_model)
    return DraftModel(HFCausalLM(dmodel), k=a.k or 4, top_k=a.tree or 1, stop_threshold=a.stop or None)


def _lookup(src: DraftSource):
    from specdec.drafters import PromptLookup

    return PromptLookup(ngram=src.args.ngram, k=src.args.k or 10)


def _suffix(src: DraftSource):
    from specdec.drafters import SuffixDrafter

    return SuffixDrafter(max_spec=src.args.k or 16)


def _recycle(src: DraftSource):
    from specdec.drafters import TokenRecycling

    return TokenRecycling(max_depth=src.args.k or 6)


def _documents(src: DraftSource):
    """Retrieval from the paragraphs (blank-line separated) of the ``--docs`` files."""
    from specdec.drafters import DocumentDrafter

    docs = []
    for f in src.doc_files:
        text = Path(f).read_text()
        docs += [p for p in text.split("\n\n") if p.strip()]
    if not docs:
        raise ValueError(f"--draft docs: {', '.join(src.doc_files)} holds no text")
    return DocumentDrafter(docs, tokenizer=src.tok, max_spec=src.args.k or 16)


#: ``--draft`` name -> the factory of its drafter (None: plain decoding), in the order ``--help`` lists them
DRAFTER_PRESETS: Dict[str, Callable[[DraftSource], object]] = {
    "auto": _auto, "int8": _bundled_copy, "w8": _bundled_copy, "bf16": _bundled_copy, "lookup": _lookup,
    "suffix": _suffix, "recycle": _recycle, "docs": _documents, "head": _head, "model": _folder_model,
    "none": lambda src: None,
}


def auto_uses_w8(args: argparse.Namespace) -> bool:
    """Whether ``--draft auto`` drafts with the bundled model's w8 copy: with an fp32 target (a w8 forward
    costs a fraction of it), not with a q8_0 / q4_1 one (it costs as much: archive/precision_2026-12-06b /
    the eagle_open_q4_1_q8act records), nor beside a feature head."""
    return args.precision == "fp32" and not args.head_opt


def check_draft_options(args: argparse.Namespace, bundled: bool) -> str:
    """The ``--draft`` preset the options ask for (its default depends on the model), or ValueError."""
    draft = args.draft or ("model" if args.draft_model else "auto" if bundled else "lookup")
    if draft == "model" and not args.draft_model:
        raise ValueError("--draft model needs --draft-model PATH (a Hugging Face model folder)")
    if args.draft_model and draft != "model":
        raise ValueError(f"--draft-model is used with --draft model (got --draft {draft})")
    if draft in ("auto", "int8", "w8", "bf16") and not bundled:
        raise ValueError(f"--draft {draft} derives a draft from the bundled model; for a model folder use "
                         f"--draft-model PATH, lookup, suffix, recycle, docs or none")
    doc_files = args.docs_opt or []
    if draft == "docs" and not doc_files:
        raise ValueError("--draft docs needs a document file: --draft docs FILE (or --docs FILE)")
    if doc_files and draft != "docs":
        raise ValueError(f"document files are only used with --draft docs (got --draft {draft})")
    if draft == "head" and not args.head_opt:
        if not bundled:
            raise ValueError("--draft head needs a head folder: --draft head PATH (or --head PATH)")
        from specdec.models.bundled import bundled_head_dir

        args.head_opt = str(bundled_head_dir(args.model) / "head")  # made by `specdec train-head`
        if not os.path.isfile(os.path.join(args.head_opt, "config.json")):
            raise ValueError(f"--draft head: no trained head for {args.model} in {args.head_opt}; make it once with "
                             f"`specdec train-head --model {args.model}` or give a head folder: --draft head PATH")
    if draft == "auto" and bundled and not args.head_opt and args.precision != "fp32":
        # a head made for the bundled model (`specdec train-head`) goes beside prompt lookup, priced by the
        # escalation (docs/trees.md); with an fp32 target the w8 copy drafts there instead (docs/benchmarks.md)
        from specdec.models.bundled import bundled_head_dir

        made = bundled_head_dir(args.model) / "head"
        if (made / "config.json").is_file():
            args.head_opt = str(made)
    if args.head_opt and draft not in ("head", "auto"):
        raise ValueError(f"--head is used with --draft head or --draft auto (got --draft {draft})")
    return draft


def preset_file_as_option(argv: List[str]) -> List[str]:
    """``--draft docs FILE`` -> ``--draft docs --docs FILE``, ``--draft head PATH`` -> ``--draft head --head
    PATH`` (the token after the preset is its file)."""
    out = list(argv)
    for i in range(len(out) - 2):
        if out[i] == "--draft" and out[i + 1] in ("docs", "head") and not out[i + 2].startswith("-"):
            out.insert(i + 2, "--" + out[i + 1])
            break
    return out
