"""Stage 1: supervised masked-diffusion fine-tuning of the teacher or the student. Resumable,
tracked (one W&B run), evaluated on the held-out split. A role may instead adopt an existing SFT
checkpoint (`[teacher] checkpoint = ...`); SFT may also continue any stage's model (`start=`).
"""

from __future__ import annotations

from typing import Any

import jax

from bd_core import fingerprint, require_compatible

from .._optim import make_optimizer
from .._sft import sft_objective
from .._trainer import Trainer, TrainerConfig
from ._compat import SHARED_IDENTITY_KEYS, saved_identity, saved_model_config
from ._driver import StageResult, StageSpec, drive, mesh_scope, under_run_precision
from ._evaluate import evaluate
from ._rollout import on_mesh
from ._run import ROLES, Run, RunDir, StageError

SFT_CURVES = ("loss", "grad_norm")


@under_run_precision
def run_sft(config: Any, where: RunDir, *, role: str, start: StageResult | None = None,
            fail_after: int | None = None) -> StageResult:
    """Train (or adopt) the `role` model; returns its checkpoint, identity, history and eval. With
    `start`, train on from that stage's model (fresh optimizer), its folder pinned in the checkpoints.
    `fail_after` is for tests only: it raises `SimulatedFailure` once that step is saved.

    Example:
        ```py
        from bd_train.stages import RunDir, parse_pipeline_config, run_grpo, run_opd, run_sft

        config = parse_pipeline_config(open("flows/configs/smoke.toml").read())
        where = RunDir.create(config, run_id="by-hand")
        teacher = run_sft(config, where, role="teacher")
        student = run_sft(config, where, role="student")
        grpo = run_grpo(config, where, start=run_opd(config, where, teacher=teacher, student=student))
        print(grpo.evaluation.metrics())
        ```
    """
    if role not in ROLES:
        raise StageError(f"run_sft: role must be one of {ROLES}, got {role!r}")
    run = Run(config, where)
    run.enable_compilation_cache()
    cfg, stage = run.config, f"sft-{role}"
    if getattr(cfg, role).checkpoint and start is None:
        return adopt(run, role)
    start = None if start is None else start.handed_on
    steps = cfg.sft.steps_for(role)
    keys = run.keys(stage, "init", "eval")
    model_config = run.model_config(role)
    mesh = run.mesh(model_config, batch_size=cfg.sft.batch_size // cfg.sft.microbatches, roles=(role,))
    optimizer = run.optimizer_config(cfg.sft.optim, steps)
    trainer = Trainer(sft_objective, make_optimizer(optimizer),
                      TrainerConfig(microbatches=cfg.sft.microbatches, donate=True))
    state = run.initial_state(role, model_config, trainer.optimizer, key=keys["init"], mesh=mesh,
                              start=None if start is None else (start.stage, start.checkpoint_dir))
    data = run.sft_batches(stage)

    def step_fn(state, step):
        batch = next(data)
        state, metrics = trainer.step(state, on_mesh(batch, mesh))
        return state, dict(metrics, tokens=float(batch.denom_weights.sum()))

    pinned = {"identity": run.identity(role), "training": run.training(stage),
              **run.adapters_pin(state.model, run.lora(role, "sft"),
                                 {"pretrained": role} if start is None else {"checkpoint": start.checkpoint_dir}),
              **({} if start is None else {"start": fingerprint({"checkpoint": start.checkpoint_dir})})}
    spec = StageSpec(stage, role, "SFT", steps, pinned, optimizer.learning_rate_schedule(), SFT_CURVES, keys["eval"],
                     mesh, start=start)
    return drive(run, spec, state, step_fn, data, fail_after=fail_after)


def adopt(run: Run, role: str) -> StageResult:
    """Use a finished SFT checkpoint. Its architecture is whatever it was trained with; if its tokens
    or blocks differ from this config it is still handed on, for the join to refuse by name."""
    cfg = run.config
    directory = getattr(cfg, role).checkpoint
    identity = saved_identity(directory)
    result = StageResult(stage=f"sft-{role}", role=role, checkpoint_dir=str(directory), step=-1,
                         identity=identity.to_json(), history=[], evaluation=None)
    try:
        require_compatible(identity, run.identity(role), SHARED_IDENTITY_KEYS)
    except ValueError:
        return result
    model_config = saved_model_config(run, identity, role)
    mesh = run.mesh(model_config, batch_size=cfg.sft.batch_size // cfg.sft.microbatches, roles=(role,))
    model = run.restore_model(directory, model_config, identity, what=f"{role} checkpoint", mesh=mesh)
    with mesh_scope(mesh):
        result.evaluation = evaluate(model, run, key=jax.random.key(cfg.run.seed), title=f"{role} (adopted)",
                                     mesh=mesh)
    return result
