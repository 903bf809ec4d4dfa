"""Stage 3: GRPO on the task's verifiable reward. Each step samples G completions per prompt with
an exact trace, scores them, and takes `updates_per_rollout` clipped-ratio updates on the packed
replay; the recorded log-probs are the old policy, so the first update's ratio is exactly 1.

On a mesh, rollouts are sampled with the rows split over the data axes (across processes too);
only the completions are gathered, so that every process scores every row's reward the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import numpy as np
from bd_data import iterate, prompt_dataset
from bd_models import decode_completions, sample, to_host

from ._grpo import GRPOBatch, GRPOConfig, compute_advantages, distribution_score, make_grpo_loss
from ._optim import make_optimizer
from ._pipeline_config import pipeline_config
from ._replay import build_replay
from ._scoring import token_logprobs
from ._stage_opd import replay_capacity
from ._stage_report import run_stage
from ._stage_run import GLOBAL_BATCH, on_mesh, restore_model, training_mesh
from ._stage_setup import PipelineContext, Setup, StageResult
from ._trainer import Trainer

GRPO_CURVES = ("reward_mean", "accuracy", "loss", "clip_fraction", "kl", "entropy")


@eqx.filter_jit
def _reference_logprobs(model, batch, distribution):
    return token_logprobs(model, batch, **distribution)[0]


def run_grpo(config: Any, context: PipelineContext, *, start: StageResult) -> StageResult:
    setup = Setup(pipeline_config(config))
    context.enable_compilation_cache()
    cfg, tok = setup.config, setup.tokenizer
    section, stage = cfg.grpo, "grpo"
    identity = setup.identity("student")
    mesh = training_mesh(setup, setup.model_config("student"), section.prompts_per_step * section.group_size)
    model = restore_model(start.checkpoint_dir, setup.model_config("student"), identity,
                          what="student checkpoint after OPD", mesh=mesh)
    # the frozen reference of the KL term (arrays are immutable: training builds new ones)
    reference = model if section.beta > 0 else None
    sampler = setup.sampler_config(section.sampler)
    distribution = sampler.distribution_kwargs()
    views, group = replay_capacity(sampler), section.group_size
    grpo = GRPOConfig(advantage=section.advantage, ratio=section.ratio, aggregation=section.aggregation,
                      epsilon_low=section.epsilon_low, epsilon_high=section.epsilon_high, beta=section.beta,
                      norm_length=cfg.canvas.max_new_tokens)
    updates = section.updates_per_rollout
    total = section.steps * updates
    optimizer = setup.optimizer_config(section.optim, total)
    trainer = Trainer(make_grpo_loss(grpo, distribution_score(distribution)), make_optimizer(optimizer))
    key = jax.random.fold_in(jax.random.key(cfg.run.seed), 3)
    train_key, rollout_key, eval_key = jax.random.split(key, 3)
    state = trainer.init(model, key=train_key)
    prompts = iterate(prompt_dataset(setup.source("train"), tok, cfg.canvas, seed=cfg.run.seed + 3,
                                     batch_size=section.prompts_per_step, **GLOBAL_BATCH))

    def step_fn(state, step):
        batch = next(prompts)
        tokens, valid = np.repeat(batch.tokens, group, 0), np.repeat(batch.valid, group, 0)
        rollout = sample(state.model, on_mesh((tokens, valid), mesh), sampler,
                         key=jax.random.fold_in(rollout_key, step))
        completions = to_host(dataclasses.replace(rollout, trace=None))  # the per-row arrays, gathered once
        texts = decode_completions(tok, completions, stop_ids=sampler.stop_ids)
        examples = [example for example in batch.examples for _ in range(group)]
        rewards = np.asarray([setup.reward(e, t) for e, t in zip(examples, texts)], np.float32)
        replay = build_replay(rollout, mask_id=tok.mask_id, num_views=views)
        ref_logp = _reference_logprobs(reference, replay.batch, distribution) if section.beta > 0 else None
        grpo_batch = on_mesh(GRPOBatch(replay.batch, replay.recorded_logprobs,
                                       compute_advantages(rewards, group, section.advantage), ref_logp), mesh)
        first = None
        for _ in range(updates):
            state, metrics = trainer.step(state, grpo_batch)
            first = first or metrics
        generated = completions.completion_valid.sum()
        metrics = dict(metrics, ratio_first_update=first["ratio_mean"], clip_fraction_first_update=first["clip_fraction"],
                       reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
                       accuracy=float(np.mean(rewards == 1.0)),
                       completion_length=float(np.mean([len(t) for t in texts])),
                       nfe_per_token=float(completions.nfe.sum() / max(1, generated)),
                       tokens=float(generated))
        return state, metrics

    return run_stage(setup, context, stage=stage, role="student", state=state, total=total, step_fn=step_fn,
                     identity=identity, optimizer=optimizer, data_iterator=prompts, mesh=mesh, eval_key=eval_key,
                     curves=GRPO_CURVES, title="GRPO", updates_per_step=updates,
                     fingerprints={"rollout": setup.rollout_semantics(section.sampler)})
