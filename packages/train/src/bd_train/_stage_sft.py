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
from ._plots import curves_png
from ._sft import sft_objective
from ._stage_run import (StageLoop, fresh_state, gathered, mesh_scope, on_mesh, open_tracker, restore_model,
                         saved_identity, training_mesh)
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
                               seed=cfg.run.seed + ROLES.index(role), batch_size=cfg.sft.batch_size))
    with open_tracker(setup, context, stage) as tracker:
        loop = StageLoop(name=stage, directory=context.checkpoint_dir(stage), fingerprints={"identity": identity},
                         config=cfg.to_dict(), every=cfg.run.checkpoint_every, max_to_keep=cfg.run.max_to_keep,
                         log_every=cfg.run.log_every, tracker=tracker, data_iterator=data,
                         learning_rate=optimizer.learning_rate_schedule())

        def step_fn(state, step):
            batch = next(data)
            state, metrics = trainer.step(state, on_mesh(batch, mesh))
            return state, dict(metrics, tokens=float(batch.denom_weights.sum()))

        state = loop.resume(state)
        with mesh_scope(mesh):
            state = loop.run(state, steps, step_fn)
        report = evaluate(gathered(state.model), setup, cfg.eval, key=eval_key, title=f"{role} after SFT")
        tracker.log({f"eval/{k}": v for k, v in report["evaluation"].items()}, step=steps)
        tracker.log_table("eval/samples", ["prompt", "answer", "completion", "reward"],
                          [list(s.values()) for s in report["samples"]], step=steps)
        tracker.summary(report["evaluation"])
    return StageResult(stage=stage, role=role, checkpoint_dir=str(loop.directory), step=int(state.step),
                       identity=identity.to_json(), history=loop.history, evaluation=report["evaluation"],
                       samples=report["samples"], trace_png=report["trace_png"],
                       curves_png=curves_png(loop.history, SFT_CURVES, title=f"SFT {role}"),
                       wandb_run_dir=str(tracker.run_dir))


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
    model = restore_model(directory, model_config, identity, what=f"{role} checkpoint")
    report = evaluate(model, setup, cfg.eval, key=jax.random.key(cfg.run.seed), title=f"{role} (adopted)")
    result.evaluation, result.samples, result.trace_png = report["evaluation"], report["samples"], report["trace_png"]
    return result
