"""The stages' driver on the smoke preset's student: a SIGTERM stops it with a save, a simulated
failure (`fail_after`) stops it right after a saved step, and either way a second `drive`
continues from the checkpoint (data position included) to the uninterrupted result."""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import shutil
import signal
import tomllib
import weakref
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bd_train import Checkpointer, Trainer, make_optimizer, sft_objective
from bd_train.stages import (
    Run,
    RunDir,
    SimulatedFailure,
    StageError,
    StageSpec,
    drive,
    parse_pipeline_config,
    run_grpo,
    run_opd,
    run_rft,
    run_sft,
    under_run_precision,
)

SMOKE = Path(__file__).resolve().parents[3] / "flows" / "configs" / "smoke.toml"
TOTAL = 10


def _run(output_dir: Path, lr: float = 3e-3, allow_changes: tuple[str, ...] = (), d_model: int | None = None) -> Run:
    data = tomllib.loads(SMOKE.read_text())
    if d_model is not None:
        data["student"]["d_model"] = d_model
    data["run"].update(output_dir=str(output_dir), checkpoint_every=4, max_to_keep=5, allow_changes=list(allow_changes))
    data["sft"]["optim"]["lr"] = lr
    config = parse_pipeline_config(data)
    return Run(config, RunDir.create(config, run_id="driver"))


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv("BDLM_PROGRESS", "0")
    monkeypatch.setenv("WANDB_MODE", "offline")
    return _run(tmp_path)


def _drive(run: Run, *, stop_at: int | None = None, fail_after: int | None = None, nan_at: tuple[int, ...] = (),
           optimizer_state: list | None = None):
    """The student's SFT through `drive`; sends itself SIGTERM during update `stop_at`, and feeds
    the updates `nan_at` a batch of NaN weights (skipped: nothing changes); `optimizer_state` gets
    weak references to the latest update's optimizer state."""
    optimizer = run.optimizer_config(run.config.sft.optim, TOTAL)
    trainer = Trainer(sft_objective, make_optimizer(optimizer))
    keys = run.keys("sft-student", "init", "eval")
    state = run.fresh_state(run.model_config("student"), trainer.optimizer, key=keys["init"])
    data = run.sft_batches("sft-student")

    def step_fn(state, step):
        if step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        batch = next(data)
        if step in nan_at:
            batch = dataclasses.replace(batch, weights=jnp.full_like(batch.weights, jnp.nan))
        state, metrics = trainer.step(state, batch)
        if optimizer_state is not None:
            optimizer_state[:] = [weakref.ref(x) for x in jax.tree.leaves(state.opt_state)]
        return state, metrics

    pinned = {"identity": run.identity("student"), "training": run.training("sft-student")}
    spec = StageSpec("sft-student", "student", "SFT", TOTAL, pinned,
                     optimizer.learning_rate_schedule(), ("loss",), keys["eval"])
    return drive(run, spec, state, step_fn, data, fail_after=fail_after)


def _final_params(run: Run) -> list[np.ndarray]:
    optimizer = make_optimizer(run.optimizer_config(run.config.sft.optim, TOTAL))
    target = run.fresh_state(run.model_config("student"), optimizer, key=jax.random.key(0))
    with Checkpointer(run.where.checkpoint_dir("sft-student"), create=False) as checkpoints:
        state = checkpoints.restore(target)
    assert int(state.step) == TOTAL
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


def _saved_steps(run: Run) -> list[int]:
    with Checkpointer(run.where.checkpoint_dir("sft-student"), create=False) as checkpoints:
        return checkpoints.all_steps()


def test_sigterm_saves_and_a_second_drive_continues_to_the_uninterrupted_result(run, tmp_path_factory):
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StageError, match=r"sft-student: stopped by SIGTERM or Ctrl-C at step 6; the checkpoint is "
                                         r"saved .*; rerun the same command to continue"):
        _drive(run, stop_at=5)
    assert signal.getsignal(signal.SIGTERM) == previous
    assert _saved_steps(run) == [4, 6]  # the periodic save, then the one on SIGTERM
    resumed = _drive(run)
    assert resumed.evaluation is not None and resumed.evaluation.n == 16

    uninterrupted = _run(tmp_path_factory.mktemp("uninterrupted"))
    reference = _drive(uninterrupted)
    assert resumed.history == reference.history  # the curves continue across the stop, row for row
    for got, want in zip(_final_params(run), _final_params(uninterrupted)):
        np.testing.assert_array_equal(got, want)
    assert resumed.evaluation.metrics() == reference.evaluation.metrics()


def test_skipped_updates_are_counted_and_the_rate_logged_is_the_one_used(run):
    """The schedule follows the updates applied: a skipped update (a NaN gradient) does not
    advance it. The logged rate was the schedule at the step count, one ahead per skip, and
    GRPO's several updates per step counted a skip by its last update only; both now read the
    optimizer's own count."""
    schedule = run.optimizer_config(run.config.sft.optim, TOTAL).learning_rate_schedule()
    history = _drive(run, nan_at=(2, 3)).history  # updates 2 and 3 see a NaN: skipped
    skips = {row["step"]: row["skipped_total"] for row in history}
    assert skips[1] == 0 and skips[3] == 1 and skips[4] == 2 and skips[TOTAL] == 2
    applied = [row["step"] - row["skipped_total"] for row in history]
    assert [row["learning_rate"] for row in history] == [float(schedule(max(a - 1, 0))) for a in applied]
    assert history[-1]["learning_rate"] == float(schedule(TOTAL - 3))  # 8 applied: the 8th's rate


def test_the_saved_train_state_is_let_go_before_the_held_out_decoding(run, monkeypatch):
    """Once trained and saved, a stage's state is let go before its held-out evaluation: the
    decoding does not hold the optimizer state (nor, under LoRA, the frozen base) beside the
    merged model, as `bd_train.plan` counts it (`_plan_resident`)."""
    from bd_train.stages import _driver

    optimizer_state, alive = [], []
    evaluate_report = _driver.evaluate_report

    def evaluated(*args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in optimizer_state))
        return evaluate_report(*args, **kwargs)

    monkeypatch.setattr(_driver, "evaluate_report", evaluated)
    _drive(run, optimizer_state=optimizer_state)
    assert optimizer_state and alive == [0]


def test_a_fresh_state_compiles_to_the_program_of_its_restored_checkpoint(run):
    """A stage starts from fresh weights, the next from their checkpoint: both are committed to the
    device, so a program compiled for one (the sampler of the evaluation, say) serves the other,
    from memory or from JAX's persistent compilation cache."""
    model_config, identity = run.model_config("student"), run.identity("student")
    optimizer = make_optimizer(run.optimizer_config(run.config.sft.optim, TOTAL))
    state = run.fresh_state(model_config, optimizer, key=jax.random.key(0))
    directory = run.where.checkpoint_dir("sft-student")
    with Checkpointer(directory) as checkpoints:
        checkpoints.save(state, fingerprints={"identity": identity}, force=True)
        checkpoints.wait()
    restored = run.restore_model(directory, model_config, identity, what="the checkpoint")
    program = eqx.filter_jit(lambda model: [jnp.sum(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))])
    assert program.lower(state.model).as_text() == program.lower(restored).as_text()


def test_every_update_runs_the_program_of_the_first(run):
    """A state as OPD, GRPO and RFT build theirs: a restored model (committed to the device) with a
    fresh optimizer state from `Trainer.init`. `drive` commits all of it before the first update, so
    every update runs the first one's program; a state of mixed arrays would come back from its
    first update all committed, and the second update would compile the step again."""
    model_config, identity = run.model_config("student"), run.identity("student")
    settings = run.optimizer_config(run.config.sft.optim, TOTAL)
    optimizer = make_optimizer(settings)
    directory = run.where.checkpoint_dir("start")
    with Checkpointer(directory) as checkpoints:
        checkpoints.save(run.fresh_state(model_config, optimizer, key=jax.random.key(0)),
                         fingerprints={"identity": identity}, force=True)
        checkpoints.wait()
    trainer = Trainer(sft_objective, optimizer)
    state = trainer.init(run.restore_model(directory, model_config, identity, what="the start"),
                         key=jax.random.key(1))
    data = run.sft_batches("sft-student")
    programs = []

    def step_fn(state, step):
        batch = next(data)
        programs.append(trainer.lower(state, batch).as_text())
        return trainer.step(state, batch)

    pinned = {"identity": identity, "training": run.training("sft-student")}
    spec = StageSpec("sft-student", "student", "SFT", 3, pinned, settings.learning_rate_schedule(), ("loss",),
                     jax.random.key(2))
    drive(run, spec, state, step_fn, data)
    assert len(programs) == 3 and len(set(programs)) == 1


def test_fail_after_stops_right_after_a_saved_step_once(run, monkeypatch, capsys):
    monkeypatch.setenv("BDLM_PROGRESS", "1")  # the bar's lines as a log (not a terminal) gets them
    with pytest.raises(SimulatedFailure, match="sft-student: simulated failure after step 3"):
        _drive(run, fail_after=3)
    assert _saved_steps(run) == [3]
    first = capsys.readouterr().err
    resumed = _drive(run, fail_after=3)  # started at step 3: the failure is behind it
    assert [row["step"] for row in resumed.history] == list(range(1, TOTAL + 1))
    second = capsys.readouterr().err
    # The first step compiles: it is said with its time, and the bar starts after it (at 1, no rate
    # yet), so that the bar's rate and ETA time compiled steps only; the evaluation after the bar's
    # end is announced, not silent.
    for err, bar_start, bar_end in ((first, "1/10", "3/10"), (second, "1/7", "7/7")):
        compiled = re.search(r"^sft-student: compiled; the first step took \d+\.\d s", err, re.M)
        started = re.search(rf"^sft-student: +\d+%\|[^|]*\| {bar_start} \[00:00<\?, \?it/s", err, re.M)
        ended = re.search(rf"^sft-student: +\d+%\|[^|]*\| {bar_end} \[", err, re.M)
        assert compiled and started and ended, err
        assert compiled.start() < started.start() < ended.start(), err
    assert "evaluating" not in first
    evaluating = second.index("sft-student: evaluating on 16 held-out problems ...\n")
    assert evaluating > second.index("| 7/7 ["), second


def test_a_resume_under_changed_training_settings_is_refused_by_field(run, tmp_path):
    """The stage's checkpoints pin its training settings: continuing them with another learning
    rate would silently mix two runs."""
    with pytest.raises(SimulatedFailure):
        _drive(run, fail_after=3)
    with pytest.raises(StageError, match=r"training\.sft\.optim\.lr: saved 0\.003, current 0\.001\n(.|\n)*add it to "
                                         r"\[run\] allow_changes = \[\"training\.sft\.optim\.lr\"\]; to train anew"):
        _drive(_run(tmp_path, lr=1e-3))


def test_a_change_of_the_models_shapes_is_refused_without_offering_allow_changes(run, tmp_path):
    """A wider student cannot continue a narrower one's checkpoint, whatever allow_changes says:
    the message says so (it used to suggest allow_changes, which then failed in the restore with a
    dump of the saved and target trees)."""
    with pytest.raises(SimulatedFailure):
        _drive(run, fail_after=3)
    width = run.config.student.d_model
    for allow in ((), ("identity.architecture",)):
        with pytest.raises(StageError, match=rf"identity\.architecture\.d_model: saved {width}, current {2 * width}"
                                             r"(.|\n)*set the shapes of the saved arrays, so no \[run\] allow_changes "
                                             r"can continue") as error:
            _drive(_run(tmp_path, d_model=2 * width, allow_changes=allow))
        assert "add it to [run] allow_changes" not in str(error.value)


def test_a_deliberate_change_is_allowed_by_name_and_recorded(run, tmp_path, capsys):
    with pytest.raises(SimulatedFailure):
        _drive(run, fail_after=3)
    with pytest.raises(StageError, match=r"training\.sft\.optim\.lr: saved 0\.003"):  # another field is not enough
        _drive(_run(tmp_path, lr=1e-3, allow_changes=("training.sft.steps",)))
    resumed = _drive(_run(tmp_path, lr=1e-3, allow_changes=("training.sft.optim",)))
    assert resumed.step == TOTAL
    assert "training.sft.optim.lr 0.003 -> 0.001" in capsys.readouterr().err
    with Checkpointer(run.where.checkpoint_dir("sft-student"), create=False) as checkpoints:
        overrides = checkpoints.read_meta()["overrides"]
    assert overrides == [{"step": 3, "changes": {"training.sft.optim.lr": [0.003, 0.001]}}]


def test_sft_may_continue_another_stages_model_and_pins_where_it_started(tmp_path, monkeypatch):
    """`run_sft(start=...)` trains on from that checkpoint's weights (a fresh optimizer), and its
    checkpoints pin the folder it started from: another start is refused by field."""
    from bd_train.stages import run_sft

    monkeypatch.setenv("BDLM_PROGRESS", "0")
    monkeypatch.setenv("WANDB_MODE", "offline")
    data = tomllib.loads(SMOKE.read_text())
    data["run"]["output_dir"] = str(tmp_path)
    data["eval"].update(samples=0, thresholds=[])
    config = parse_pipeline_config(data)
    first = run_sft(config, RunDir.create(config, run_id="first"), role="student")
    run = Run(config)
    started = run.restore_model(first.checkpoint_dir, run.model_config("student"), run.identity("student"), what="x")
    data["sft"]["steps"] = 1
    data["sft"]["optim"] = {"lr": 1e-9, "warmup_steps": 0, "schedule": "constant"}
    more_config = parse_pipeline_config(data)
    more = run_sft(more_config, RunDir.create(more_config, run_id="more"), role="student", start=first)
    after = Run(more_config).restore_model(more.checkpoint_dir, run.model_config("student"), run.identity("student"),
                                           what="x")
    # one step at lr 1e-9 from the first model: within 1e-6 of it, and not of a fresh initialization
    drift = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(eqx.filter(after, eqx.is_array)),
                                                             jax.tree.leaves(eqx.filter(started, eqx.is_array))))
    assert 0 < drift < 1e-6
    other = run_sft(config, RunDir.create(config, run_id="other"), role="student")
    with pytest.raises(StageError, match=r"start\.checkpoint"):
        run_sft(more_config, RunDir.create(more_config, run_id="more"), role="student", start=other)


def test_a_checkpoint_names_its_stage_and_adopting_another_stages_is_said(run, tmp_path, capsys):
    """`[teacher] checkpoint` given the student's SFT (or an OPD checkpoint) is adopted, as it may be
    meant, but said before anything trains; the role's own SFT is said without a warning."""
    from bd_train.stages import check_adopted
    from bd_train.stages._compat import adoption, saved_stage

    with pytest.raises(SimulatedFailure):
        _drive(run, fail_after=3)
    directory = run.where.checkpoint_dir("sft-student")
    assert saved_stage(directory) == ("sft-student", 3)
    assert adoption("student", directory) == f"student.checkpoint: adopting {directory} (step 3, written by stage " \
                                             f"sft-student)"
    capsys.readouterr()
    data = tomllib.loads(SMOKE.read_text())
    data["teacher"] = {"checkpoint": str(directory)}
    check_adopted(parse_pipeline_config(data))
    assert "teacher.checkpoint: adopting" in (err := capsys.readouterr().err)
    assert "written by stage sft-student); that is not the teacher's SFT (sft-teacher)" in err
    with Checkpointer(tmp_path / "older", create=True) as checkpoints:  # from before stages were recorded
        state = run.fresh_state(run.model_config("student"), make_optimizer(run.optimizer_config(
            run.config.opd.optim, 2)), key=jax.random.key(0))
        checkpoints.save(state, fingerprints={"identity": run.identity("student"), "training": run.training("opd")})
    assert saved_stage(tmp_path / "older") == ("opd", 0)
    assert "stage opd); that is not the student's SFT" in adoption("student", tmp_path / "older")


def test_opd_pins_its_teachers_weights_so_a_retrained_teacher_is_refused_by_name(run, tmp_path):
    """OPD reads its teacher at every update: the teacher's identity alone (architecture and tokens)
    would let a resume distill from other weights saved in the same folder."""
    from bd_core import FingerprintMismatch, require_compatible
    from bd_train.stages._compat import saved_weights

    optimizer = make_optimizer(run.optimizer_config(run.config.sft.optim, 2))
    folder = tmp_path / "teacher"
    for seed in (0, 1):  # the same teacher folder, removed and trained again from another initialization
        shutil.rmtree(folder, ignore_errors=True)
        with Checkpointer(folder, create=True) as checkpoints:
            state = run.fresh_state(run.model_config("teacher"), optimizer, key=jax.random.key(seed))
            checkpoints.save(state, fingerprints={"identity": run.identity("teacher")}, force=True)
        if seed == 0:
            first = saved_weights(folder)
    second = saved_weights(folder)
    assert first.fields["step"] == second.fields["step"] == 0 and first.fields["model"] is not None
    with pytest.raises(FingerprintMismatch, match=r"model: saved '[0-9a-f]{12}"):
        require_compatible(first, second)
    assert saved_weights(folder) == second  # read again, the same


def test_a_distilled_or_adopted_checkpoint_is_computed_as_its_role_says():
    """OPD's teacher and an adopted SFT are built from the architecture their identity records,
    which leaves out how the model is computed: that comes from `[teacher]`/`[student]` (it used
    to fall back to bd_models' defaults, e.g. `blocked` where the preset asked for `splash`)."""
    from bd_train.stages._compat import saved_model_config

    data = tomllib.loads(SMOKE.read_text())
    data["teacher"].update(attention="dense", remat="full", logits_chunk=4)
    run = Run(parse_pipeline_config(data))
    config = saved_model_config(run, run.identity("teacher"), "teacher")
    assert (config.attention, config.remat, config.logits_chunk) == ("dense", "full", 4)
    assert config == run.model_config("teacher")


def test_every_stage_runs_at_the_matmul_precision_the_run_names():
    """`[run] matmul_precision` is JAX's default precision inside each stage (rollouts, replays,
    train steps, evaluation), and nowhere else: one stage's setting does not leak into the process."""
    seen = []
    probe = under_run_precision(lambda config, where: seen.append(jax.config.jax_default_matmul_precision))
    probe(parse_pipeline_config("[run]\nmatmul_precision = 'highest'\n"), None)
    probe(config=parse_pipeline_config(""), where=None)  # by name, as a stage may be called
    assert seen == ["highest", None] and jax.config.jax_default_matmul_precision is None  # "default": untouched
    assert all(stage.__wrapped__ for stage in (run_sft, run_opd, run_grpo, run_rft))  # each stage is wrapped
