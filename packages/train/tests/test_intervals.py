"""The summary's intervals against references: the paired bootstrap against the exact bootstrap
distribution (computed, not sampled, for per-problem changes of -1, 0 or +1: correctness), and
Wilson's interval against scipy's (scipy comes with jax)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binomtest

from bd_train.stages import Evaluation, bootstrap_interval, gain_intervals, paired_interval, wilson_interval
from bd_train.stages._intervals import RESAMPLES


def _exact_bootstrap_quantiles(changes: np.ndarray, levels: tuple[float, ...]) -> tuple[list[float], np.ndarray]:
    """The quantiles (smallest value whose CDF reaches the level) of the mean of n draws with
    replacement from `changes` ∈ {-1, 0, 1}: the n-fold convolution of their frequencies. Also
    the CDF at every attainable mean, k / n for k = -n..n."""
    n = len(changes)
    step = np.asarray([np.mean(changes == v) for v in (-1, 0, 1)])
    pmf = np.ones(1)
    for _ in range(n):
        pmf = np.convolve(pmf, step)
    cdf = np.cumsum(pmf)
    sums = np.arange(-n, n + 1)
    return [float(sums[np.argmax(cdf >= level - 1e-12)] / n) for level in levels], cdf


@pytest.mark.parametrize("seed, n, exact", [(0, 10, True), (1, 12, True), (0, 16, False), (1, 64, False),
                                           (2, 256, False)])
def test_the_paired_bootstrap_matches_the_exact_bootstrap_distribution(seed, n, exact):
    rng = np.random.default_rng(seed)
    before = (rng.random(n) < 0.4).astype(float)
    after = np.where(rng.random(n) < 0.3, 1 - before, before)  # each problem flips with chance 0.3
    changes = after - before
    interval = paired_interval(after, before)
    # Sampling 10,000 resamples moves a quantile's level by a few standard errors at most: the
    # sampled bound lies between the exact quantiles 5 standard errors either side; where the
    # exact CDF has no attainable value within that band, it is the exact quantile itself.
    for level, bound in ((0.025, interval.low), (0.975, interval.high)):
        band = 5 * np.sqrt(level * (1 - level) / RESAMPLES)
        (below, quantile, above), cdf = _exact_bootstrap_quantiles(changes, (level - band, level, level + band))
        assert below <= bound <= above, (level, below, bound, above)
        if exact:  # these data keep the exact CDF clear of the band: the sampled bound is the exact one
            assert np.min(np.abs(cdf - level)) > band and bound == quantile
    assert interval.estimate == pytest.approx(changes.mean(), abs=1e-15) and interval.n == n
    assert interval.method == "paired bootstrap"
    assert interval.excludes_zero == (interval.low > 0 or interval.high < 0)
    assert paired_interval(after, before) == interval  # a fixed seed: the same interval every time


def test_no_change_gives_a_zero_width_interval_that_does_not_exclude_zero():
    same = np.asarray([1.0, 0.0, 0.0, 1.0])
    interval = paired_interval(same, same)
    assert (interval.estimate, interval.low, interval.high, interval.excludes_zero) == (0.0, 0.0, 0.0, False)
    assert interval.text() == "+0.000 [+0.000, +0.000]"
    assert paired_interval(np.ones(40), np.zeros(40)).text() == "+1.000 [+1.000, +1.000]*"
    with pytest.raises(ValueError, match="one value per problem"):
        paired_interval(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="no values"):
        bootstrap_interval([])


@pytest.mark.parametrize("successes, n", [(0, 16), (3, 16), (16, 16), (84, 256), (1, 1)])
def test_wilson_matches_scipy(successes, n):
    interval = wilson_interval(successes, n)
    reference = binomtest(successes, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert interval.low == pytest.approx(reference.low, abs=1e-12)
    assert interval.high == pytest.approx(reference.high, abs=1e-12)
    assert interval.estimate == successes / n and interval.method == "Wilson"


def test_gains_pair_every_per_problem_metric():
    """Accuracy, mean reward and each pass@k, from the per-problem results an evaluation keeps."""
    def evaluation(rewards, correct):
        rewards = np.asarray(rewards, float)
        return Evaluation(accuracy=float(np.mean(rewards == 1)), mean_reward=float(rewards.mean()), n=len(rewards),
                          nfe_per_token=1.0, generated_tokens=4.0, rewards=tuple(rewards.tolist()),
                          correct_samples=tuple(correct), samples_per_problem=2,
                          pass_at_k={"pass@1": float(np.mean(correct) / 2),
                                     "pass@2": float(np.mean([c > 0 for c in correct]))})

    before = evaluation([1, 0, 0.1, 0], [2, 0, 1, 0])
    after = evaluation([1, 1, 0.1, 1], [2, 1, 2, 2])
    gains = gain_intervals(after, before)
    assert list(gains) == ["accuracy", "mean_reward", "pass@1", "pass@2"]
    assert gains["accuracy"].estimate == after.accuracy - before.accuracy
    assert gains["mean_reward"].estimate == pytest.approx(after.mean_reward - before.mean_reward)
    for key in ("pass@1", "pass@2"):
        assert gains[key].estimate == pytest.approx(after.pass_at_k[key] - before.pass_at_k[key])
    assert gain_intervals(after, evaluation([1, 0], [0, 0])) == {}  # other problems: nothing paired
