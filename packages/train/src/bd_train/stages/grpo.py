"""Stage 3: GRPO on the task's verifiable reward. Each step samples G completions per prompt with
an exact trace, scores them, and takes `updates_per_rollout` clipped-ratio updates on the packed
replay; the recorded log-probs are the old policy, so the first update's ratio is exactly 1.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._grpo import distribution_score, make_grpo_loss
from .._optim import make_optimizer
from .._trainer import Trainer, TrainerConfig
from ._compat import saved_weights
from ._driver import StageResult, StageSpec, drive, under_run_precision
from ._rollout import grpo_config, rollout_batch
from ._run import Run, RunDir

GRPO_CURVES = ("reward_mean", "rollout_accuracy", "loss", "clip_fraction", "kl", "entropy")


@under_run_precision
def run_grpo(config: Any, where: RunDir, *, start: StageResult, fail_after: int | None = None) -> StageResult:
    """GRPO from the student `start` (OPD's result): rollouts, group advantages and clipped updates on the exact replay
    of each trace; returns the checkpoint, identity, history and eval.

    Args:
        config: the run config (`PipelineConfig`, or the plain form `parse_pipeline_config` returns).
        where: the run's folders.
        start: the stage whose student model GRPO starts from: `start.handed_on` (OPD's model, or the one
            its guard kept).
        fail_after: tests only: raise `SimulatedFailure` once this step is saved.

    Returns:
        The stage's `StageResult`."""
    start = start.handed_on
    run = Run(config, where)
    run.enable_compilation_cache()
    section = run.config.grpo
    identity = run.identity("student")
    mesh = run.mesh(run.model_config("student"),
                    batch_size=section.prompts_per_step * section.group_size // section.microbatches)
    model = run.restore_model(start.checkpoint_dir, run.model_config("student"), identity,
                              what="student checkpoint after OPD", mesh=mesh)
    lora = run.lora("student", "grpo")
    adapters = run.adapters_pin(model, lora, {"checkpoint": start.checkpoint_dir})
    # The KL reference is the model GRPO starts from, frozen. With LoRA it is the adapted model's
    # own base (adapters off): the steps donate only what they train, so no second copy is held.
    # In full fine-tuning the steps donate (update in place) the model's arrays: the reference is
    # a copy, made once.
    reference = None
    if section.beta > 0:
        reference = model if lora is not None else jax.tree.map(
            lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, model)
    if lora is not None:
        model = run.adapt(model, lora, "grpo")
    sampler = run.sampler_config(section.sampler)
    grpo = grpo_config(run)
    total = section.steps * section.updates_per_rollout
    optimizer = run.optimizer_config(section.optim, total)
    loss = make_grpo_loss(grpo, distribution_score(sampler.distribution, kl=grpo.beta > 0))
    trainer = Trainer(loss, make_optimizer(optimizer), TrainerConfig(microbatches=section.microbatches, donate=True))
    keys = run.keys("grpo", "train", "rollout", "eval")
    state = trainer.init(model, key=keys["train"])
    prompts = run.prompts("grpo", section.prompts_per_step)

    def step_fn(state, step):
        batch, out = rollout_batch(run, state.model, next(prompts), key=jax.random.fold_in(keys["rollout"], step),
                                   mesh=mesh, reference=reference)
        state, first = trainer.step(state, batch)
        metrics = first
        for _ in range(section.updates_per_rollout - 1):
            state, metrics = trainer.step(state, batch)
        return state, {**metrics, "ratio_first_update": first["ratio_mean"],
                       "clip_fraction_first_update": first["clip_fraction"], **out.metrics()}

    spec = StageSpec("grpo", "student", "GRPO", total,
                     {"identity": identity, "rollout": run.rollout_semantics(section.sampler),
                      "training": run.training("grpo"), **adapters,
                      # the model GRPO starts from is its KL reference at every update ([opd] guard picks it)
                      "start": saved_weights(start.checkpoint_dir)},
                     optimizer.learning_rate_schedule(), GRPO_CURVES, keys["eval"], mesh, section.updates_per_rollout,
                     start=start)
    return drive(run, spec, state, step_fn, prompts, fail_after=fail_after)

