"""Rejection-sampling fine-tuning (RFT; STaR): each round samples `[rft] group_size` completions
of each prompt from the current model with GRPO's rollout machinery, keeps those the task's
verifier rewards at least `[rft] min_reward` (no reference answer is read), and takes
`updates_per_rollout` SFT updates on them, each with fresh mask corruption.

The batch keeps its shape (rejected rows weigh 0, `_rft.rft_batch`), so one program serves every
round. A round that accepts nothing still takes its updates, each with a zero denominator, which
the trainer skips: parameters and optimizer state stay as they were, the step count (and so the
learning-rate schedule) moves on, and the round logs `accepted` 0 and `update_applied` 0.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from bd_core import ConfigError, fingerprint

from .._optim import make_optimizer
from .._rft import rft_batch
from .._sft import sft_objective
from .._trainer import Trainer, TrainerConfig
from ._config import check_rows_split
from ._driver import StageResult, StageSpec, drive, under_run_precision
from ._rollout import group_rollouts, on_mesh
from ._run import Run, RunDir, StageError

RFT_CURVES = ("accepted", "reward_mean", "loss", "grad_norm")


@under_run_precision
def run_rft(config: Any, where: RunDir, *, start: StageResult, fail_after: int | None = None) -> StageResult:
    """RFT from the model `start` hands on (any student stage's result, e.g. OPD's)."""
    start = start.handed_on
    run = Run(config, where)
    run.enable_compilation_cache()
    section, cfg = run.config.rft, run.config
    identity = run.identity("student")
    try:  # RFT is no stage of the pipeline: its rows are checked against the mesh when it starts
        check_rows_split("rft.prompts_per_step", section.prompts_per_step * section.group_size, section.microbatches,
                         "prompts_per_step x group_size", cfg.mesh.data * cfg.mesh.fsdp)
    except ConfigError as err:
        raise StageError(str(err)) from None
    mesh = run.mesh(run.model_config("student"),
                    batch_size=section.prompts_per_step * section.group_size // section.microbatches)
    model = run.restore_model(start.checkpoint_dir, run.model_config("student"), identity,
                              what=f"student checkpoint after {start.stage}", mesh=mesh)
    lora = run.lora("student", "rft")
    adapters = run.adapters_pin(model, lora, {"checkpoint": start.checkpoint_dir})
    if lora is not None:
        model = run.adapt(model, lora, "rft")
    total = section.steps * section.updates_per_rollout
    optimizer = run.optimizer_config(section.optim, total)
    trainer = Trainer(sft_objective, make_optimizer(optimizer), TrainerConfig(microbatches=section.microbatches))
    keys = run.keys("rft", "train", "rollout", "eval")
    state = trainer.init(model, key=keys["train"])
    prompts = run.prompts("rft", section.prompts_per_step)
    sampler = run.sampler_config(section.sampler)

    def step_fn(state, step):
        out = group_rollouts(run, state.model, next(prompts), section.group_size, sampler,
                             key=jax.random.fold_in(keys["rollout"], step), mesh=mesh)
        accepted = out.rewards >= section.min_reward
        metrics = {}
        for update in range(section.updates_per_rollout):  # fresh masks for every update, fixed by the step
            rng = np.random.default_rng([run.data_seed("rft"), step, update])
            batch = rft_batch(out.host, accepted, canvas=cfg.canvas, corruption=section.corruption,
                              tokenizer=run.tokenizer, rng=rng)
            state, metrics = trainer.step(state, on_mesh(batch, mesh))
        return state, {**metrics, **out.metrics(), "accepted": float(accepted.mean())}

    pinned = {"identity": identity, "rollout": run.rollout_semantics(section.sampler),
              "training": run.training("rft"), "start": fingerprint({"checkpoint": start.checkpoint_dir}),
              **adapters}
    spec = StageSpec("rft", "student", "RFT", total, pinned, optimizer.learning_rate_schedule(), RFT_CURVES,
                     keys["eval"], mesh, section.updates_per_rollout, start=start)
    return drive(run, spec, state, step_fn, prompts, fail_after=fail_after)
