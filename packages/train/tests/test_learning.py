"""Learning signal, on the library's own pieces with deterministic seeds (seconds each):
- SFT (grain pipeline, masking corruption, the SFT objective) lowers the loss and raises greedy
  accuracy on 3-digit sort from nothing;
- OPD (student rollouts with exact traces, teacher scoring of the replayed views) lowers the
  KL(teacher ‖ student) on a fixed held-out replay and raises the student's accuracy;
- GRPO (replay, group advantages, the clipped objective) raises the reward of a toy with two
  answers, with confidence-threshold commits (surrogate likelihood) and with a random commit
  order (exact likelihood)."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest

from bd_core import DistillationBatch
from bd_data import ByteTokenizer, CanvasConfig, get_task, iterate, prompt_dataset, sft_dataset
from bd_models import BlockDiffusionLM, ModelConfig, SamplerConfig, SamplingDistribution, decode_completions, sample
from bd_train import (
    GRPOBatch,
    GRPOConfig,
    OPDConfig,
    OptimizerConfig,
    Trainer,
    build_replay,
    compute_advantages,
    distribution_score,
    make_grpo_loss,
    make_opd_loss,
    make_optimizer,
    opd_objective,
    replay_capacity,
    sft_objective,
)

TOKENIZER = ByteTokenizer()
TASK = get_task("sort", length=3, seed=0)
CANVAS = CanvasConfig(prompt_len=4, max_new_tokens=4, block_size=4)


def _lm(d_model: int, n_layers: int, seed: int) -> BlockDiffusionLM:
    return BlockDiffusionLM(ModelConfig(vocab_size=TOKENIZER.vocab_size, d_model=d_model, n_layers=n_layers,
                                        n_heads=2, n_kv_heads=1, d_ff=2 * d_model, block_size=4,
                                        attention="dense"), key=jax.random.key(seed))


def _sort_sampler(**changes) -> SamplerConfig:
    return SamplerConfig(block_size=4, max_new_tokens=4, mask_id=TOKENIZER.mask_id, pad_id=TOKENIZER.pad_id,
                         stop_ids=(TOKENIZER.eos_id,), **changes)


EVAL = next(iterate(prompt_dataset(TASK.dataset("eval", 128), TOKENIZER, CANVAS, seed=0, batch_size=128,
                                   shuffle=False, num_epochs=1)))


def _accuracy(model) -> float:
    out = sample(model, (EVAL.tokens, EVAL.valid), _sort_sampler(distribution=SamplingDistribution(temperature=0)),
                 key=jax.random.key(0))
    texts = decode_completions(TOKENIZER, out, stop_ids=(TOKENIZER.eos_id,))
    return float(np.mean([TASK.is_correct(example, text) for example, text in zip(EVAL.examples, texts)]))


def _sft(model, steps: int):
    trainer = Trainer(sft_objective, make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_steps=10)))
    state = trainer.init(model, key=jax.random.key(1))
    data = iterate(sft_dataset(TASK.dataset("train"), TOKENIZER, CANVAS, seed=0, batch_size=64))
    losses = []
    for _ in range(steps):
        state, metrics = trainer.step(state, next(data))
        losses.append(float(metrics["loss"]))
    return state.model, losses


@pytest.fixture(scope="module")
def teacher():
    return _sft(_lm(64, 2, seed=0), 300)


def test_sft_lowers_the_loss_and_raises_accuracy(teacher):
    model, losses = teacher
    assert _accuracy(_lm(64, 2, seed=0)) == 0.0
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:20]), (losses[:20], losses[-20:])
    assert _accuracy(model) > 0.5


def test_opd_lowers_the_kl_to_the_teacher_and_raises_accuracy(teacher):
    teacher_model, _ = teacher
    student, _ = _sft(_lm(32, 1, seed=5), 40)  # a weak student: well-formed, mostly wrong
    sampler = _sort_sampler()
    trainer = Trainer(make_opd_loss(OPDConfig()), make_optimizer(OptimizerConfig(learning_rate=3e-3)))
    state = trainer.init(student, key=jax.random.key(2))
    prompts = iterate(prompt_dataset(TASK.dataset("train"), TOKENIZER, CANVAS, seed=1, batch_size=64))
    teacher_logits = eqx.filter_jit(lambda model, layout: model(layout))

    def distillation_batch(model, tokens, valid, key):
        replay = build_replay(sample(model, (tokens, valid), sampler, key=key), mask_id=TOKENIZER.mask_id,
                              num_views=replay_capacity(sampler))
        return DistillationBatch(replay.batch, teacher_logits(teacher_model, replay.batch.layout))

    held_out = distillation_batch(student, EVAL.tokens, EVAL.valid, jax.random.key(3))  # fixed views
    kl = lambda model: float(opd_objective(model, held_out, config=OPDConfig()).loss.compute())  # noqa: E731
    before, accuracy_before = kl(student), _accuracy(student)
    for step in range(60):
        batch = next(prompts)
        state, _ = trainer.step(state, distillation_batch(state.model, batch.tokens, batch.valid,
                                                         jax.random.key(100 + step)))
    assert kl(state.model) < 0.7 * before, (before, kl(state.model))
    assert _accuracy(state.model) > accuracy_before + 0.1, (accuracy_before, _accuracy(state.model))

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
