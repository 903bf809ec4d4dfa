"""Exact trace replay: replayed log-probs equal the recorded ones for any sampler setting (so the
first importance ratio is 1), the packed views hold each step's canvas, and gradients flow only
when asked."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bd_models import (
    BlockDiffusionLM,
    ModelConfig,
    SamplerConfig,
    SamplingDistribution,
    entropy,
    sample,
    token_logprobs,
)
from bd_train import build_replay, replay_views

VOCAB, MASK, PAD, BLOCK = 32, 31, 30, 4
STOPS = (3, 5, 7)  # frequent under a random model: rows stop mid-generation
MODEL = BlockDiffusionLM(ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                                     block_size=BLOCK, q_tile=16, k_tile=16), key=jax.random.PRNGKey(0))


@eqx.filter_jit
def score(model, batch, distribution: SamplingDistribution):
    # knobs traced, switches static: one compile per switch pair, like the sampler
    return token_logprobs(model, batch, distribution, with_entropy=True)


def prompts(seed: int, batch: int = 4, length: int = 8):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, PAD, (batch, length)).astype(np.int32)
    valid = np.arange(length)[None, :] >= rng.integers(0, length - 1, (batch, 1))  # per-row lengths
    return np.where(valid, tokens, PAD).astype(np.int32), valid


def rollout(cfg: SamplerConfig, seed: int):
    return sample(MODEL, prompts(seed), cfg, key=jax.random.PRNGKey(seed))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(temperature=st.floats(0.3, 1.5), top_k=st.none() | st.integers(2, 20), top_p=st.none() | st.floats(0.5, 0.95),
       strategy=st.sampled_from(["threshold", "steps", "random"]), threshold=st.floats(0.2, 0.95),
       seed=st.integers(0, 2**16))
def test_replayed_logprobs_equal_recorded(temperature, top_k, top_p, strategy, threshold, seed):
    extra = dict(threshold=threshold) if strategy == "threshold" else dict(steps_per_block=2)
    distribution = SamplingDistribution(temperature=temperature, top_k=top_k, top_p=top_p)
    cfg = SamplerConfig(block_size=BLOCK, max_new_tokens=12, mask_id=MASK, pad_id=PAD, distribution=distribution,
                        strategy=strategy, stop_ids=STOPS, **extra)
    out = rollout(cfg, seed)
    replay = build_replay(out, mask_id=MASK, num_views=16)  # one bucket: 3 blocks x at most 4 steps
    replay.batch.validate(vocab_size=VOCAB)
    logp, ent = score(MODEL, replay.batch, cfg.distribution)
    mask = np.asarray(replay.mask)
    # every committed token of the trace is scored exactly once
    assert mask.sum() == np.asarray(out.trace.committed).sum() == np.asarray(out.completion_valid).sum()
    np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(replay.recorded_logprobs)[mask], atol=1e-5, rtol=0)
    ratio = np.exp(np.asarray(logp) - np.asarray(replay.recorded_logprobs))[mask]
    np.testing.assert_allclose(ratio, 1.0, atol=1e-5 / 0.3)  # exp amplifies nothing here: log-probs <= 0
    assert np.all(np.asarray(logp)[~mask] == 0) and np.all(np.asarray(ent)[~mask] == 0)
    assert np.all(np.asarray(ent)[mask] >= 0)


def test_views_hold_the_canvas_before_each_step():
    cfg = SamplerConfig(block_size=BLOCK, max_new_tokens=12, mask_id=MASK, pad_id=PAD, strategy="steps",
                        steps_per_block=2, stop_ids=STOPS)
    out = rollout(cfg, 11)
    replay = build_replay(out, mask_id=MASK)
    assert replay.batch.shape[1] == 8 + 12 + replay_views(out) * BLOCK
    layout = {k: np.asarray(getattr(replay.batch.layout, k)) for k in ("tokens", "positions", "block_ids",
                                                                         "view_ids", "valid")}
    trace = {k: np.asarray(getattr(out.trace, k)) for k in ("block_ids", "committed", "tokens", "step_valid")}
    canvas_len = 8 + 12
    for r in range(out.batch_size):
        valid_steps = np.flatnonzero(trace["step_valid"][r])
        np.testing.assert_array_equal(np.asarray(replay.step_index[r])[:len(valid_steps)], valid_steps)
        canvas = {}
        for v, s in enumerate(valid_steps):
            sl = slice(canvas_len + v * BLOCK, canvas_len + (v + 1) * BLOCK)
            block = trace["block_ids"][r, s]
            positions = block * BLOCK + np.arange(BLOCK)
            expected = [canvas.get(p, MASK) for p in positions]
            np.testing.assert_array_equal(layout["tokens"][r, sl], expected)
            np.testing.assert_array_equal(layout["positions"][r, sl], positions)
            assert np.all(layout["block_ids"][r, sl] == block) and np.all(layout["view_ids"][r, sl] == v + 1)
            assert np.all(layout["valid"][r, sl])
            np.testing.assert_array_equal(np.asarray(replay.batch.targets)[r, sl],
                                          np.where(trace["committed"][r, s], trace["tokens"][r, s], 0))
            for i in np.flatnonzero(trace["committed"][r, s]):
                canvas[positions[i]] = trace["tokens"][r, s, i]
        assert not layout["valid"][r, canvas_len + len(valid_steps) * BLOCK:].any()


def test_gradient_flows_only_when_asked_and_entropy_matches_reference():
    cfg = SamplerConfig(block_size=BLOCK, max_new_tokens=12, mask_id=MASK, pad_id=PAD,
                        distribution=SamplingDistribution(temperature=0.8, top_k=10), stop_ids=STOPS)
    replay = build_replay(rollout(cfg, 12), mask_id=MASK)
    params, static = eqx.partition(MODEL, eqx.is_inexact_array)

    def total(p, stop_gradient):
        logp, _ = token_logprobs(eqx.combine(p, static), replay.batch, cfg.distribution,
                                 stop_gradient=stop_gradient)
        return jnp.sum(logp)

    grad = jax.jit(jax.grad(total), static_argnums=1)
    frozen, live = grad(params, True), grad(params, False)
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree_util.tree_leaves(frozen))
    norms = [float(jnp.linalg.norm(g)) for g in jax.tree_util.tree_leaves(live)]
    assert all(np.isfinite(norms)) and sum(norms) > 0

    logp, ent = eqx.filter_jit(token_logprobs)(MODEL, replay.batch, cfg.distribution, with_entropy=True)
    dist = cfg.distribution.logprobs(eqx.filter_jit(MODEL)(replay.batch.layout))
    p = np.exp(np.asarray(dist, np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        reference = -np.sum(np.where(p > 0, p * np.log(p), 0.0), -1)
    mask = np.asarray(replay.mask)
    np.testing.assert_allclose(np.asarray(ent)[mask], reference[mask], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(entropy(dist))[mask], reference[mask], rtol=1e-4, atol=1e-6)
