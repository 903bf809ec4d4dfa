"""How sure a held-out number is, over the problems: a paired percentile bootstrap for the change
between two models evaluated on the same problems, the same bootstrap for one model's mean, and
Wilson's score interval for one model's accuracy. Fixed seeds: the same rewards give the same
interval, bit for bit, in every process and every resumed run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ._evaluate import Evaluation

CONFIDENCE = 0.95
RESAMPLES = 10_000
SEED = 0
_CHUNK = 500  # resamples drawn at once: bounds the index array at 500 x n


@dataclasses.dataclass(frozen=True)
class Interval:
    """An `estimate` over `n` problems and its two-sided `confidence` interval [`low`, `high`],
    made by `method` ("paired bootstrap", "bootstrap" or "Wilson")."""

    estimate: float
    low: float
    high: float
    n: int
    method: str
    confidence: float = CONFIDENCE

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def text(self, signed: bool = True) -> str:
        """`+0.031 [-0.012, +0.074]`, with `*` when the interval excludes zero (a change only)."""
        fmt = "+.3f" if signed else ".3f"
        mark = "*" if signed and self.excludes_zero else ""
        return f"{self.estimate:{fmt}} [{self.low:{fmt}}, {self.high:{fmt}}]{mark}"

    def to_dict(self) -> dict[str, Any]:
        """The interval as JSON-ready values (`summary.json`, checkpoint metadata)."""
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "n": self.n, "method": self.method,
                "confidence": self.confidence, "excludes_zero": self.excludes_zero}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Interval:
        """The interval `to_dict` wrote (keys it does not know are ignored)."""
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


def bootstrap_interval(values: Sequence[float] | np.ndarray, *, confidence: float = CONFIDENCE,
                       resamples: int = RESAMPLES, seed: int = SEED, method: str = "bootstrap") -> Interval:
    """The mean of `values` (one per problem) and its percentile bootstrap interval: `resamples`
    means of n problems drawn with replacement, cut at the (1 ± confidence)/2 quantiles (the
    smallest resampled mean whose share at or below it reaches the level)."""
    values = np.asarray(values, np.float64)
    n = len(values)
    if n == 0:
        raise ValueError("bootstrap_interval: no values (an evaluation of zero problems)")
    if not 0 < confidence < 1 or resamples < 1:
        raise ValueError(f"bootstrap_interval: need 0 < confidence < 1 and resamples >= 1, got {confidence}, "
                         f"{resamples}")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, _CHUNK):
        rows = min(_CHUNK, resamples - start)
        means[start:start + rows] = values[rng.integers(0, n, (rows, n))].sum(axis=1) / n
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail], method="inverted_cdf")
    return Interval(float(values.sum() / n), float(low), float(high), n, method, confidence)


def paired_interval(after: Sequence[float] | np.ndarray, before: Sequence[float] | np.ndarray, *,
                    confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = SEED) -> Interval:
    """The mean change `after - before` over the same problems (one value each, in the same order)
    and its paired bootstrap interval: problems are resampled, each keeping both of its values."""
    after, before = np.asarray(after, np.float64), np.asarray(before, np.float64)
    if after.shape != before.shape or after.ndim != 1:
        raise ValueError(f"paired_interval: need one value per problem on both sides, got {after.shape} and "
                         f"{before.shape}")
    return bootstrap_interval(after - before, confidence=confidence, resamples=resamples, seed=seed,
                              method="paired bootstrap")


def wilson_interval(successes: int, n: int, *, confidence: float = CONFIDENCE) -> Interval:
    """A proportion `successes / n` and Wilson's score interval (sensible at 0 and n, unlike the
    normal approximation's)."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: need n >= 1 and 0 <= successes <= n, got {successes} of {n}")
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    p, z2 = successes / n, z * z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return Interval(p, max(0.0, center - half), min(1.0, center + half), n, "Wilson", confidence)


def gain_intervals(after: Evaluation, before: Evaluation) -> dict[str, Interval]:
    """Paired intervals of every per-problem metric both evaluations hold (greedy accuracy, mean
    reward, pass@k), `after - before`; empty when they were not made on the same problems."""
    a, b = after.per_problem(), before.per_problem()
    if not a or not b or len(after.rewards) != len(before.rewards):
        return {}
    return {name: paired_interval(a[name], b[name]) for name in a if name in b}
