"""The offline prompt corpora of ``specdec train-head``: seeded, distinct, and free of benchmark prompts."""
import pytest

from specdec.bench.workloads import PROMPT_SETS
from specdec.drafters.eagle.corpus import CORPORA, corpus_prompts, general_prompts, mixed_prompts

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


def test_corpus_prompts_names():
    for name in CORPORA:
        assert len(corpus_prompts(name, 10)) == 10
    with pytest.raises(ValueError, match="corpus must be one of"):
        corpus_prompts("web", 10)
