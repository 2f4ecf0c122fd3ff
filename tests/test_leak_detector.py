"""The leak detector on the synthetic corpus (benchmark/investigations/leak_corpus.py), swept over 20 seeds: steady memory,
level shifts and sawtooths that give memory back are not leaks; leaks are found, and fast ones fast.

Shorter series than the benchmark's (150k env steps) keep this under a minute; the benchmark's results file has the
full corpus, and the decision times at more noise."""

import numpy as np
import pytest

import memory_utils as mu
from benchmark.investigations import leak_corpus as lc

SEEDS = range(20)


@pytest.fixture(autouse=True)
def short_series(monkeypatch):
    monkeypatch.setattr(lc, "LENGTH", 150_000)


NOT_LEAKS = {
    "steady, noise sd 20 MB": lc.steady(20),
    "one level shift of +120 MB": lc.level_shifts(120),
    "one level shift of +500 MB, noise sd 20 MB": lc.level_shifts(500, sd=20.0),
    "sawtooth of 200 MB per 30k steps": lc.sawtooth(200, 30_000),
    "sawtooth of 200 MB per 10k steps": lc.sawtooth(200, 10_000),
    "sawtooth of 100 MB per 20k steps": lc.sawtooth(100, 20_000),
    "sawtooth of 50 MB per 5k steps": lc.sawtooth(50, 5_000),
}


@pytest.mark.parametrize("name", list(NOT_LEAKS))
def test_memory_that_does_not_leak_is_never_aborted_and_rarely_suspected(name):
    series = [lc.run_series(NOT_LEAKS[name], seed) for seed in SEEDS]
    assert not [s["seed"] for s in series if s["aborted_at"] is not None], "aborted a run that does not leak"
    share = sum(s["suspected"] for s in series) / sum(s["checks"] for s in series)
    assert share <= 0.01, f"{100 * share:.2f} % of checks suspected a leak"


@pytest.mark.parametrize("rate, within", [(1, 20_000), (2, 20_000), (53, 5_000)])
def test_a_leak_is_found_within_its_deadline_in_95_percent_of_seeds(rate, within):
    """1 MB per 1k steps within 20k steps of its start; the seed's Pong leak (53 MB per 1k) within 5k."""
    series = [lc.run_series(lc.leak(rate), seed) for seed in SEEDS]
    assert all(s["suspected_before_onset"] == 0 for s in series), "suspected before the leak started"
    times = [s["decision_steps"] for s in series]
    on_time = sum(t is not None and t <= within for t in times)
    assert on_time >= 0.95 * len(series), sorted(t for t in times if t is not None)
    if rate == 53:  # --abort-on-leak stops the incident's run long before it would have died (53.8k steps in)
        assert all(s["aborted_at"] - s["onset"] <= 40_000 for s in series)


def test_the_slope_test_alone_would_have_aborted_a_level_shift():
    """What the rule is for: a +300 MB level shift gives a steep Theil-Sen slope over a window that straddles it,
    which the old slope-only detector called a leak; the jump model sees one step."""
    steps = np.arange(0, 40_000, 1000.0)
    values = 1500.0 + 300.0 * (steps >= 20_000) + np.random.default_rng(0).normal(0, 5, len(steps))
    assert mu.robust_slope(steps, values) * 1000 > 1.0
    growing, why, _ = mu.growth_evidence(steps, values, threshold_per_1k=1.0)
    assert not growing and why == "level_shift"


def test_a_leak_under_a_sawtooth_is_found_on_the_troughs():
    series = [lc.run_series(lc.sawtooth(100, 10_000, leak_per_1k=5.0), seed) for seed in range(5)]
    assert all(s["decision_steps"] is not None for s in series)
