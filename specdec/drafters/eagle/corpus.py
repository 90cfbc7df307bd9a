"""Offline prompt corpora for training feature heads (no download, nothing from the benchmarks).

* :func:`general_prompts`: everyday assistant requests (stories, explanations, tips, descriptions,
  poems, comparisons, letters, how-to questions) built from instruction templates and a fixed list
  of subjects. The subjects deliberately leave out every topic of the benchmark prompt sets
  (``specdec.bench.workloads.PROMPT_SETS``: robots that paint, vaccines, job interviews, exercise,
  Paris, the sea at night), and :func:`general_prompts` drops any prompt that equals a benchmark
  prompt, so a head trained on it is measured on prompts it has not seen.
* the standard library's docstrings (:func:`specdec.drafters.eagle.data.stdlib_prompts`).
* :func:`vocabulary_prompts`: open requests about words of the target tokenizer's own vocabulary
  (thousands of subjects instead of a fixed list; words of the benchmark prompts left out).

:func:`mixed_prompts` interleaves the first two (``corpus="mixed"`` of ``specdec train-head``);
:func:`wide_prompts` all three (``corpus="wide"``).
"""
from __future__ import annotations

import random
from typing import List

__all__ = ["general_prompts", "mixed_prompts", "vocabulary_prompts", "wide_prompts", "vocabulary_words", "CORPORA",
           "corpus_prompts"]

CORPORA = ("mixed", "general", "stdlib", "wide")

ANIMALS = ("an old dog", "a curious cat", "an owl", "a fox", "a whale", "a honeybee", "a horse", "a penguin",
           "an elephant", "a dolphin", "a parrot", "a turtle", "a wolf", "an octopus", "a squirrel", "a crow")
PLACES = ("Tokyo", "Rome", "New York", "Cairo", "Sydney", "Rio de Janeiro", "Istanbul", "a small mountain village",
          "Iceland", "the Sahara desert", "the Amazon rainforest", "Kyoto", "Barcelona", "Cape Town", "Vienna",
          "a busy train station", "a quiet library", "an island in the Pacific", "London", "Mexico City")
THINGS = ("a lighthouse", "an old clock", "a bicycle", "a violin", "a lost key", "a red umbrella", "a garden",
          "a snowstorm", "a thunderstorm", "the first day of spring", "autumn leaves", "a full moon",
          "a mountain lake", "a desert at noon", "a city at dawn", "a winter morning", "a birthday party",
          "a long train journey", "a farmers market", "a kite", "a river", "a forest in the rain")
CHARACTERS = ("a young baker", "a retired teacher", "a shy astronaut", "a dragon who is afraid of fire",
              "a girl who can talk to trees", "a boy who builds a boat", "a detective who hates mysteries",
              "a chef who loses his sense of taste", "two friends on a road trip", "a lonely lighthouse keeper",
              "a musician in a small town", "a scientist who finds a strange stone", "a grandmother and her cat",
              "a knight who wants to be a gardener", "a child on the first day of school")
TOPICS = ("photosynthesis", "gravity", "the water cycle", "electricity", "the internet", "black holes",
          "climate change", "the immune system", "inflation", "the stock market", "volcanoes", "earthquakes",
          "rainbows", "the human heart", "sleep", "memory", "compound interest", "recycling", "solar panels",
          "airplanes", "the moon's phases", "tides", "DNA", "antibiotics", "how bread rises", "magnets",
          "the seasons", "democracy", "supply and demand", "machine learning", "encryption", "batteries",
          "coffee", "the printing press", "the Roman Empire", "the Renaissance", "plate tectonics",
          "nutrition labels", "credit scores", "wind turbines", "3D printing", "the ozone layer")
ACTIVITIES = ("learning a new language", "saving money", "cooking at home", "studying for exams",
              "starting a small business", "traveling on a budget", "keeping a houseplant alive",
              "public speaking", "writing a novel", "getting better sleep", "learning to play the guitar",
              "running a first marathon", "working from home", "making new friends in a new city",
              "taking better photos", "reducing stress", "organizing a closet", "planning a wedding",
              "learning to swim", "growing tomatoes", "training a puppy", "reading more books",
              "managing time", "moving to a new apartment", "hosting a dinner party")
PAIRS = (("cats", "dogs"), ("tea", "coffee"), ("trains", "planes"), ("summer", "winter"),
         ("books", "movies"), ("cities", "the countryside"), ("renting", "buying a home"),
         ("electric cars", "gasoline cars"), ("email", "phone calls"), ("running", "swimming"),
         ("the sun", "the moon"), ("paper books", "e-readers"))

TEMPLATES = (
    ("Write a short story about {c}.", CHARACTERS + ANIMALS),
    ("Write a funny story for children about {c}.", CHARACTERS + ANIMALS),
    ("Write a short dialogue between {c} and a stranger.", CHARACTERS),
    ("Explain {c} in simple terms.", TOPICS),
    ("How does {c} work? Explain it to a ten-year-old.", TOPICS),
    ("What is important to know about {c}?", TOPICS + ACTIVITIES),
    ("Write a short essay about {c}.", TOPICS),
    ("What are some common misconceptions about {c}?", TOPICS),
    ("Give me five tips for {c}.", ACTIVITIES),
    ("What are the benefits of {c}?", ACTIVITIES),
    ("What are the most common mistakes people make when {c}?", ACTIVITIES),
    ("Make a simple step-by-step plan for {c}.", ACTIVITIES),
    ("Describe {c} to someone who has never been there.", PLACES),
    ("What should a visitor know before going to {c}?", PLACES),
    ("Plan a three-day trip to {c}.", PLACES),
    ("Write a poem about {c}.", THINGS + ANIMALS + PLACES),
    ("Describe {c} in a few sentences.", THINGS + ANIMALS),
    ("Write a letter to a friend about {c}.", THINGS + PLACES),
    ("Tell me some interesting facts about {c}.", ANIMALS + PLACES),
)
PAIR_TEMPLATES = ("Compare {a} and {b}.", "What are the pros and cons of {a} versus {b}?")


def _benchmark_prompts() -> set:
    from specdec.bench.workloads import PROMPT_SETS

    return {p for prompts in PROMPT_SETS.values() for p in prompts}


def _general_pool(seed: int) -> List[str]:
    pool = [t.format(c=c) for t, subjects in TEMPLATES for c in subjects]
    pool += [t.format(a=a, b=b) for t in PAIR_TEMPLATES for a, b in PAIRS]
    banned = _benchmark_prompts()
    pool = sorted(set(p for p in pool if p not in banned))
    random.Random(seed).shuffle(pool)
    return pool


def general_prompts(n: int, seed: int = 0) -> List[str]:
    """``n`` everyday instruction prompts (seeded order; the distinct prompts repeat when ``n`` exceeds them)."""
    pool = _general_pool(seed)
    return [pool[i % len(pool)] for i in range(n)]


def mixed_prompts(n: int, seed: int = 0, max_chars: int = 900) -> List[str]:
    """Up to ``n`` distinct prompts alternating general requests and standard-library documentation tasks
    (past the general pool the documentation tasks fill the rest; a task drawn twice is kept once)."""
    from specdec.drafters.eagle.data import stdlib_prompts

    gen = _general_pool(seed)[:(n + 1) // 2]
    return _in_turn(gen, stdlib_prompts(n - len(gen), seed=seed, max_chars=max_chars))


def _in_turn(*parts: List[str]) -> List[str]:
    """One prompt of each part in turn while any lasts; a prompt drawn twice is answered once."""
    out: List[str] = []
    for i in range(max(len(p) for p in parts)):
        for p in parts:
            out += p[i:i + 1]
    return list(dict.fromkeys(out))


WORD_TEMPLATES = ("Write a short story that involves {w}.", "Explain what '{w}' means, with an example.",
                  "Write a short paragraph about {w}.", "Write a poem about {w}.",
                  "Tell me something interesting about {w}.", "What comes to mind when you think of {w}?",
                  "Describe {w} to a child.", "Write a short dialogue in which someone mentions {w}.")


def vocabulary_words(tokenizer) -> List[str]:
    """Lower-case words of 5-12 letters that are single tokens (with a leading space) of ``tokenizer``'s
    vocabulary, less every word of the benchmark prompts; sorted."""
    import re

    banned = {w for p in _benchmark_prompts() for w in re.findall(r"[a-z]+", p.lower())}
    words = set()
    for t in tokenizer.get_vocab():
        w = t[1:] if t[:1] in ("\u0120", "\u2581") else None  # byte-level BPE / sentencepiece word starts
        if w and re.fullmatch(r"[a-z]{5,12}", w) and w not in banned:
            words.add(w)
    return sorted(words)


def vocabulary_prompts(n: int, words: List[str], seed: int = 0) -> List[str]:
    """``n`` distinct requests about ``words`` (a template per word, seeded); fewer when the words run out."""
    rng = random.Random(seed)
    chosen = rng.sample(words, min(n, len(words)))
    return [rng.choice(WORD_TEMPLATES).format(w=w) for w in chosen]


def wide_prompts(n: int, words: List[str], seed: int = 0, max_chars: int = 900) -> List[str]:
    """Up to ``n`` distinct prompts, in turn: a general request, a vocabulary request, a documentation task."""
    from specdec.drafters.eagle.data import stdlib_prompts

    gen = _general_pool(seed)[:n // 3]
    doc = stdlib_prompts(n // 3, seed=seed, max_chars=max_chars)
    return _in_turn(gen, vocabulary_prompts(n - len(gen) - len(doc), words, seed), doc)


def corpus_prompts(corpus: str, n: int, seed: int = 0, max_chars: int = 900, tokenizer=None) -> List[str]:
    """The prompts of a named corpus (one of :data:`CORPORA`; "wide" needs the target's ``tokenizer``)."""
    from specdec.drafters.eagle.data import stdlib_prompts

    if corpus == "wide":
        if tokenizer is None:
            raise ValueError("specdec train-head: corpus 'wide' needs the target's tokenizer (its vocabulary words)")
        return wide_prompts(n, vocabulary_words(tokenizer), seed, max_chars)
    if corpus == "general":
        return general_prompts(n, seed)
    if corpus == "stdlib":
        return stdlib_prompts(n, seed=seed, max_chars=max_chars)
    if corpus == "mixed":
        return mixed_prompts(n, seed, max_chars)
    raise ValueError(f"specdec train-head: corpus must be one of {', '.join(CORPORA)}, got {corpus!r}")
