"""Weighted metrics and their global reduction.

A loss is a `WeightedMetric(numerator, denominator)`: microbatches and devices add numerators and
denominators separately and divide once at the end, so any split of a batch gives the value (and
gradient) of the whole batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


class MetricError(ValueError):
    """A metric buffer that cannot be reduced (kinds or settings disagree)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WeightedMetric:
    """`numerator / denominator`, reduced globally.

    `eps` is added to the denominator and `min_denom` floors it; both are static settings that
    every combined metric must share. A zero (effective) denominator computes to exactly 0.

    Attributes:
        numerator: the summed quantity.
        denominator: what it is normalized by, summed the same way.
        eps: added to the denominator (static).
        min_denom: a floor for the denominator (static).
    """

    numerator: Array
    denominator: Array
    eps: float | None = dataclasses.field(default=None, metadata=dict(static=True))
    min_denom: float | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def from_scalar(cls, value: Any) -> WeightedMetric:
        """A plain scalar loss counts as one unit of denominator (a mean of microbatches)."""
        value = jnp.asarray(value)
        return cls(value, jnp.ones((), value.dtype if jnp.issubdtype(value.dtype, jnp.floating) else jnp.float32))

    @property
    def settings(self) -> tuple[float | None, float | None]:
        return (self.eps, self.min_denom)

    def total(self) -> WeightedMetric:
        """Sum numerator and denominator over every axis (per-token arrays -> scalars)."""
        return dataclasses.replace(self, numerator=jnp.sum(self.numerator), denominator=jnp.sum(self.denominator))

    def effective_denominator(self) -> Array:
        """The denominator as `compute` divides by it: plus `eps`, at least `min_denom` when set."""
        den = jnp.asarray(self.denominator)
        if self.eps is not None:
            den = den + self.eps
        if self.min_denom is not None:
            den = jnp.maximum(den, self.min_denom)
        return den

    def compute(self) -> Array:
        """The metric's value, numerator over effective denominator (0 where the denominator is 0)."""
        den = self.effective_denominator()
        safe = jnp.where(den == 0, jnp.ones_like(den), den)
        return jnp.where(den == 0, jnp.zeros_like(self.numerator / safe), self.numerator / safe)

    def __add__(self, other: WeightedMetric) -> WeightedMetric:
        if not isinstance(other, WeightedMetric):
            return NotImplemented
        _check_settings(self, other, "<sum>")
        return dataclasses.replace(
            self,
            numerator=self.numerator + other.numerator,
            denominator=self.denominator + other.denominator,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaxMetric:
    """A maximum, reduced globally: the largest `value` over every microbatch and device (a mean
    of per-microbatch maxima would depend on the split)."""

    value: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossOutput:
    """What every objective returns: the loss as a weighted metric, plus aux metrics.

    Aux values are `WeightedMetric`s (reduced globally), `MaxMetric`s (the global maximum) or plain
    arrays (averaged).

    Attributes:
        loss: the objective, a weighted metric.
        aux: further metrics by name, reduced by their type.
    """

    loss: WeightedMetric
    aux: dict[str, Any] = dataclasses.field(default_factory=dict)


Metric = WeightedMetric | MaxMetric | Array | np.ndarray | float | int


def as_loss_output(value: LossOutput | Metric) -> LossOutput:
    """Accept a `LossOutput`, a `WeightedMetric` or a plain scalar loss (denominator 1)."""
    if isinstance(value, LossOutput):
        if not isinstance(value.loss, WeightedMetric):
            return LossOutput(WeightedMetric.from_scalar(value.loss), value.aux)
        return value
    if isinstance(value, WeightedMetric):
        return LossOutput(value, {})
    arr = jnp.asarray(value)
    if arr.ndim != 0:
        raise MetricError(f"a plain loss must be a scalar, got shape {arr.shape}; return a LossOutput "
                          "with a WeightedMetric for per-token losses")
    return LossOutput(WeightedMetric.from_scalar(arr), {})


def _check_settings(a: WeightedMetric, b: WeightedMetric, key: str) -> None:
    if a.settings != b.settings:
        raise MetricError(
            f"metric {key!r}: weighted metrics disagree on (eps, min_denom): {a.settings} vs "
            f"{b.settings}; build every microbatch's metric with the same settings"
        )


def _kind(value: Any) -> str:
    return "weighted" if isinstance(value, WeightedMetric) else "max" if isinstance(value, MaxMetric) else "plain"


def reduce_metrics(buffer: Sequence[Mapping[str, Metric]] | Mapping[str, Metric]) -> dict[str, Array]:
    """Reduce a buffer of metric dicts to values, choosing the reducer by each value's type.

    `buffer` is a sequence of dicts (one per microbatch or step) or one dict whose values carry
    leading (e.g. scanned microbatch) axes. Weighted metrics become Σnumerator / Σdenominator over
    everything; plain arrays become the mean of their per-entry means.

    Args:
        buffer: one dict of metrics per microbatch or step, or one dict with leading axes.

    Returns:
        Each metric's value over the whole buffer.

    Example:
        ```python
        import jax.numpy as jnp
        from bd_core import WeightedMetric, reduce_metrics

        short = WeightedMetric(jnp.array(3.0), jnp.array(2.0))  # loss 3 summed over 2 tokens
        long = WeightedMetric(jnp.array(1.0), jnp.array(6.0))  # loss 1 summed over 6 tokens
        loss = reduce_metrics([{"loss": short}, {"loss": long}])["loss"]
        assert abs(float(loss) - 0.5) < 1e-6  # 4 / 8 tokens, not the mean of 1.5 and 0.17
        ```
    """
    entries = [buffer] if isinstance(buffer, Mapping) else list(buffer)
    kinds: dict[str, str] = {}
    weighted: dict[str, WeightedMetric] = {}
    maxima: dict[str, Array] = {}
    plain: dict[str, list[Array]] = {}
    for index, entry in enumerate(entries):
        for key, value in entry.items():
            kind = _kind(value)
            if kinds.setdefault(key, kind) != kind:
                raise MetricError(
                    f"metric {key!r} changes kind inside one buffer: {kinds[key]} before entry "
                    f"{index}, {kind} there; a key must always be a WeightedMetric or always a plain array"
                )
            if isinstance(value, WeightedMetric):  # kind == "weighted", narrowed for the type checker
                total = value.total()
                if key in weighted:
                    _check_settings(weighted[key], total, key)
                    total = weighted[key] + total
                weighted[key] = total
            elif isinstance(value, MaxMetric):
                top = jnp.max(jnp.asarray(value.value, jnp.float32))
                maxima[key] = top if key not in maxima else jnp.maximum(maxima[key], top)
            else:
                plain.setdefault(key, []).append(jnp.mean(jnp.asarray(value, jnp.float32)))
    out: dict[str, Array] = {key: metric.compute() for key, metric in weighted.items()}
    out.update(maxima)
    out.update({key: jnp.mean(jnp.stack(values)) for key, values in plain.items()})
    return out
