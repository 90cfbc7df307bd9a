"""Model adapters: transformers causal LMs on specdec's static KV cache, and the bundled pretrained model."""
from specdec.models.bundled import load_bundled
from specdec.models.hf import HFCausalLM
from specdec.models.hugepages import weights_to_hugepages

__all__ = ["HFCausalLM", "load_bundled", "weights_to_hugepages"]
