"""The one driver every stage recipe calls: `drive(run, spec, state, step_fn, data)` resumes the
stage from its latest checkpoint, runs `step_fn` to `spec.total` updates with periodic saves,
SIGTERM handling, the group's progress watchdog, W&B tracking and a progress bar, evaluates on
the held-out split (greedy, pass@k and accuracy vs NFE, as `[eval]` asks) with the paired
change over the model the stage started from, and returns the stage's small `StageResult`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from bd_core import Fingerprint, FingerprintMismatch, fingerprint
from bd_models import count_params, merge, weights_digest

from .._checkpoint import CheckpointError
from .._loop import run_updates
from .._optim import applied_updates
from .._watchdog import StallPolicy, watch_progress
from ._config import under_run_precision as under_run_precision  # the stages' decorator
from ._evaluate import Evaluation, eval_examples, evaluate, evaluate_report
from ._guard import Guard
from ._intervals import gain_intervals
from ._memory import MemoryLog
from ._plots import curves_png
from ._run import Run, StageError, committed, open_checkpoints
from ._tracking import Tracker

if TYPE_CHECKING:
    from .._trainer import TrainState

StepFn = Callable[["TrainState", int], "tuple[TrainState, dict]"]

# Identity fields that set the shapes of a model's arrays: no `[run] allow_changes` continues a
# checkpoint across one of them (its restore would find arrays of other shapes).
SHAPE_FIELDS = frozenset({"identity.vocab_size"} | {f"identity.architecture.{k}" for k in (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "head_dim", "tie_embeddings", "qk_norm",
    "qkv_bias")})
TRAIN_ANEW = "to train anew, give the run another id (--run-id) or [run] output_dir."


def _cannot_continue(shaped: list[str]) -> str:
    return (f"{', '.join(shaped)} set the shapes of the saved arrays, so no [run] allow_changes can continue this "
            f"checkpoint under the change; {TRAIN_ANEW}")


@dataclasses.dataclass(frozen=True, eq=False)
class StageSpec:
    """What a recipe hands the driver. `name` names the checkpoint folder, the W&B job type and
    the progress bar; every checkpoint pins `fingerprints`; `updates_per_step` is how many updates
    one `step_fn` call takes (GRPO's updates per rollout). `start` is the result of the stage
    whose model this one starts from (its evaluation is the baseline of the paired change);
    `guard` (OPD's) compares the model at every periodic checkpoint and at the end.

    Attributes:
        name: the stage's name: its checkpoint folder, W&B job type and progress bar.
        role: `teacher` or `student`.
        title: how tables and plots name the stage.
        total: the updates to train to.
        fingerprints: what every checkpoint of the stage pins, by name.
        learning_rate: the learning rate at a step (for the logs).
        curves: the metrics the card plots.
        eval_key: the key of the held-out evaluation.
        mesh: the mesh the stage runs on, or None.
        updates_per_step: updates one `step_fn` call takes.
        start: the result this stage starts from (the baseline of its paired gain), or None.
        guard: OPD's guard, or None.
    """

    name: str
    role: str
    title: str
    total: int
    fingerprints: Mapping[str, Fingerprint]
    learning_rate: Callable[[int], Any]
    curves: tuple[str, ...]
    eval_key: jax.Array
    mesh: jax.sharding.Mesh | None = None
    updates_per_step: int = 1
    start: StageResult | None = None
    guard: Guard | None = None


@dataclasses.dataclass
class StageResult:
    """What a stage hands to the next one and to the summary: small values only.

    Attributes:
        stage: the stage's name (`sft-teacher`, `sft-student`, `opd`, `grpo`).
        role: `teacher` or `student`.
        checkpoint_dir: the stage's checkpoint folder.
        step: the last step saved.
        identity: the model identity fingerprint, as JSON.
        history: the logged metric rows.
        evaluation: the held-out evaluation.
        curves_png: the training curves as a PNG.
        wandb_run_dir: the stage's W&B run folder.
        export_dir: the Hugging Face export (`[run] export = true`).
        params: `{"trained": ..., "total": ...}` parameter counts.
        seconds: wall-clock of `updates`, `train`, `first` (compiling) and `eval`.
        memory: the accelerator's memory at the stage's phases (None on a CPU).
        gain: the evaluation's paired change over the model the stage started from.
        guard: OPD's guard, its comparisons and decision.
        kept: the earlier stage's result handed on instead of this one (OPD's keep-best guard).
    """

    stage: str
    role: str
    checkpoint_dir: str
    step: int
    identity: dict[str, Any]
    history: list[dict[str, float | int]]
    evaluation: Evaluation | None
    curves_png: bytes | None = None
    wandb_run_dir: str | None = None
    export_dir: str | None = None  # the Hugging Face export (`[run] export = true`)
    params: dict[str, int] | None = None  # {"trained": ..., "total": ...}: LoRA trains a fraction
    # Wall-clock of this call: `updates` taken, `train` (all of them, saves included), `first`
    # (the first, which compiles) and `eval` seconds; `(train - first) / (updates - 1)` is the
    # compiled update's time.
    seconds: dict[str, float] | None = None
    # The accelerator's memory at the stage's phases (`state`, `first update`, `trained`, `merged`,
    # `evaluated`): `{phase: {"in_use_gib", "peak_gib"}}`, and on a TPU `"reserved_peak_gib"` (peaks
    # are the process's so far: `_memory`); None where the backend keeps no statistics.
    memory: dict[str, dict[str, float]] | None = None
    # The evaluation's paired change over the model the stage started from: {"over": its stage,
    # "metrics": {"accuracy": Interval.to_dict(), "mean_reward": ..., "pass@k": ...}}.
    gain: dict[str, Any] | None = None
    guard: dict[str, Any] | None = None  # OPD's guard: its comparisons and decision (`Guard.record`)
    # The earlier stage's result whose model the next stage starts from instead of this one's
    # (OPD's guard in "keep-best" mode, when OPD ended worse than its start).
    kept: StageResult | None = None

    @property
    def fingerprint(self) -> Fingerprint:
        return Fingerprint.from_json(self.identity)

    @property
    def handed_on(self) -> StageResult:
        """The result whose checkpoint the next stage starts from: this one, or the one it kept."""
        return self if self.kept is None else self.kept.handed_on


class SimulatedFailure(RuntimeError):
    """Raised on purpose after a saved step (`fail_after`), so that `resume` can be tested."""


def mesh_scope(mesh: jax.sharding.Mesh | None):
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _as_saved(pins: dict[str, Fingerprint], saved: Mapping[str, Fingerprint], model: Any) -> dict[str, Fingerprint]:
    """`pins` with a LoRA stage's `adapters` pin in the form its checkpoint saved it: bdlm pinned a
    base that is another LoRA stage's checkpoint by the merged model's bits before it pinned it
    by that checkpoint's content (`adapted_checkpoint_digest`); such a checkpoint resumes, on the
    layout that made it, when those bits are the same (`weights_digest` of the base)."""
    ours, theirs = pins.get("adapters"), saved.get("adapters")
    if ours is None or theirs is None:
        return pins
    mine, old = ours.fields.get("base_digest"), theirs.fields.get("base_digest")
    if not (isinstance(mine, str) and mine.startswith("saved:") and isinstance(old, str) and ":" not in old):
        return pins
    if weights_digest(model) != old:
        return pins
    return {**pins, "adapters": fingerprint({**ours.fields, "base_digest": old})}


def drive(run: Run, spec: StageSpec, state: TrainState, step_fn: StepFn, data: Any = None, *,
          fail_after: int | None = None) -> StageResult:
    """Train `state` with `step_fn(state, step) -> (state, metrics)` to `spec.total` updates,
    continuing from the stage's latest checkpoint (which must match `spec.fingerprints`), then
    evaluate. `data` is the data iterator whose position checkpoints keep. `fail_after` (tests)
    raises `SimulatedFailure` right after the update that reaches that step is saved, in a run
    that started before it."""
    cfg = run.config
    guard = spec.guard
    if spec.mesh is None:  # one program per shape: a state of restored (committed) and fresh arrays would
        state = committed(state)  # give way to an all-committed one after the first update, and compile again
    directory = run.where.checkpoint_dir(spec.name)
    checkpoints = open_checkpoints(directory, create=True, max_to_keep=cfg.run.max_to_keep,
                                   async_save=cfg.run.async_checkpoints)
    history: list[dict[str, float | int]] = []
    overrides: list[dict[str, Any]] = []
    pins = dict(spec.fingerprints)
    if checkpoints.latest_step() is not None:  # a resumed stage continues its state and its curves
        try:
            allow = cfg.run.allow_changes
            pins = _as_saved(pins, checkpoints.fingerprints(), state.model)
            accepted = checkpoints.check_fingerprints(pins, allow=allow)
            if shaped := sorted(k for k in accepted if k in SHAPE_FIELDS):
                changes = "; ".join(f"{k}: saved {accepted[k][0]!r}, current {accepted[k][1]!r}" for k in shaped)
                raise StageError(f"{spec.name}: cannot continue from {directory}: {changes}\n"
                                 f"{_cannot_continue(shaped)}")
            state = checkpoints.restore(state, fingerprints=pins, data_iterator=data, allow=allow)
            meta = checkpoints.read_meta()
            history, overrides = list(meta.get("history") or []), list(meta.get("overrides") or [])
        except FingerprintMismatch as err:
            if shaped := sorted(k for k in err.differences if k in SHAPE_FIELDS):
                raise StageError(f"{spec.name}: cannot continue from {directory}: {err}\n"
                                 f"{_cannot_continue(shaped)}") from None
            fields = ", ".join(f'"{k}"' for k in sorted(err.differences))
            raise StageError(f"{spec.name}: cannot continue from {directory}: {err}\nTo continue with the change "
                             f"on purpose, add it to [run] allow_changes = [{fields}]; {TRAIN_ANEW}") from None
        except CheckpointError as err:
            raise StageError(f"{spec.name}: cannot continue from {directory}: {err}") from None
        if guard is not None:  # its comparisons so far, judged again: a resumed run decides the same
            guard.restore(list((meta.get("extra") or {}).get("guard") or []))
        if accepted:  # deliberate, named in [run] allow_changes: said now and kept in every later checkpoint
            overrides.append({"step": int(state.step), "changes": {k: list(v) for k, v in sorted(accepted.items())}})
            print(f"{spec.name}: continuing from step {int(state.step)} with changed settings ([run] allow_changes): "
                  + ", ".join(f"{k} {saved!r} -> {now!r}" for k, (saved, now) in sorted(accepted.items())),
                  file=sys.stderr)
    start = int(state.step)
    memory = MemoryLog()
    memory.mark("state", state)

    def save(state: TrainState, final: bool = True) -> None:
        # A periodic save returns while it is written ([run] async_checkpoints); a final one (the
        # stage's end, SIGTERM, a simulated failure) returns once it is committed.
        if final:
            checkpoints.wait()  # the periodic save of this very step may still be in flight
        if int(state.step) not in checkpoints.all_steps():
            checkpoints.save(state, fingerprints=pins, config=cfg.to_dict(), data_iterator=data,
                             force=True, history=history, overrides=overrides,
                             extra={"stage": spec.name, **({} if guard is None else {"guard": guard.points})})
        if final:
            checkpoints.wait()

    with tracker_for(run, spec.name) as tracker:
        bar = None  # made after the first update, which compiles: its time would skew the bar's rate and ETA
        begun = time.perf_counter()
        seconds = {"updates": 0.0, "train": 0.0, "first": 0.0, "eval": 0.0}
        mark: Callable[[str, int], None] | None = None  # the watchdog's, once it watches
        every = cfg.run.checkpoint_every

        def on_update(state: TrainState, metrics: dict) -> None:
            nonlocal bar
            step = int(state.step)
            row = {"step": step, **{k: float(v) for k, v in jax.device_get(metrics).items()}}
            # The schedule follows the updates applied (a skipped one does not advance it): the
            # rate of the latest applied update, and every update of the stage that was skipped.
            count = applied_updates(state.opt_state)
            applied = step if count is None else int(count)
            row["learning_rate"] = float(spec.learning_rate(max(applied - 1, 0)))
            previous = history[-1] if history else {}
            if "tokens" in row:
                row["tokens_total"] = row["tokens"] + previous.get("tokens_total", 0.0)
            row["skipped_total"] = float(step - applied)
            history.append(row)
            log_every = cfg.run.log_every  # every `log_every` updates, however many a step makes
            if step // log_every > (step - spec.updates_per_step) // log_every or step >= spec.total:
                tracker.log(row, step=step)
            postfix = {k: f"{row[k]:.3g}" for k in ("loss", "reward_mean") if k in row}
            seconds["updates"] += 1
            if bar is None:
                seconds["first"] = time.perf_counter() - begun
                memory.mark("first update")
                print(f"{spec.name}: compiled; the first step took {seconds['first']:.1f} s "
                      "(left out of the progress bar's rate and ETA)", file=sys.stderr)
                bar = progress(total=(spec.total - start) // spec.updates_per_step, description=spec.name,
                               initial=1, postfix=postfix)
            else:
                bar.set_postfix(postfix, refresh=False)
                bar.update(1)
            # The guard looks where the periodic saves are (before this step's save, which keeps
            # what it found), whether or not this run was interrupted in between.
            if guard is not None and every and step < spec.total and step // every > (
                    step - spec.updates_per_step) // every:
                if mark is not None:
                    mark("evaluating", step)
                stop = guard.observe(step, evaluate(merge(state.model), run, key=spec.eval_key, mesh=spec.mesh,
                                                    title=f"{spec.role} at step {step} of {spec.title}"))
                tracker.log(guard.metrics(step), step=step)
                if stop:
                    save(state)
                    raise guard.stop_error()
            if fail_after is not None and start < fail_after <= step:
                save(state)
                raise SimulatedFailure(f"{spec.name}: simulated failure after step {step} (fail_after={fail_after})")

        with mesh_scope(spec.mesh):
            try:
                policy = StallPolicy.resolve(cfg.run.stall_factor, cfg.run.stall_floor_s)
                with watch_progress(spec.name, policy, Path(run.where.run_dir) / "stacks") as mark:
                    state, preempted = run_updates(state, spec.total, lambda s: step_fn(s, int(s.step)), save=save,
                                                   on_update=on_update, save_every=every, progress=mark)
            finally:
                if bar is not None:
                    bar.close()
            seconds["train"] = time.perf_counter() - begun
            if preempted:
                raise StageError(f"{spec.name}: stopped by SIGTERM or Ctrl-C at step {int(state.step)}; the "
                                 f"checkpoint is saved in {directory}; rerun the same command to continue (the "
                                 f"Metaflow flow: `resume`)")
            checkpoints.close()
            # said before the silent stretch (10-60 s) between the bar's 100% and the stage's end
            print(f"{spec.name}: evaluating on {len(eval_examples(run))} held-out problems"
                  + (", then exporting" if cfg.run.export else "") + " ...", file=sys.stderr)
            memory.mark("trained")
            # adapters merged: the model the next stage restores, bit for bit; the saved state let go
            step, params, model = int(state.step), count_params(state.model), merge(state.model)
            del state  # (the decoding would hold it beside the merged model)
            memory.mark("merged")
            evaluated = time.perf_counter()
            evaluation = evaluate_report(model, run, key=spec.eval_key,
                                         title=f"{spec.role} after {spec.title}", mesh=spec.mesh)
            seconds["eval"] = time.perf_counter() - evaluated
            memory.mark("evaluated")
            export = run.export(model, spec.name, spec.role) if cfg.run.export else None
        log_evaluation(tracker, evaluation, step=spec.total)
        tracker.summary({f"params_{k}": v for k, v in params.items()})
        if memory:  # the accelerator's (a CPU keeps no statistics)
            tracker.summary(memory.summary())
        gain = None
        if spec.start is not None and spec.start.evaluation is not None:
            intervals = gain_intervals(evaluation, spec.start.evaluation)
            if intervals:
                gain = {"over": spec.start.stage, "metrics": {k: v.to_dict() for k, v in intervals.items()}}
                log_gain(tracker, gain, step=spec.total)
        if guard is not None:
            stop = guard.observe(spec.total, evaluation, final=True)
            tracker.log(guard.metrics(spec.total), step=spec.total)
            tracker.summary({"guard/kept": guard.record()["kept"], "guard/mode": guard.mode})
            if stop:
                raise guard.stop_error()
    return StageResult(stage=spec.name, role=spec.role, checkpoint_dir=str(directory), step=step,
                       identity=spec.fingerprints["identity"].to_json(), history=history, evaluation=evaluation,
                       curves_png=curves_png(history, spec.curves, title=f"{spec.title} ({spec.role})"),
                       wandb_run_dir=str(tracker.run_dir), export_dir=None if export is None else str(export),
                       params=params, seconds=seconds, memory=dict(memory) or None, gain=gain,
                       guard=None if guard is None else guard.record(),
                       kept=spec.start if guard is not None and guard.kept_start else None)


def tracker_for(run: Run, stage: str) -> Tracker:
    """The stage's W&B run (group = the pipeline run, job type = the stage); only process 0 writes."""
    return Tracker(root=run.where.outputs / "wandb", project=run.config.run.project, stage=stage,
                   group=run.where.run_id, config=run.config.to_dict(),
                   mode="disabled" if jax.process_index() else None)


def log_evaluation(tracker: Tracker, evaluation: Evaluation, *, step: int) -> None:
    metrics = evaluation.metrics()
    tracker.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)
    tracker.log_table("eval/samples", ["prompt", "answer", "completion", "reward"],
                      [list(dataclasses.astuple(s)) for s in evaluation.samples], step=step)
    if evaluation.accuracy_vs_nfe:
        rows = [[p.decoding, p.accuracy, p.mean_reward, p.nfe_per_token] for p in evaluation.accuracy_vs_nfe]
        tracker.log_table("eval/accuracy_vs_nfe", ["decoding", "accuracy", "mean_reward", "nfe_per_token"], rows,
                          step=step)
    tracker.summary(metrics)


def log_gain(tracker: Tracker, gain: dict[str, Any], *, step: int) -> None:
    """The paired change over the start, `eval/gain/<metric>` with `_low` and `_high`, logged and
    in the run's summary (with `eval/gain/over`, the stage it is measured against)."""
    values: dict[str, Any] = {}
    for name, interval in gain["metrics"].items():
        values |= {f"eval/gain/{name}": interval["estimate"], f"eval/gain/{name}_low": interval["low"],
                   f"eval/gain/{name}_high": interval["high"]}
    tracker.log(values, step=step)
    tracker.summary({**values, "eval/gain/over": gain["over"]})


def progress(*, total: int, description: str, initial: int = 0, postfix: Mapping[str, str] | None = None):
    """A tqdm bar on a terminal. Elsewhere (Metaflow step logs, CI) a bar redrawn with carriage
    returns is one endless line, so tqdm prints a plain line every ~10% instead. A bar made with
    `initial` steps already done times only the steps after them (`drive` passes the first,
    compiling step so)."""
    from tqdm.auto import tqdm

    disable = os.environ.get("BDLM_PROGRESS", "1") == "0"
    if sys.stderr.isatty():
        return tqdm(total=total, desc=description, initial=initial, postfix=postfix, mininterval=1.0,
                    dynamic_ncols=True, disable=disable)
    return tqdm(total=total, desc=description, initial=initial, postfix=postfix, mininterval=15.0,
                miniters=max(1, total // 10), ncols=100, ascii=True, disable=disable, file=_LineWriter(sys.stderr))


class _LineWriter:
    """Turns tqdm's carriage-return redraws into one line per update."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()
