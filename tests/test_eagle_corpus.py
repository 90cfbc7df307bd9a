"""The offline prompt corpora of ``specdec train-head``: seeded, distinct, and free of benchmark prompts."""
import pytest

from specdec.bench.workloads import PROMPT_SETS
from specdec.drafters.eagle.corpus import (CORPORA, corpus_prompts, general_prompts, mixed_prompts, vocabulary_words,
                                           wide_prompts)

BENCH = [p for ps in PROMPT_SETS.values() for p in ps]
BENCH_TOPICS = ("paint", "vaccine", "job interview", "exercise", "Paris", "sea at night")


def test_general_prompts_hold_no_benchmark_prompt_or_topic():
    pool = general_prompts(5000)
    distinct = set(pool)
    assert len(distinct) > 500
    assert not distinct & set(BENCH)
    for topic in BENCH_TOPICS:
        assert not [p for p in distinct if topic.lower() in p.lower()], topic


def test_general_prompts_are_seeded_and_repeat_only_past_the_pool():
    a, b = general_prompts(300, seed=1), general_prompts(300, seed=1)
    assert a == b and len(set(a)) == 300
    assert general_prompts(300, seed=2) != a


def test_mixed_prompts_alternate_and_are_distinct():
    m = mixed_prompts(40, seed=0)
    assert len(m) == len(set(m)) == 40
    general = set(general_prompts(2000, seed=0))
    kinds = [p in general for p in m]
    assert kinds[:6] == [True, False] * 3
    big = mixed_prompts(1500, seed=0)
    assert len(big) == len(set(big)) and len(big) > 1300
    assert not set(big) & set(BENCH)


class _Tok:
    """A tokenizer's vocabulary as get_vocab() gives it: byte-level word starts, pieces, punctuation."""

    def __init__(self, words):
        self.vocab = {("\u0120" + w if i % 3 else "\u2581" + w): i for i, w in enumerate(words)}
        self.vocab.update({"ing": 10 ** 6, "\u0120the": 10 ** 6 + 1, "\u0120Hello": 10 ** 6 + 2, ",": 10 ** 6 + 3})

    def get_vocab(self):
        return self.vocab


WORDS = [f"{a}{b}{c}{d}{e}" for a in "bcdfg" for b in "aeiou" for c in "lmnrst" for d in "aeiou" for e in "kpt"]


def test_vocabulary_words_are_plain_words_without_benchmark_words():
    words = vocabulary_words(_Tok(WORDS + ["vaccines", "interview", "museum"]))
    assert "museum" in words and "vaccines" not in words and "interview" not in words  # benchmark prompts' words
    assert "the" not in words and "Hello" not in words and "ing" not in words       # short, capitalised, no word start
    assert words == sorted(words) and len(words) == len(WORDS) + 1


def test_wide_prompts_take_turns_and_are_distinct():
    words = vocabulary_words(_Tok(WORDS))
    w = wide_prompts(300, words, seed=0)
    assert len(w) == len(set(w)) and len(w) > 280 and not set(w) & set(BENCH)
    general = set(general_prompts(5000, seed=0))
    assert [p in general for p in w[:6]] == [True, False, False] * 2
    assert sum(any(x in p for x in WORDS) for p in w) >= 95  # a third are about vocabulary words
    assert wide_prompts(300, words, seed=0) == w and wide_prompts(300, words, seed=1) != w
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        corpus_prompts("wide", 10)


def test_corpus_prompts_names():
    for name in CORPORA:
        assert len(corpus_prompts(name, 10, tokenizer=_Tok(WORDS))) == 10
    with pytest.raises(ValueError, match="corpus must be one of"):
        corpus_prompts("web", 10)
