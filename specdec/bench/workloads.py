"""What ``specdec bench`` runs: the prompt sets, the method specs (``drafter[:k][@policy]``), the
useless :class:`RandomDrafter`, and the workloads (a prompt set at a batch size, split into units)."""
from __future__ import annotations

import random
from typing import Dict, List, Optional, Tuple

import torch

from specdec._check import check_int
from specdec.drafters.base import Draft, Drafter, StepContext
from specdec.tree import TokenTree

__all__ = ["PASSAGE", "CODE", "EMAIL", "CSV", "PROMPT_SETS", "chat_ids", "DRAFTERS", "DEFAULT_K", "ADAPTIVE",
           "RandomDrafter", "parse_method", "method_name", "parse_runs", "build_workloads", "is_adaptive"]

PASSAGE = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual reefs "
    "and 900 islands stretching for over 2,300 kilometres over an area of approximately 344,400 square "
    "kilometres. The reef is located in the Coral Sea, off the coast of Queensland, Australia. It can be seen "
    "from outer space and is the world's biggest single structure made by living organisms. This reef structure "
    "is composed of and built by billions of tiny organisms, known as coral polyps.")

CODE = '''def compute_total(prices, tax_rate):
    total = 0
    for price in prices:
        total = total + price
    total = total * (1 + tax_rate)
    return round(total, 2)


def apply_discount(total, discount):
    if discount > 0.5:
        raise ValueError("discount too large")
    return total * (1 - discount)
'''

EMAIL = ("Hi Sarah,\n\nThank you for your message. I will be out of the office on Monday, so I suggest we meet on "
         "Monday afternoon instead of Monday morning. Please bring the quarterly report and the budget "
         "spreadsheet. Let me know if that works for you.\n\nBest regards,\nTom")

CSV = ("name,age,city\nAlice,34,London\nBob,29,Paris\nCharlie,41,Berlin\nDiana,25,Madrid\nEthan,38,Rome")

#: prompt sets (chat template applied): "grounded" answers copy from the input, "open" ones do not, "code" asks
#: for code the prompt does not contain (code completion without a source to copy from)
PROMPT_SETS: Dict[str, List[str]] = {
    "grounded": [
        f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
        f"Rename the function compute_total to sum_prices in this code and output the full code:\n\n{CODE}",
        f"Here is an email:\n\n{EMAIL}\n\nRewrite the email exactly, but replace every 'Monday' with 'Friday'.",
        f"Convert this CSV data to a markdown table:\n\n{CSV}",
        f"Add a docstring to each function and output the full code:\n\n{CODE}",
        f"Quote the first two sentences of this passage:\n\n{PASSAGE}",
    ],
    "open": [
        "Write a short story about a robot who learns to paint.",
        "Explain how vaccines work in simple terms.",
        "Give me five tips for a successful job interview.",
        "What are the health benefits of regular exercise?",
        "Describe the city of Paris to someone who has never been there.",
        "Write a poem about the sea at night.",
    ],
    "code": [
        "Write a Python function that returns the n-th Fibonacci number using a loop.",
        "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
        "Write a Python class Stack with push, pop, peek and is_empty methods.",
        "Write a Python function that reads a text file and counts how often each word occurs.",
        "Write a JavaScript function that removes duplicate values from an array.",
        "Write a SQL query that lists the ten customers with the highest total order amount, from the tables "
        "customers and orders.",
    ],
}



def chat_ids(tok, text: str) -> List[int]:
    """``text`` as one user turn through the tokenizer's chat template, ready for the assistant: token ids
    (the prompt form every benchmark sends)."""
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # a BatchEncoding / dict where the tokenizer returns one
        ids = ids["input_ids"]
    return list(ids)


DRAFTERS = ("lookup", "w8", "int8", "bf16", "random")
DEFAULT_K = {"lookup": 10, "w8": 8, "int8": 8, "bf16": 8, "random": 8}
#: policies that decide from what they measure: their ratios to plain sit near 1, so they get the repetitions
ADAPTIVE = ("goodput", "heuristic")


class RandomDrafter(Drafter):
    """A useless drafter: a chain of k uniformly random tokens per row (seeded), at no drafting cost."""

    def __init__(self, k: int = 8, seed: int = 0) -> None:
        self.k = check_int("RandomDrafter", "k", k, lo=1, type_error=False)
        self.max_nodes = k + 1
        self.seed = seed
        self.device = torch.device("cpu")
        self.vocab_size = 1

    def __repr__(self) -> str:
        return f"RandomDrafter(k={self.k})"

    def bind(self, target, max_batch: int, max_len: int) -> None:
        self.device = torch.device(target.device)
        self.vocab_size = int(target.vocab_size)

    def start(self, prompts, params, generator) -> None:
        self.rng = random.Random(self.seed)

    def propose(self, ctx: StepContext) -> Draft:
        rows = [[seq[-1]] + [self.rng.randrange(self.vocab_size) for _ in range(max(0, min(self.k, b)))]
                for seq, b in zip(ctx.sequences, ctx.budgets)]
        N = max(len(r) for r in rows)
        if N == 1:
            return Draft(TokenTree.root_only(ctx.roots))
        tokens = torch.tensor([r + [-1] * (N - len(r)) for r in rows], dtype=torch.int64, device=self.device)
        return Draft(TokenTree.chain(tokens, [len(r) for r in rows]))


def parse_method(spec: str) -> Tuple[str, Optional[int], str]:
    """``drafter[:k][@policy]`` -> (drafter, k or None, policy). ``plain`` and ``hf`` take neither."""
    spec = spec.strip()
    if spec in ("plain", "hf"):
        return spec, None, "none"
    body, _, policy = spec.partition("@")
    name, _, k = body.partition(":")
    policy = policy or "goodput"
    if name not in DRAFTERS:
        raise ValueError(f"specdec bench: method {spec!r}: drafter must be one of plain, hf, {', '.join(DRAFTERS)}; "
                         f"got {name!r}")
    if policy not in ("fixed", "heuristic", "goodput"):
        raise ValueError(f"specdec bench: method {spec!r}: policy must be fixed, heuristic or goodput, got {policy!r}")
    if k:
        try:
            k_val = int(k)
        except ValueError:
            raise ValueError(f"specdec bench: method {spec!r}: k must be an int, got {k!r}") from None
        if k_val < 1:
            raise ValueError(f"specdec bench: method {spec!r}: k must be >= 1, got {k_val}")
        return name, k_val, policy
    return name, None, policy


def method_name(drafter: str, k: Optional[int], policy: str) -> str:
    if drafter in ("plain", "hf"):
        return drafter
    return f"{drafter}:{k if k is not None else DEFAULT_K[drafter]}@{policy}"


def parse_runs(text: str) -> Dict[str, List[str]]:
    """``"set:m1,m2;set2:m3"`` -> {set: [methods]} (methods of a set after its name)."""
    out: Dict[str, List[str]] = {}
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        name, sep, methods = part.partition(":")
        if not sep or name not in PROMPT_SETS:
            raise ValueError(f"specdec bench: --runs entry {part!r} must be 'SET:METHOD,...' with SET one of "
                             f"{sorted(PROMPT_SETS)}")
        out.setdefault(name, []).extend(m.strip() for m in methods.split(",") if m.strip())
    return out


#: a method as parsed: (drafter or "plain" / "hf", k or None, policy)
Spec = Tuple[str, Optional[int], str]


def is_adaptive(spec: Spec) -> bool:
    """Plain decoding and the policies that decide from what they measure (they get the repetitions)."""
    return spec[0] == "plain" or spec[2] in ADAPTIVE


def build_workloads(specs: Dict[str, List[Spec]], prompts: Dict[str, List[List[int]]], batches) -> list:
    """(set, batch, units, methods) per prompt set and batch size. A unit is one prompt at batch 1, else one
    batch of ``b`` prompts cycling through the set; every workload runs plain first, ``hf`` only at batch 1."""
    workloads = []
    for s, ms in specs.items():
        methods = [("plain", None, "none")] + [m for m in ms if m[0] != "plain"]
        for b in batches:
            ps = prompts[s]
            if b == 1:
                units = [[p] for p in ps]
            else:
                units = [[ps[i % len(ps)] for i in range(b)]]
            ms_b = [m for m in methods if not (m[0] == "hf" and b != 1)]
            workloads.append((s, b, units, ms_b))
    return workloads
