"""Stage 1: supervised masked-diffusion fine-tuning of the teacher or the student.

Resumable (continues from its latest checkpoint), tracked (one W&B run), and evaluated on the
held-out split. A role may instead adopt an existing SFT checkpoint (`[teacher] checkpoint = ...`).
"""

from __future__ import annotations

from typing import Any

import jax
from bd_core import require_compatible
from bd_data import iterate, sft_dataset
from bd_models import ModelConfig

from ._evaluate import evaluate
from ._optim import make_optimizer
from ._pipeline_config import pipeline_config
from ._sft import sft_objective
from ._stage_report import run_stage
from ._stage_run import GLOBAL_BATCH, fresh_state, mesh_scope, on_mesh, restore_model, saved_identity, training_mesh
from ._stage_setup import ROLES, SHARED_IDENTITY_KEYS, PipelineContext, Setup, StageError, StageResult
from ._trainer import Trainer, TrainerConfig

SFT_CURVES = ("loss", "grad_norm")


def run_sft(config: Any, context: PipelineContext, *, role: str) -> StageResult:
    """Train (or adopt) the `role` model; returns its checkpoint, identity, history and eval."""
    if role not in ROLES:
        raise StageError(f"run_sft: role must be one of {ROLES}, got {role!r}")
    setup = Setup(pipeline_config(config))
    context.enable_compilation_cache()
    if getattr(setup.config, role).checkpoint:
        return _adopt(setup, context, role)
    return _train(setup, context, role)


def _train(setup: Setup, context: PipelineContext, role: str) -> StageResult:
    cfg, tok = setup.config, setup.tokenizer
    steps = cfg.sft.steps_for(role)
    stage = f"sft-{role}"
    key = jax.random.fold_in(jax.random.key(cfg.run.seed), ROLES.index(role))
    init_key, eval_key = jax.random.split(key)
    identity = setup.identity(role)
    mesh = training_mesh(setup, setup.model_config(role), cfg.sft.batch_size // cfg.sft.microbatches)
    _, state = fresh_state(setup.model_config(role), setup.optimizer_config(cfg.sft.optim, steps), key=init_key,
                           mesh=mesh)
    optimizer = setup.optimizer_config(cfg.sft.optim, steps)
    trainer = Trainer(sft_objective, make_optimizer(optimizer), TrainerConfig(microbatches=cfg.sft.microbatches))
    data = iterate(sft_dataset(setup.source("train"), tok, cfg.canvas, cfg.sft.corruption,
                               seed=cfg.run.seed + ROLES.index(role), batch_size=cfg.sft.batch_size,
                               **GLOBAL_BATCH))
    def step_fn(state, step):
        batch = next(data)
        state, metrics = trainer.step(state, on_mesh(batch, mesh))
        return state, dict(metrics, tokens=float(batch.denom_weights.sum()))

    return run_stage(setup, context, stage=stage, role=role, state=state, total=steps, step_fn=step_fn,
                     identity=identity, optimizer=optimizer, data_iterator=data, mesh=mesh, eval_key=eval_key,
                     curves=SFT_CURVES, title="SFT")


def _adopt(setup: Setup, context: PipelineContext, role: str) -> StageResult:
    """Use a finished SFT checkpoint. Its architecture is whatever it was trained with; if its tokens
    or blocks differ from this config it is still handed on, for the join to refuse by name."""
    cfg = setup.config
    directory = getattr(cfg, role).checkpoint
    identity = saved_identity(directory)
    result = StageResult(stage=f"sft-{role}", role=role, checkpoint_dir=str(directory), step=-1,
                         identity=identity.to_json(), history=[], evaluation={}, samples=[])
    try:
        require_compatible(identity, setup.identity(role), SHARED_IDENTITY_KEYS)
    except ValueError:
        return result
    model_config = ModelConfig.from_dict(identity.fields["architecture"])
    mesh = training_mesh(setup, model_config, cfg.sft.batch_size // cfg.sft.microbatches)
    model = restore_model(directory, model_config, identity, what=f"{role} checkpoint", mesh=mesh)
    with mesh_scope(mesh):
        report = evaluate(model, setup, cfg.eval, key=jax.random.key(cfg.run.seed), title=f"{role} (adopted)",
                          mesh=mesh)
    result.evaluation, result.samples, result.trace_png = report["evaluation"], report["samples"], report["trace_png"]
    return result
