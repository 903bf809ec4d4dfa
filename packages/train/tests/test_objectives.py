"""SFT, OPD and GRPO-family objectives against NumPy references and their defining properties."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bd_core import DiffusionTokenBatch, DistillationBatch, RolloutOutput, ViewLayout, WeightedMetric
from bd_models import SamplingDistribution, token_logprobs
from bd_train import (
    GRPOBatch,
    GRPOConfig,
    OPDConfig,
    Trainer,
    TrainerConfig,
    compute_advantages,
    distribution_score,
    grpo_objective,
    make_grpo_loss,
    opd_loss,
    opd_objective,
    require_trace,
    sft_loss,
    split_microbatches,
)

B, T, V = 4, 6, 7


def _logits(seed, shape=(B, T, V), scale=2.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_sft_loss_matches_reference_and_sanitizes_inactive_targets(batch_factory):
    batch = batch_factory(0, rows=B, length=T)
    targets = jnp.where(batch.weights > 0, batch.targets, 999)  # out of vocab, but inactive
    batch = dataclasses.replace(batch, targets=targets)
    logits = _logits(1, (B, T, 11))
    out = sft_loss(logits, batch)
    w, active = np.asarray(batch.weights, np.float64), np.asarray(batch.weights) > 0
    logp = _log_softmax(logits)
    ce = -np.take_along_axis(logp, np.where(active, np.asarray(targets), 0)[..., None], -1)[..., 0]
    np.testing.assert_allclose(out.loss.numerator, np.sum(w * ce * active), rtol=1e-6)
    np.testing.assert_allclose(out.loss.denominator, np.sum(batch.denom_weights), rtol=1e-6)
    grads = jax.grad(lambda x: sft_loss(x, batch).loss.compute())(logits)
    assert bool(jnp.all(jnp.isfinite(grads))) and not bool(jnp.any(grads[~active] != 0))
    onehot = np.eye(11)[np.where(active, np.asarray(targets), 0)]
    scale = (w * active / np.sum(batch.denom_weights))[..., None]
    np.testing.assert_allclose(grads, scale * (np.exp(logp) - onehot), atol=1e-6)


def _opd_reference(student, teacher, weights, t, denom):
    p_log = _log_softmax(np.asarray(teacher) / t)
    q_log = _log_softmax(np.asarray(student) / t)
    kl = np.sum(np.exp(p_log) * (p_log - q_log), -1)
    return np.sum(weights * kl) * t**2 / np.sum(denom)


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_opd_loss_matches_reference_with_fractional_weights(temperature):
    student, teacher = _logits(2), _logits(3)
    weights = jnp.asarray(np.random.default_rng(4).uniform(0, 2, (B, T)) * (np.arange(T) % 3 != 0), jnp.float32)
    out = opd_loss(student, teacher, weights, OPDConfig(temperature=temperature))
    expected = _opd_reference(student, teacher, np.asarray(weights), temperature, np.asarray(weights))
    np.testing.assert_allclose(out.loss.compute(), expected, rtol=1e-5)
    teacher_grad = jax.grad(lambda t: opd_loss(student, t, weights, OPDConfig(temperature=temperature)).loss.compute())(
        teacher)
    assert not bool(jnp.any(teacher_grad != 0))


def test_opd_teacher_equal_to_student_gives_zero_kl_and_gradient():
    logits, weights = _logits(5), jnp.ones((B, T), jnp.float32)
    config = OPDConfig(temperature=2.0)
    out = opd_loss(logits, logits, weights, config)
    assert float(out.loss.compute()) == 0.0 and float(out.aux["kl"].compute()) == 0.0
    grads = jax.grad(lambda s: opd_loss(s, logits, weights, config).loss.compute())(logits)
    assert float(jnp.max(jnp.abs(grads))) <= 1e-7


def test_opd_hard_ce_and_masked_positions(toy_model):
    mask_id = 10
    tokens = np.array([[1, 2, 3, mask_id, 4, mask_id]] * 2)
    views = np.array([[0, 0, 0, 1, 1, 1]] * 2)
    valid = np.ones_like(tokens, bool)
    valid[1, 5] = False
    positions = np.tile([0, 1, 2, 0, 1, 2], (2, 1))
    layout = ViewLayout.create(tokens, positions, np.zeros_like(tokens), views, valid)
    committed = np.zeros(tokens.shape, np.float32)
    committed[:, 4] = 1.0
    student = DiffusionTokenBatch.create(layout, np.where(committed > 0, 5, 0), committed)
    model = toy_model(key=jax.random.key(0))
    teacher = _logits(6, (2, 6, 11))
    batch = DistillationBatch.create(student, teacher)
    masked = opd_objective(model, batch, config=OPDConfig(positions="masked", mask_id=mask_id))
    assert float(masked.loss.denominator) == 3.0  # (0, 3), (0, 5), (1, 3): masked, valid, noisy view
    committed_out = opd_objective(model, batch, config=OPDConfig(hard_ce_weight=0.5))
    logits = model(layout)
    kl_only = opd_loss(logits, teacher, committed, OPDConfig()).loss.compute()
    ce = -_log_softmax(logits)[:, 4, 5].mean()
    np.testing.assert_allclose(committed_out.loss.compute(), kl_only + 0.5 * ce, rtol=1e-5)
    with pytest.raises(ValueError, match="OPDConfig.mask_id"):
        OPDConfig(positions="masked")


def _grpo_inputs(seed):
    rng = np.random.default_rng(seed)
    old = jnp.asarray(-rng.uniform(0.1, 3.0, (B, T)), jnp.float32)
    mask = jnp.asarray(rng.random((B, T)) < 0.7, jnp.float32).at[2].set(0.0)  # row 2 has no action tokens
    adv = jnp.asarray(rng.normal(size=B), jnp.float32)
    return old, mask, adv


@pytest.mark.parametrize("ratio", ["token", "gspo-token"])
def test_grpo_at_ratio_one(ratio):
    old, mask, adv = _grpo_inputs(0)
    config = GRPOConfig(ratio=ratio)
    out = grpo_objective(old, old, mask, adv, config, entropy=jnp.ones((B, T)))
    assert abs(float(out.aux["ratio_mean"].compute()) - 1.0) <= 1e-5
    assert abs(float(out.aux["ratio_max"].value) - 1.0) <= 1e-5
    assert float(out.aux["clip_fraction"].compute()) == 0.0
    assert float(out.aux["replay_drift"].compute()) == 0.0
    m = np.asarray(mask)
    np.testing.assert_allclose(out.loss.compute(), -np.sum(m * np.asarray(adv)[:, None]) / m.sum(), rtol=1e-6)
    grads = jax.grad(lambda n: grpo_objective(n, old, mask, adv, config).loss.compute())(old)
    np.testing.assert_allclose(grads, -m * np.asarray(adv)[:, None] / m.sum(), rtol=1e-6, atol=1e-9)


def test_grpo_clipping_stops_gradients_and_is_counted():
    old, mask, _ = _grpo_inputs(1)
    adv = jnp.ones((B,), jnp.float32)
    config = GRPOConfig(epsilon_low=0.2, epsilon_high=0.28)
    new = old + jnp.log(1.5)  # ratio 1.5 > 1.28 with positive advantages: clipped everywhere
    out = grpo_objective(new, old, mask, adv, config)
    assert float(out.aux["clip_fraction"].compute()) == pytest.approx(1.0)
    grads = jax.grad(lambda n: grpo_objective(n, old, mask, adv, config).loss.compute())(new)
    assert not bool(jnp.any(grads != 0))
    low = grpo_objective(old + jnp.log(1.25), old, mask, adv, config)  # inside clip-higher: not clipped
    assert float(low.aux["clip_fraction"].compute()) == 0.0


def test_gspo_token_uses_the_sequence_ratio():
    old, mask, adv = _grpo_inputs(2)
    new = old + jnp.asarray(np.random.default_rng(3).normal(0, 0.05, (B, T)), jnp.float32)
    out = grpo_objective(new, old, mask, adv, GRPOConfig(ratio="gspo-token", epsilon_low=0.5, epsilon_high=0.5))
    m = np.asarray(mask)
    rows = m.sum(1) > 0
    seq_ratio = np.exp(np.sum(m * (np.asarray(new) - np.asarray(old)), 1)[rows] / m.sum(1)[rows])
    expected = -np.sum(m[rows] * (seq_ratio * np.asarray(adv)[rows])[:, None]) / m.sum()
    np.testing.assert_allclose(out.loss.compute(), expected, rtol=1e-5)


def test_k3_kl_to_reference():
    old, mask, adv = _grpo_inputs(4)
    ref = old - 0.3
    out = grpo_objective(old, old, mask, adv, GRPOConfig(beta=0.1), ref_logp=ref)
    k3 = np.exp(-0.3) + 0.3 - 1.0
    np.testing.assert_allclose(out.aux["kl"].compute(), k3, rtol=1e-5)
    m = np.asarray(mask)
    expected = (-np.sum(m * np.asarray(adv)[:, None]) + 0.1 * k3 * m.sum()) / m.sum()
    np.testing.assert_allclose(out.loss.compute(), expected, rtol=1e-5)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_objective(old, old, mask, adv, GRPOConfig(beta=0.1))


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregations_are_exact_over_row_splits(aggregation):
    old, mask, adv = _grpo_inputs(5)
    new = old + 0.1
    config = GRPOConfig(aggregation=aggregation, norm_length=T)
    full = grpo_objective(new, old, mask, adv, config).loss
    parts = [grpo_objective(new[s], old[s], mask[s], adv[s], config).loss for s in (slice(0, 1), slice(1, 4))]
    total = parts[0] + parts[1]
    np.testing.assert_allclose(total.compute(), full.compute(), rtol=1e-6)
    m, ratio = np.asarray(mask), np.exp(0.1)
    per_token = -ratio * np.asarray(adv)[:, None] * m
    rows = m.sum(1) > 0
    if aggregation == "token-mean":
        expected = per_token.sum() / m.sum()
    elif aggregation == "seq-mean-token-mean":
        expected = np.mean(per_token.sum(1)[rows] / m.sum(1)[rows])
    else:
        expected = np.mean(per_token.sum(1)[rows] / T)
    np.testing.assert_allclose(full.compute(), expected, rtol=1e-5)


def test_compute_advantages_match_references():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0, 1.0], np.float32)
    groups = rewards.reshape(2, 4)
    mean = groups.mean(1, keepdims=True)
    np.testing.assert_allclose(compute_advantages(rewards, 4, "drgrpo"), (groups - mean).ravel(), rtol=1e-6)
    std = groups.std(1, ddof=1, keepdims=True)
    np.testing.assert_allclose(compute_advantages(rewards, 4, "grpo"), ((groups - mean) / (std + 1e-4)).ravel(),
                               rtol=1e-6)
    others = (groups.sum(1, keepdims=True) - groups) / 3
    np.testing.assert_allclose(compute_advantages(rewards, 4, "rloo"), (groups - others).ravel(), rtol=1e-6,
                               atol=1e-6)
    with pytest.raises(ValueError, match="group_size=3"):
        compute_advantages(rewards, 3)


def test_rollout_without_trace_is_refused():
    rollout = RolloutOutput(jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool), jnp.zeros((1, 4), jnp.int32),
                            jnp.ones((1, 4), bool), jnp.ones((1,), jnp.int32))
    with pytest.raises(ValueError, match="trace"):
        require_trace(rollout)


def test_grpo_loss_accumulates_exactly_in_the_trainer(toy_model, batch_factory):
    model = toy_model(key=jax.random.key(0))
    replay = batch_factory(7, rows=8)

    def score(m, batch):
        logp = jax.nn.log_softmax(m(batch.layout), -1)
        picked = jnp.take_along_axis(logp, jnp.where(batch.weights > 0, batch.targets, 0)[..., None], -1)[..., 0]
        return jnp.where(batch.weights > 0, picked, 0.0), None

    old, _ = score(model, replay)
    # Ratios differ by row, so the largest is in one microbatch only.
    batch = GRPOBatch(replay, old - 0.05 * jnp.arange(8.0)[:, None], jnp.linspace(-1.0, 1.0, 8), None)
    loss_fn = make_grpo_loss(GRPOConfig(aggregation="seq-mean-token-mean"), score)
    full = Trainer(loss_fn, optax.sgd(0.5)).step(Trainer(loss_fn, optax.sgd(0.5)).init(model, key=jax.random.key(0)),
                                                 batch)
    split = Trainer(loss_fn, optax.sgd(0.5), TrainerConfig(microbatches=3))
    state, metrics = split.step_microbatches(split.init(model, key=jax.random.key(0)),
                                             split_microbatches(batch, sizes=[3, 1, 4]))
    np.testing.assert_allclose(metrics["loss"], full[1]["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics["ratio_mean"], full[1]["ratio_mean"], rtol=1e-6)
    np.testing.assert_allclose(metrics["ratio_max"], full[1]["ratio_max"], rtol=1e-6)  # the max, not a mean of maxima
    assert float(full[1]["ratio_max"]) > 1.3
    diff = optax.tree.norm(jax.tree.map(lambda a, b: a - b, state.params, full[0].params))
    assert float(diff) <= 1e-6 * float(optax.tree.norm(full[0].params))
    assert isinstance(loss_fn(model, batch).loss, WeightedMetric)


def _with_targets(batch, targets):
    return dataclasses.replace(batch, targets=jnp.where(batch.weights > 0, targets, 0).astype(batch.targets.dtype))


def test_grpo_kl_under_top_k_is_the_unfiltered_k3_and_stays_finite(toy_model, batch_factory):
    """With a top-k sampler the KL is taken without the filter on both sides: the reference's
    filter drops tokens the policy sampled (there the filtered log-ratio is infinite), yet the loss
    and its gradient are finite and the KL is k3 under the tempered distributions, by hand."""
    policy, reference = toy_model(key=jax.random.key(0)), toy_model(key=jax.random.key(1))
    distribution = SamplingDistribution(temperature=0.8, top_k=2)
    replay = batch_factory(3, rows=8)
    replay = _with_targets(replay, jnp.argmax(policy(replay.layout), -1))  # tokens the policy's filter keeps
    active = np.asarray(replay.weights > 0)
    filtered_ref = np.asarray(token_logprobs(reference, replay, distribution)[0])
    assert np.isneginf(filtered_ref[active]).any()  # the filtered KL would be infinite here

    ref = token_logprobs(reference, replay, distribution.without_filters())[0]
    old = token_logprobs(policy, replay, distribution)[0]
    batch = GRPOBatch(replay, old, jnp.linspace(-1.0, 1.0, 8), ref)
    loss_fn = make_grpo_loss(GRPOConfig(beta=0.1), distribution_score(distribution, kl=True))
    out = loss_fn(policy, batch)
    grads = jax.grad(lambda p: loss_fn(p, batch).loss.compute())(policy)
    assert np.isfinite(float(out.loss.compute()))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))

    def tempered(model):
        logp = _log_softmax(np.asarray(model(replay.layout)) / 0.8)
        return np.take_along_axis(logp, np.asarray(replay.targets)[..., None], -1)[..., 0]

    delta = tempered(reference) - tempered(policy)
    k3 = np.exp(delta) - delta - 1.0
    weights = np.asarray(replay.weights)
    np.testing.assert_allclose(out.aux["kl"].compute(), (weights * k3)[active].sum() / weights.sum(), rtol=1e-5)
    assert float(out.aux["kl"].compute()) > 0


def test_a_token_the_policys_filter_drops_after_the_rollout_has_ratio_zero_and_is_counted(toy_model, batch_factory):
    """A later update of the same rollout: a recorded token the policy's top-k now excludes has
    log-prob -inf. Its ratio is 0, the loss and gradient stay finite, `replay_drift` averages the
    other tokens and `dropped_by_filter` is the excluded share."""
    policy = toy_model(key=jax.random.key(2))
    distribution = SamplingDistribution(top_k=2)
    replay = batch_factory(4, rows=8)
    logits = policy(replay.layout)
    worst = np.asarray(jnp.argmin(logits, -1))
    rows = np.arange(8)[:, None] % 2 == 0  # even rows recorded a token the filter now drops
    replay = _with_targets(replay, np.where(rows, worst, np.asarray(jnp.argmax(logits, -1))))
    new = np.asarray(token_logprobs(policy, replay, distribution)[0])
    active = np.asarray(replay.weights > 0)
    dropped = active & np.broadcast_to(rows, active.shape)
    assert np.isneginf(new[dropped]).all() and np.isfinite(new[active & ~dropped]).all()
    old = jnp.where(replay.weights > 0, -0.5, 0.0)  # finite: what the rollout recorded
    batch = GRPOBatch(replay, old, jnp.linspace(-1.0, 1.0, 8))
    loss_fn = make_grpo_loss(GRPOConfig(), distribution_score(distribution))
    out = loss_fn(policy, batch)
    grads = jax.grad(lambda p: loss_fn(p, batch).loss.compute())(policy)
    assert np.isfinite(float(out.loss.compute()))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    weights = np.asarray(replay.weights)
    kept = active & ~dropped
    np.testing.assert_allclose(out.aux["dropped_by_filter"].compute(), weights[dropped].sum() / weights.sum(),
                               rtol=1e-6)
    np.testing.assert_allclose(out.aux["replay_drift"].compute(),
                               (weights[kept] * np.abs(new[kept] + 0.5)).sum() / weights[kept].sum(), rtol=1e-5)
