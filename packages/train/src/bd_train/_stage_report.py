"""How every training stage runs and reports: one W&B run, the resumable loop over `step_fn`,
then the held-out evaluation logged to W&B and packed into the stage's small `StageResult`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from bd_core import Fingerprint

from ._evaluate import evaluate
from ._optim import OptimizerConfig
from ._plots import curves_png
from ._stage_run import StageLoop, mesh_scope, open_tracker
from ._stage_setup import PipelineContext, Setup, StageResult
from ._trainer import TrainState


def run_stage(setup: Setup, context: PipelineContext, *, stage: str, role: str, state: TrainState, total: int,
              step_fn: Callable[[TrainState, int], tuple[TrainState, dict]], identity: Fingerprint,
              optimizer: OptimizerConfig, data_iterator: Any, mesh: Any, eval_key: jax.Array,
              curves: Sequence[str], title: str, updates_per_step: int = 1,
              fingerprints: Mapping[str, Fingerprint] | None = None) -> StageResult:
    """Resume from the stage's latest checkpoint, train to `total` updates, evaluate, report.
    Checkpoints pin `identity` and any further `fingerprints` (e.g. GRPO's rollout semantics)."""
    cfg = setup.config
    with open_tracker(setup, context, stage) as tracker:
        loop = StageLoop(name=stage, directory=context.checkpoint_dir(stage), fingerprints={"identity": identity, **(fingerprints or {})},
                         config=cfg.to_dict(), every=cfg.run.checkpoint_every, max_to_keep=cfg.run.max_to_keep,
                         log_every=cfg.run.log_every, tracker=tracker, data_iterator=data_iterator,
                         learning_rate=optimizer.learning_rate_schedule())
        state = loop.resume(state)
        with mesh_scope(mesh):
            state = loop.run(state, total, step_fn, updates_per_step=updates_per_step)
            report = evaluate(state.model, setup, cfg.eval, key=eval_key, title=f"{role} after {title}", mesh=mesh)
        tracker.log({f"eval/{k}": v for k, v in report["evaluation"].items()}, step=total)
        tracker.log_table("eval/samples", ["prompt", "answer", "completion", "reward"],
                          [list(s.values()) for s in report["samples"]], step=total)
        tracker.summary(report["evaluation"])
    return StageResult(stage=stage, role=role, checkpoint_dir=str(loop.directory), step=int(state.step),
                       identity=identity.to_json(), history=loop.history, evaluation=report["evaluation"],
                       samples=report["samples"], trace_png=report["trace_png"],
                       curves_png=curves_png(loop.history, curves, title=f"{title} ({role})"),
                       wandb_run_dir=str(tracker.run_dir))
