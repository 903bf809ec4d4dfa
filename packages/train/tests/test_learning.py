"""Learning signal: GRPO on the library's own pieces (sampler with exact traces, replay, group
advantages, the clipped objective, the trainer) raises the reward of a toy with two answers, in
both rollout modes: confidence-threshold commits (surrogate likelihood) and a random commit
order (exact likelihood). Deterministic seeds, a few seconds each."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from bd_models import BlockDiffusionLM, ModelConfig, SamplerConfig, SamplingDistribution, sample
from bd_train import (
    GRPOBatch,
    GRPOConfig,
    OptimizerConfig,
    Trainer,
    build_replay,
    compute_advantages,
    distribution_score,
    make_grpo_loss,
    make_optimizer,
    replay_capacity,
)

VOCAB, PAD, MASK, BLOCK = 8, 6, 7, 2
GOOD, BAD = 1, 0  # the two answers (the untrained model prefers BAD); every other id is banned
PROMPTS, GROUP = 8, 8


def _reward(completions: np.ndarray) -> np.ndarray:
    return (completions[:, 0] == GOOD).astype(np.float32)  # the answer is the first generated token


@pytest.mark.parametrize("strategy", ["threshold", "random"])
def test_grpo_raises_the_reward_of_a_two_answer_toy(strategy):
    model = BlockDiffusionLM(ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                                         block_size=BLOCK, attention="dense"), key=jax.random.key(0))
    banned = [i for i in range(VOCAB) if i not in (GOOD, BAD)]
    extra = dict(threshold=0.9) if strategy == "threshold" else {}
    sampler = SamplerConfig(block_size=BLOCK, max_new_tokens=BLOCK, mask_id=MASK, pad_id=PAD, strategy=strategy,
                            distribution=SamplingDistribution(banned_ids=banned), **extra)
    trainer = Trainer(make_grpo_loss(GRPOConfig(), distribution_score(sampler.distribution)),
                      make_optimizer(OptimizerConfig(learning_rate=3e-2)))
    state = trainer.init(model, key=jax.random.key(1))
    prompts = (np.tile(np.array([[2, 3]], np.int32), (PROMPTS * GROUP, 1)), np.ones((PROMPTS * GROUP, BLOCK), bool))
    rewards = []
    for step in range(12):
        out = sample(state.model, prompts, sampler, key=jax.random.key(100 + step))
        reward = _reward(np.asarray(out.completion_tokens))
        rewards.append(float(reward.mean()))
        replay = build_replay(out, mask_id=MASK, num_views=replay_capacity(sampler))
        batch = GRPOBatch(replay.batch, replay.recorded_logprobs, compute_advantages(reward, GROUP))
        for _ in range(2):
            state, metrics = trainer.step(state, batch)
    assert rewards[0] < 0.5, "the untrained policy prefers the wrong answer"
    assert np.mean(rewards[-3:]) > 0.95 > rewards[0] + 0.2, rewards
