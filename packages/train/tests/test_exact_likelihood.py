"""The `random` commit strategy has an exact trajectory likelihood.

On a canvas small enough to enumerate (3 samplable tokens, 2 blocks of 2 positions, one commit per
step: 2 orders x 9 token pairs per block, 324 trajectories) the replayed log-probability of every
trajectory, log P(schedule) + the sum of its committed log-probs, is a distribution: it sums to 1.
The sampler draws trajectories with exactly those probabilities (a chi-square test at a fixed
seed), and the log-probs it records for a trajectory equal the enumerated ones.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import scipy.stats

from bd_core import DiffusionTrace, RolloutOutput
from bd_models import (
    BlockDiffusionLM,
    ModelConfig,
    SamplerConfig,
    SamplingDistribution,
    sample,
    schedule_logprob,
    token_logprobs,
)
from bd_train import build_replay

SAMPLABLE, PAD, MASK, BLOCK, BLOCKS = 3, 3, 4, 2, 2
PROMPT = np.array([[0, 1]], np.int32)  # one block: the first generated block is canvas block 1
MODEL = BlockDiffusionLM(ModelConfig(vocab_size=5, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                                     block_size=BLOCK, attention="dense"), key=jax.random.key(3))
CONFIG = SamplerConfig(block_size=BLOCK, max_new_tokens=BLOCK * BLOCKS, mask_id=MASK, pad_id=PAD, strategy="random",
                       distribution=SamplingDistribution(temperature=1.0))


def _trajectories():
    """Every (order, tokens) per block: `committed` [K, 4, 2] one-hot per step, `tokens` [K, 4, 2]."""
    per_block = [(order, toks) for order in itertools.permutations(range(BLOCK))
                 for toks in itertools.product(range(SAMPLABLE), repeat=BLOCK)]
    committed, tokens = [], []
    for blocks in itertools.product(per_block, repeat=BLOCKS):
        c = np.zeros((BLOCKS * BLOCK, BLOCK), bool)
        t = np.zeros((BLOCKS * BLOCK, BLOCK), np.int32)
        for j, (order, toks) in enumerate(blocks):
            for step, position in enumerate(order):
                c[j * BLOCK + step, position] = True
                t[j * BLOCK + step, position] = toks[position]
        committed.append(c)
        tokens.append(t)
    return np.stack(committed), np.stack(tokens)


def _key(committed, tokens) -> list[bytes]:
    return [c.tobytes() + t.tobytes() for c, t in zip(np.asarray(committed), np.asarray(tokens))]


def _enumerated_logprobs(committed, tokens):
    """Exact log pi of each trajectory, scored by replay as GRPO scores it."""
    k = len(committed)
    canvas = (tokens * committed).reshape(k, BLOCKS, BLOCK, BLOCK).sum(axis=2).reshape(k, -1)
    trace = DiffusionTrace(
        block_ids=np.repeat(np.arange(1, BLOCKS + 1, dtype=np.int32), BLOCK)[None].repeat(k, 0),
        committed=committed, tokens=tokens, logprobs=np.zeros(committed.shape, np.float32),
        step_valid=np.ones((k, BLOCKS * BLOCK), bool))
    rollout = RolloutOutput(PROMPT.repeat(k, 0), np.ones((k, BLOCK), bool), canvas.astype(np.int32),
                            np.ones((k, BLOCK * BLOCKS), bool), np.full((k,), BLOCK * BLOCKS, np.int32),
                            trace=trace).validate()
    replay = build_replay(rollout, mask_id=MASK)
    logp, _ = token_logprobs(MODEL, replay.batch, CONFIG.distribution)
    committed_logp = np.sum(np.where(np.asarray(replay.mask), np.asarray(logp, np.float64), 0.0), axis=-1)
    return committed_logp + np.asarray(schedule_logprob(trace), np.float64)


def test_trajectory_probabilities_sum_to_one_and_match_the_sampler():
    committed, tokens = _trajectories()
    logp = _enumerated_logprobs(committed, tokens)
    assert len(logp) == 324
    np.testing.assert_allclose(np.exp(logp).sum(), 1.0, atol=1e-5)
    assert np.exp(logp).max() > 100 * np.exp(logp).min()  # far from uniform: the test can tell them apart

    index = {key: i for i, key in enumerate(_key(committed, tokens))}
    counts = np.zeros(len(logp))
    draws = 4096
    for seed in range(8):
        out = sample(MODEL, (PROMPT.repeat(draws, 0), np.ones((draws, BLOCK), bool)), CONFIG,
                     key=jax.random.key(seed))
        hits = np.array([index[key] for key in _key(out.trace.committed, out.trace.tokens)])
        np.add.at(counts, hits, 1)
        # what the sampler records is the enumerated log-probability of what it drew
        recorded = np.asarray(out.trace.logprobs, np.float64).sum((1, 2)) + np.asarray(
            schedule_logprob(out.trace), np.float64)
        np.testing.assert_allclose(recorded, logp[hits], atol=2e-5)
    expected = counts.sum() * np.exp(logp)
    expected *= counts.sum() / expected.sum()
    small = expected < 5  # pooled into one cell, as the test requires expected counts >= 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    assert small.sum() < len(logp) // 3  # most trajectories are tested one by one
    p_value = scipy.stats.chisquare(observed, expected).pvalue
    assert p_value > 1e-3, f"sampled trajectory frequencies differ from the exact probabilities (p = {p_value:.2g})"


def test_the_threshold_strategy_is_not_an_exact_likelihood():
    """The contrast that makes the mode necessary: with confidence-threshold commits the same
    products of committed probabilities do not form a distribution over what the sampler draws."""
    cfg = CONFIG.replace(strategy="threshold", steps_per_block=None, threshold=0.5)
    out = sample(MODEL, (PROMPT.repeat(4096, 0), np.ones((4096, BLOCK), bool)), cfg, key=jax.random.key(0))
    logp = np.asarray(out.trace.logprobs, np.float64).sum((1, 2))
    keys = _key(out.trace.committed, out.trace.tokens)
    distinct = {key: p for key, p in zip(keys, logp)}
    frequency = {key: keys.count(key) / len(keys) for key in distinct}
    gaps = [abs(frequency[key] - np.exp(p)) for key, p in distinct.items()]
    assert max(gaps) > 0.02, "threshold commits would have to depend on nothing but the tokens drawn"
