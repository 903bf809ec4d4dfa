"""Global normalization: any microbatch split reduces to the whole-batch value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bd_core import LossOutput, MetricError, WeightedMetric, as_loss_output, reduce_metrics


def _per_token_metric(losses, weights):
    return WeightedMetric(jnp.sum(losses * weights), jnp.sum(weights))


@st.composite
def batch_and_split(draw):
    n = draw(st.integers(1, 24))
    # Nothing subnormal, inputs or products: XLA on CPU flushes subnormals to zero (a weight of 1e-45
    # sums to 0; 1.18e-38 x 0.5 multiplies to 0), numpy does not. Every value is 0 or >= 1e-6, so
    # every product of a loss and a weight is 0 or >= 1e-12, far above float32's normal range.
    floats = lambda hi: st.one_of(st.just(0.0), st.floats(float(np.float32(1e-6)), hi, width=32))  # noqa: E731
    losses = np.asarray(draw(st.lists(floats(10.0), min_size=n, max_size=n)), np.float32)
    weights = np.asarray(draw(st.lists(floats(3.0), min_size=n, max_size=n)), np.float32)
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=5)))
    return losses, weights, [0, *cuts, n]


@settings(max_examples=60, deadline=None)
@given(batch_and_split())
def test_any_unequal_split_reduces_to_the_whole_batch(case):
    losses, weights, bounds = case
    whole = reduce_metrics([{"loss": _per_token_metric(losses, weights)}])["loss"]
    parts = [
        {"loss": _per_token_metric(losses[a:b], weights[a:b])} for a, b in zip(bounds[:-1], bounds[1:])
    ]
    split = reduce_metrics(parts)["loss"]
    expected = np.sum(losses.astype(np.float64) * weights) / np.sum(weights) if weights.sum() > 0 else 0.0
    np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(whole, expected, rtol=1e-5, atol=1e-6)


def test_stacked_buffer_equals_list_buffer():
    num, den = jnp.array([1.0, 2.0, 3.0]), jnp.array([2.0, 0.5, 4.0])
    stacked = reduce_metrics({"m": WeightedMetric(num, den), "p": jnp.array([1.0, 2.0, 6.0])})
    listed = reduce_metrics([{"m": WeightedMetric(n, d), "p": p}
                             for n, d, p in zip(num, den, jnp.array([1.0, 2.0, 6.0]))])
    np.testing.assert_allclose(stacked["m"], 6.0 / 6.5, rtol=1e-6)
    np.testing.assert_allclose(listed["m"], stacked["m"], rtol=1e-6)
    np.testing.assert_allclose(stacked["p"], 3.0)
    np.testing.assert_allclose(listed["p"], 3.0)


def test_zero_denominator_is_exactly_zero_with_finite_gradient():
    def value(x):
        return WeightedMetric(jnp.sum(x * 0.0), jnp.zeros(())).compute()

    x = jnp.arange(3.0)
    assert value(x) == 0.0
    grad = jax.grad(value)(x)
    assert np.all(np.isfinite(grad)) and np.all(grad == 0.0)


def test_all_zero_weights_give_zero_loss_and_zero_gradient():
    losses = jnp.array([1.0, 2.0, 3.0])

    def loss(scale):
        weights = jnp.zeros(3)
        return reduce_metrics([{"l": _per_token_metric(losses * scale, weights)}])["l"]

    assert loss(1.0) == 0.0
    assert jax.grad(loss)(1.0) == 0.0


def test_eps_and_min_denom():
    assert WeightedMetric(jnp.array(1.0), jnp.array(1.0), eps=1.0).compute() == 0.5
    assert WeightedMetric(jnp.array(1.0), jnp.array(0.5), min_denom=2.0).compute() == 0.5
    assert WeightedMetric(jnp.array(3.0), jnp.array(0.0), min_denom=1.0).compute() == 3.0


def test_plain_scalar_losses_count_as_denominator_one():
    out = as_loss_output(jnp.array(2.0))
    assert isinstance(out, LossOutput) and out.loss.denominator == 1.0
    reduced = reduce_metrics([{"l": as_loss_output(2.0).loss}, {"l": as_loss_output(4.0).loss}])
    assert reduced["l"] == 3.0
    with pytest.raises(MetricError, match="must be a scalar"):
        as_loss_output(jnp.ones(3))


def test_a_key_that_changes_kind_is_an_error():
    with pytest.raises(MetricError, match=r"'acc' changes kind.*entry 1"):
        reduce_metrics([{"acc": WeightedMetric(jnp.array(1.0), jnp.array(2.0))}, {"acc": jnp.array(0.5)}])


def test_weighted_metrics_that_disagree_on_settings_are_an_error():
    with pytest.raises(MetricError, match=r"'loss'.*eps, min_denom"):
        reduce_metrics([
            {"loss": WeightedMetric(jnp.array(1.0), jnp.array(2.0), eps=1e-6)},
            {"loss": WeightedMetric(jnp.array(1.0), jnp.array(2.0))},
        ])


def test_metrics_pass_through_jit_and_vmap():
    metric = WeightedMetric(jnp.array([1.0, 2.0]), jnp.array([2.0, 2.0]), eps=0.0)
    out = jax.jit(lambda m: m.total())(metric)
    assert out.eps == 0.0 and out.compute() == 0.75
    per_row = jax.vmap(lambda m: m.compute())(metric)
    np.testing.assert_allclose(per_row, [0.5, 1.0])


def test_max_metric_is_the_global_maximum_for_any_split():
    from bd_core import MaxMetric

    values = jnp.array([0.5, 3.0, 1.0, 2.0])
    whole = reduce_metrics([{"m": MaxMetric(jnp.max(values))}])["m"]
    parts = reduce_metrics([{"m": MaxMetric(jnp.max(values[:1]))}, {"m": MaxMetric(jnp.max(values[1:]))}])["m"]
    stacked = reduce_metrics({"m": MaxMetric(jnp.array([0.5, 3.0]))})["m"]  # a scanned microbatch axis
    assert float(whole) == float(parts) == float(stacked) == 3.0
    with pytest.raises(MetricError, match="changes kind"):
        reduce_metrics([{"m": MaxMetric(jnp.array(1.0))}, {"m": jnp.array(1.0)}])
