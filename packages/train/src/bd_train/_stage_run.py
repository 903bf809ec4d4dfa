"""The machinery every stage shares: restoring a model from the checkpoint a stage starts from
(fingerprint first, fail closed), tracking, and the resumable step loop with periodic saves,
SIGTERM handling and progress.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
from bd_core import Fingerprint, FingerprintMismatch
from bd_models import (BlockDiffusionLM, MeshError, ModelConfig, check_divisibility, init_sharded, make_mesh,
                       shard_batch)

from ._checkpoint import Checkpointer, CheckpointError
from ._loop import run_updates
from ._optim import OptimizerConfig, make_optimizer
from ._stage_setup import PipelineContext, Setup, StageError, progress
from ._tracking import Tracker
from ._trainer import Trainer, TrainState

# Testing hook: "<stage>:<step>" makes that stage fail right after saving that step, as a crash
# would, so that `resume` can be exercised on a real run. Only fires in a run that started earlier.
FAULT_ENV = "BDLM_FAIL_AFTER"


def open_checkpoints(directory: str | Path, *, create: bool, max_to_keep: int | None = 2) -> Checkpointer:
    try:
        return Checkpointer(directory, max_to_keep=max_to_keep, create=create)
    except CheckpointError as err:
        raise StageError(str(err)) from None


def fresh_state(model_config: ModelConfig, optimizer: OptimizerConfig, *, key: jax.Array,
                mesh: jax.sharding.Mesh | None = None) -> tuple[Trainer, TrainState]:
    """A train state of the architecture (the restore target, or a from-scratch start); with a
    mesh, the model is built straight into its shards, and so is the optimizer state."""
    model_key, train_key = jax.random.split(key)
    trainer = Trainer(lambda m, b, k: 0.0, make_optimizer(optimizer))
    make = lambda: BlockDiffusionLM(model_config, key=model_key)  # noqa: E731
    return trainer, trainer.init(make() if mesh is None else init_sharded(make, mesh), key=train_key)


def training_mesh(setup: Setup, model_config: ModelConfig, batch_size: int) -> jax.sharding.Mesh | None:
    """The config's mesh over every process's devices, checked against the model and the
    (micro)batch; None on a single device, where nothing is placed."""
    section = setup.config.mesh
    if section.devices == 1:
        return None
    if section.devices != jax.device_count():
        raise StageError(f"mesh: data*fsdp*model = {section.devices} but this run has {jax.device_count()} "
                         f"devices over {jax.process_count()} process(es); match the mesh to the devices")
    mesh = make_mesh(section.data, section.fsdp, section.model)
    try:
        check_divisibility(model_config, mesh, batch_size)
    except MeshError as err:
        raise StageError(f"mesh: {err}") from None
    return mesh


# The stages' data pipelines build the whole global batch on every process (one shard of one): a
# step's batch then depends on the seed alone, not on how many processes run, and `on_mesh` keeps
# each process's rows. Tokenizing and masking a batch of task examples costs next to nothing
# beside a step; a corpus-scale pipeline shards by process and uses
# `shard_batch(..., process_local=True)` instead.
GLOBAL_BATCH = {"shard_index": 0, "shard_count": 1}


def on_mesh(batch: Any, mesh: jax.sharding.Mesh | None) -> Any:
    """A batch (training data, or prompts to sample from) placed over the mesh's data axes
    (unchanged without a mesh). Every process passes the same global batch; arrays computed on the
    mesh (rollouts, replays, teacher logits) are resharded as they are."""
    return batch if mesh is None else shard_batch(batch, mesh)


def mesh_scope(mesh: jax.sharding.Mesh | None):
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def restore_model(directory: str | Path, model_config: ModelConfig, identity: Fingerprint, *, what: str,
                  mesh: jax.sharding.Mesh | None = None) -> Any:
    """The model saved in `directory` (its latest step), after checking its identity fingerprint
    and tree against the current config; any mismatch refuses with every differing field named.
    With a mesh, it is restored straight into its shards."""
    checkpoints = open_checkpoints(directory, create=False)
    _, target = fresh_state(model_config, OptimizerConfig(), key=jax.random.key(0), mesh=mesh)
    try:
        state = checkpoints.restore(target, fingerprints={"identity": identity})
    except (FingerprintMismatch, CheckpointError) as err:
        raise StageError(f"{what}: {err}") from None
    finally:
        checkpoints.close()
    return state.model


def saved_identity(directory: str | Path) -> Fingerprint:
    checkpoints = open_checkpoints(directory, create=False)
    try:
        fingerprints = checkpoints.fingerprints()
    except CheckpointError as err:
        raise StageError(str(err)) from None
    finally:
        checkpoints.close()
    if "identity" not in fingerprints:
        raise StageError(f"checkpoint {directory} records no model identity; it was not written by a bdlm stage")
    return fingerprints["identity"]


def open_tracker(setup: Setup, context: PipelineContext, stage: str) -> Tracker:
    cfg = setup.config
    return Tracker(root=context.wandb_dir, project=cfg.run.project, stage=stage, group=context.run_id,
                   config=cfg.to_dict(), mode="disabled" if jax.process_index() else None)


class StageLoop:
    """Runs `step_fn(state, step) -> (state, metrics)` until `total` updates (through
    `run_updates`, the loop `train_loop` also uses), resuming from the latest checkpoint in
    `directory`, saving every `every` updates and on SIGTERM (then refusing to go on, so the
    orchestrator can `resume`), logging to the tracker and a progress bar."""

    def __init__(self, *, name: str, directory: Path, fingerprints: Mapping[str, Fingerprint], config: Any,
                 every: int, max_to_keep: int, log_every: int, tracker: Tracker | None, data_iterator: Any = None,
                 learning_rate: Callable[[int], Any] | None = None):
        self.name, self.directory, self.fingerprints, self.config = name, directory, dict(fingerprints), config
        self.learning_rate = learning_rate
        self.every, self.log_every, self.tracker, self.data_iterator = every, log_every, tracker, data_iterator
        self.checkpoints = open_checkpoints(directory, create=True, max_to_keep=max_to_keep)
        self.history: list[dict[str, float | int]] = []

    def resume(self, state: TrainState) -> TrainState:
        """The latest saved state of this stage (a restarted or resumed run), else `state`."""
        if self.checkpoints.latest_step() is None:
            return state
        try:
            return self.checkpoints.restore(state, fingerprints=self.fingerprints, data_iterator=self.data_iterator)
        except (FingerprintMismatch, CheckpointError) as err:
            raise StageError(f"{self.name}: cannot continue from {self.directory}: {err}") from None

    def _save(self, state: TrainState) -> None:
        if int(state.step) not in self.checkpoints.all_steps():
            self.checkpoints.save(state, fingerprints=self.fingerprints, config=self.config,
                                  data_iterator=self.data_iterator, force=True)
            self.checkpoints.wait()

    def run(self, state: TrainState, total: int, step_fn: Callable[[TrainState, int], tuple[TrainState, dict]],
            *, updates_per_step: int = 1) -> TrainState:
        start = int(state.step)
        fault = os.environ.get(FAULT_ENV, "")
        fault_step = int(fault.split(":")[1]) if fault.startswith(f"{self.name}:") else None
        bar = progress(total=(total - start) // updates_per_step, description=self.name)

        def on_update(state: TrainState, metrics: dict) -> None:
            step = int(state.step)
            row = {"step": step, **{k: float(v) for k, v in jax.device_get(metrics).items()}}
            if self.learning_rate is not None:
                row["learning_rate"] = float(self.learning_rate(step - 1))
            if "tokens" in row:
                row["tokens_total"] = row["tokens"] + (self.history[-1]["tokens_total"] if self.history else 0.0)
            skipped = updates_per_step * (1.0 - row.get("update_applied", 1.0))
            row["skipped_total"] = skipped + (self.history[-1]["skipped_total"] if self.history else 0.0)
            self.history.append(row)
            if self.tracker is not None and (step % self.log_every == 0 or step >= total):
                self.tracker.log(row, step=step)
            bar.set_postfix({k: f"{row[k]:.3g}" for k in ("loss", "reward_mean") if k in row}, refresh=False)
            bar.update(1)
            if fault_step is not None and start < fault_step <= step:
                self._save(state)
                raise RuntimeError(f"{self.name}: simulated failure after step {step} ({FAULT_ENV}={fault})")

        try:
            state, preempted = run_updates(state, total, lambda s: step_fn(s, int(s.step)),
                                           save=lambda s, final: self._save(s), on_update=on_update,
                                           save_every=self.every)
        finally:
            bar.close()
        if preempted:
            raise StageError(f"{self.name}: stopped by SIGTERM at step {int(state.step)}; the checkpoint is saved in "
                             f"{self.directory}; run `resume` to continue")
        self.checkpoints.close()
        return state
