"""specdec's verification and sampling behind other stacks' call conventions.

Each module takes the tensors a serving stack already has, in its own shapes, dtypes and padding,
and runs specdec's ops on them: :mod:`specdec.compat.vllm` (vLLM v1's ragged rejection sampler, plus
the tree form it lacks), :mod:`specdec.compat.flashinfer` (FlashInfer's chain speculative sampling)
and :mod:`specdec.compat.sglang` (SGLang's tree verification in first-child / next-sibling form).
Nothing here imports those stacks.
"""
