"""specdec: speculative decoding for causal LMs.

Compiled ops (``specdec.ops``, registered as ``torch.ops.specdec.*``) under a thin
decoding loop. The high-level API is imported lazily so that ``import specdec``
stays cheap and does not pull in transformers.
"""
from __future__ import annotations

import importlib

import torch  # noqa: F401  (loads libtorch before the extension)

from specdec import _C, ops, paged_ops  # noqa: F401  (_C registers torch.ops.specdec)
from specdec.ops import build_info

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "StaticKVCache": "specdec.cache",
    "PagedKVCache": "specdec.paged_cache",
    "BlockAllocator": "specdec.paged_cache",
    "TokenTree": "specdec.tree",
    "HFCausalLM": "specdec.models.hf",
    "load_bundled": "specdec.models.bundled",
    "SpeculativeDecoder": "specdec.decoding",
    "GenerateOutput": "specdec.decoding",
    "Engine": "specdec.engine",
    "RequestParams": "specdec.engine",
    "RequestOutput": "specdec.engine",
    "QueueFull": "specdec.engine",
    "DraftModel": "specdec.drafters.draft_model",
    "PromptLookup": "specdec.drafters.prompt_lookup",
    "SuffixDrafter": "specdec.drafters.suffix",
    "DocumentDrafter": "specdec.drafters.suffix",
    "TokenRecycling": "specdec.drafters.recycling",
    "MultiDraft": "specdec.drafters.multi",
    "CallableDrafter": "specdec.drafters.callable",
    "GraphedForward": "specdec.graphs",
}

# subpackages / modules served as attributes (``specdec.models.load_bundled(...)``), imported on first use
_SUBMODULES = ("models", "drafters", "reference", "tree", "cache", "decoding", "engine", "sampling", "metrics",
               "graphs", "paged_cache", "reference_paged")

__all__ = ["ops", "paged_ops", "build_info", "__version__", *_LAZY, *_SUBMODULES]


def __getattr__(name: str):
    if name in _SUBMODULES:
        value = importlib.import_module(f"specdec.{name}")
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
