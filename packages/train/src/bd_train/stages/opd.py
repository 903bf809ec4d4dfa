"""Stage 2: on-policy distillation. The student samples with an exact trace; its replayed views
are scored by the frozen teacher, and the student minimizes forward KL(teacher ‖ student) there.

Both checkpoints are checked against the config's identity before anything trains. On a mesh,
the replay and the teacher's scoring stay on the mesh: nothing is gathered to one host. The guard
(`[opd] guard`, `_guard`) compares teacher and student on the held-out problems before training,
and the student with its start at every checkpoint and at the end; with "keep-best" the result
hands on the start (`StageResult.kept`) when OPD ended worse than it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from bd_core import DistillationBatch
from bd_models import batch_sharding

from .._opd import OPDConfig, make_opd_loss, teacher_head
from .._optim import make_optimizer
from .._replay import build_replay, replay_capacity
from .._trainer import Trainer, TrainerConfig
from ._compat import saved_model_config, teacher_pins
from ._driver import StageResult, StageSpec, drive, mesh_scope, under_run_precision
from ._evaluate import eval_examples, evaluate
from ._guard import Guard, comparable
from ._rollout import on_mesh, roll_out
from ._run import Run, RunDir

OPD_CURVES = ("loss", "kl", "teacher_agreement", "nfe_per_token")


@eqx.filter_jit
def _teacher_features(teacher, layout):
    return teacher.features(layout)


def _teacher_forward(teacher: Any, mesh: Any) -> Callable[[Any], Any]:
    """The frozen teacher's final hidden states of a replay batch's views, one program compiled
    once; on a mesh their rows are placed like the batch's. OPD's loss computes the teacher's logits
    from them with `teacher_head`, a chunk of positions at a time, so they are never held whole."""
    if mesh is None:
        return functools.partial(_teacher_features, teacher)
    params, static = eqx.partition(teacher, eqx.is_array)
    program = jax.jit(lambda p, layout: eqx.combine(p, static).features(layout),
                      out_shardings=batch_sharding(mesh))
    return lambda layout: program(params, layout)


@under_run_precision
def run_opd(config: Any, where: RunDir, *, teacher: StageResult, student: StageResult,
            fail_after: int | None = None) -> StageResult:
    """On-policy distillation: the student samples, every denoising step is replayed, and the student minimizes
    KL(teacher ‖ student) at the masked positions; returns the checkpoint, identity, history and eval.

    Args:
        config: the run config (`PipelineConfig`, or the plain form `parse_pipeline_config` returns).
        where: the run's folders.
        teacher: the teacher's SFT result (frozen here).
        student: the student's SFT result (trained on from `student.handed_on`).
        fail_after: tests only: raise `SimulatedFailure` once this step is saved.

    Returns:
        The stage's `StageResult`."""
    student = student.handed_on
    run = Run(config, where)
    run.enable_compilation_cache()
    section = run.config.opd
    teacher_config = saved_model_config(run, teacher.fingerprint, "teacher")
    mesh = run.mesh(run.model_config("student"), teacher_config,
                    batch_size=section.prompts_per_step // section.microbatches, roles=("student", "teacher"))
    teacher_model = run.restore_model(teacher.checkpoint_dir, teacher_config, teacher.fingerprint,
                                      what="teacher checkpoint", mesh=mesh)
    identity = run.identity("student")
    model = run.restore_model(student.checkpoint_dir, run.model_config("student"), identity,
                              what="student SFT checkpoint", mesh=mesh)
    keys = run.keys("opd", "train", "rollout", "eval")
    n = len(eval_examples(run))
    if not comparable(student.evaluation, n):  # e.g. a result from before per-problem rewards were kept
        with mesh_scope(mesh):
            start = evaluate(model, run, key=keys["eval"], title="student before OPD", mesh=mesh)
        student = dataclasses.replace(student, evaluation=start)
    guard = Guard(section.guard, student.evaluation,  # pyright: ignore[reportArgumentType]  (comparable: not None)
                  teacher.evaluation if comparable(teacher.evaluation, n) else None)
    guard.before()
    lora = run.lora("student", "opd")
    adapters = run.adapters_pin(model, lora, {"checkpoint": student.checkpoint_dir})
    if lora is not None:  # the SFT student is frozen; fresh adapters train
        model = run.adapt(model, lora, "opd")
    sampler = run.sampler_config(section.sampler)
    loss_fn = make_opd_loss(OPDConfig(temperature=section.kl_temperature, hard_ce_weight=section.hard_ce_weight,
                                      positions=section.positions, mask_id=run.tokenizer.mask_id))
    optimizer = run.optimizer_config(section.optim, section.steps)
    trainer = Trainer(loss_fn, make_optimizer(optimizer),
                      TrainerConfig(microbatches=section.microbatches, donate=True))
    state = trainer.init(model, key=keys["train"])
    prompts = run.prompts("opd", section.prompts_per_step)
    teacher_forward, head = _teacher_forward(teacher_model, mesh), teacher_head(teacher_model)

    def step_fn(state, step):
        batch = next(prompts)
        out = roll_out(state.model, (batch.tokens, batch.valid), batch.examples, sampler, tokenizer=run.tokenizer,
                       reward=run.reward, key=jax.random.fold_in(keys["rollout"], step), mesh=mesh)
        replay = build_replay(out.rollout, mask_id=run.tokenizer.mask_id, num_views=replay_capacity(sampler))
        features = teacher_forward(replay.batch.layout)
        batch = DistillationBatch(on_mesh(replay.batch, mesh), teacher_features=features, teacher_head=head)
        state, metrics = trainer.step(state, batch)
        return state, {**metrics, **out.metrics()}

    pinned = {"identity": identity, **teacher_pins(teacher), "training": run.training("opd"), **adapters}
    spec = StageSpec("opd", "student", "OPD", section.steps, pinned, optimizer.learning_rate_schedule(), OPD_CURVES,
                     keys["eval"], mesh, start=student, guard=guard)
    return drive(run, spec, state, step_fn, prompts, fail_after=fail_after)
