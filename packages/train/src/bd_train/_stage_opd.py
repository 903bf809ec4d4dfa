"""Stage 2: on-policy distillation. The student samples with an exact trace; its replayed views
are scored by the frozen teacher, and the student minimizes forward KL(teacher ‖ student) there.

Both checkpoints are checked against the config's identity before anything trains. On a mesh,
rollouts are sampled with the prompts split over the data axes (across processes too), and the
replay and teacher scoring stay on the mesh: nothing is gathered to one host.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
from bd_core import DistillationBatch
from bd_data import iterate, prompt_dataset
from bd_models import ModelConfig, sample, to_host

from ._opd import OPDConfig, make_opd_loss
from ._optim import make_optimizer
from ._pipeline_config import pipeline_config
from ._replay import build_replay
from ._stage_report import run_stage
from ._stage_run import GLOBAL_BATCH, on_mesh, restore_model, training_mesh
from ._stage_setup import PipelineContext, Setup, StageResult
from ._trainer import Trainer

OPD_CURVES = ("loss", "kl", "teacher_agreement", "nfe_per_token")


@eqx.filter_jit
def _teacher_logits(teacher, layout):
    return teacher(layout)


def replay_capacity(sampler) -> int:
    """Replay views that hold every step a rollout can take: one fixed shape, one compilation."""
    return sampler.num_blocks * sampler.steps_cap


def run_opd(config: Any, context: PipelineContext, *, teacher: StageResult, student: StageResult) -> StageResult:
    setup = Setup(pipeline_config(config))
    context.enable_compilation_cache()
    cfg, tok = setup.config, setup.tokenizer
    section, stage = cfg.opd, "opd"
    teacher_config = ModelConfig.from_dict(teacher.fingerprint.fields["architecture"])
    mesh = training_mesh(setup, setup.model_config("student"), section.prompts_per_step)
    if mesh is not None:  # the frozen teacher scores the replay on the same mesh
        training_mesh(setup, teacher_config, section.prompts_per_step)
    teacher_model = restore_model(teacher.checkpoint_dir, teacher_config, teacher.fingerprint,
                                  what="teacher checkpoint", mesh=mesh)
    identity = setup.identity("student")
    student_model = restore_model(student.checkpoint_dir, setup.model_config("student"), identity,
                                  what="student SFT checkpoint", mesh=mesh)
    sampler = setup.sampler_config(section.sampler)
    views = replay_capacity(sampler)
    loss_fn = make_opd_loss(OPDConfig(temperature=section.kl_temperature, hard_ce_weight=section.hard_ce_weight,
                                      positions=section.positions, mask_id=tok.mask_id))
    optimizer = setup.optimizer_config(section.optim, section.steps)
    trainer = Trainer(loss_fn, make_optimizer(optimizer))
    key = jax.random.fold_in(jax.random.key(cfg.run.seed), 2)
    train_key, rollout_key, eval_key = jax.random.split(key, 3)
    state = trainer.init(student_model, key=train_key)
    prompts = iterate(prompt_dataset(setup.source("train"), tok, cfg.canvas, seed=cfg.run.seed + 2,
                                     batch_size=section.prompts_per_step, **GLOBAL_BATCH))

    def step_fn(state, step):
        batch = next(prompts)
        rollout = sample(state.model, on_mesh((batch.tokens, batch.valid), mesh), sampler,
                         key=jax.random.fold_in(rollout_key, step))
        replay = build_replay(rollout, mask_id=tok.mask_id, num_views=views)
        logits = _teacher_logits(teacher_model, replay.batch.layout)
        state, metrics = trainer.step(state, on_mesh(DistillationBatch(replay.batch, logits), mesh))
        completion_valid, nfe = to_host((rollout.completion_valid, rollout.nfe))
        generated = completion_valid.sum()
        metrics["nfe_per_token"] = float(nfe.sum() / max(1, generated))
        metrics["tokens"] = float(generated)
        return state, metrics

    return run_stage(setup, context, stage=stage, role="student", state=state, total=section.steps,
                     step_fn=step_fn, identity=identity, optimizer=optimizer, data_iterator=prompts, mesh=mesh,
                     eval_key=eval_key, curves=OPD_CURVES, title="OPD")
