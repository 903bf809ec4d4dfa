"""OPD's guard on a tiny config where distillation hurts for sure: the teacher had one SFT step
(greedy accuracy 0), the student 100 (about 0.25 on 2-digit sort), and OPD at a high learning
rate pulls the student to the teacher within two steps. Each mode does what it says; a run
stopped and resumed decides as one that ran through; GRPO starts from the kept checkpoint; the
summary writes every stage's paired gain and the guard's record."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest

from bd_train.stages import (
    Evaluation,
    Guard,
    RunDir,
    StageError,
    parse_pipeline_config,
    run_grpo,
    run_opd,
    run_sft,
    summarize,
)

SMOKE = Path(__file__).resolve().parents[3] / "flows" / "configs" / "smoke.toml"


def _config(output_dir: Path, guard: str) -> dict:
    data = tomllib.loads(SMOKE.read_text())
    data["task"]["params"] = {"length": 2}
    data["student"]["d_model"] = 32
    data["sft"].update(steps=100, teacher_steps=1, optim={"lr": 1e-2, "warmup_steps": 2})
    data["opd"].update(steps=4, guard=guard, optim={"lr": 3e-2, "warmup_steps": 0})
    data["grpo"].update(steps=1)
    data["eval"].update(n=32, batch_size=32, samples=0, thresholds=[])
    data["run"].update(output_dir=str(output_dir), checkpoint_every=2, max_to_keep=5)
    return parse_pipeline_config(data)


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("BDLM_PROGRESS", "0")
        config = _config(root, "keep-best")
        where = RunDir.create(config, run_id="sft")
        teacher, student = (run_sft(config, where, role=role) for role in ("teacher", "student"))
    assert teacher.evaluation.accuracy == 0.0 and student.evaluation.accuracy >= 0.2  # the premise
    return root, teacher, student


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("BDLM_PROGRESS", "0")


def _opd(sft, guard: str, run_id: str, **kwargs):
    root, teacher, student = sft
    config = _config(root, guard)
    return run_opd(config, RunDir.create(config, run_id=run_id), teacher=kwargs.pop("teacher", teacher),
                   student=student, **kwargs)


def _decision(guard: dict) -> tuple:
    return [(p["step"], p["accuracy"], p["change"]) for p in guard["points"]], guard["kept"]


def test_keep_best_hands_on_the_start_and_grpo_starts_from_it(sft, capsys):
    root, teacher, student = sft
    opd = _opd(sft, "keep-best", "keep")
    err = capsys.readouterr().err
    assert "opd guard: the teacher is not better than the student on 32 held-out problems" in err
    assert "opd guard: at step 2 the student is worse than where OPD started" in err  # during OPD
    assert "at step 4 the student is worse" in err and "the next stage starts from OPD's start" in err
    assert opd.guard is not None and opd.guard["kept"] == "start" and [p["step"] for p in opd.guard["points"]] == [2, 4]
    assert opd.kept is student and opd.handed_on.checkpoint_dir == student.checkpoint_dir
    assert opd.gain is not None and opd.gain["over"] == "sft-student"
    assert opd.gain["metrics"]["accuracy"]["high"] < 0  # OPD's own model: measurably worse

    config = _config(root, "keep-best")
    where = RunDir.create(config, run_id="keep")
    grpo = run_grpo(config, where, start=opd)  # restores (identity-checked) the student after SFT
    assert grpo.gain is not None and grpo.gain["over"] == "sft-student"
    summary = summarize({"teacher_sft": teacher, "student_sft": student, "student_opd": opd, "student_grpo": grpo},
                        where)
    written = json.loads((Path(where.run_dir) / "summary.json").read_text())
    assert written == summary
    assert "gain" not in written["teacher_sft"] and "gain" not in written["student_sft"]
    assert written["student_opd"]["gain"]["over"] == "student_sft"
    assert written["student_grpo"]["gain"]["over"] == "student_sft"  # what GRPO started from
    for row in ("student_opd", "student_grpo"):
        for metric in ("accuracy", "mean_reward"):
            interval = written[row]["gain"][metric]
            assert interval["low"] <= interval["estimate"] <= interval["high"] and interval["n"] == 32
            assert interval["method"] == "paired bootstrap" and interval["confidence"] == 0.95
            assert interval["excludes_zero"] == (interval["low"] > 0 or interval["high"] < 0)
    assert written["student_opd"]["guard"]["kept"] == "start"
    printed = capsys.readouterr().out
    assert "gain over the model each stage started from: paired 95% bootstrap interval over the 32" in printed
    assert "OPD guard (keep-best)" in printed and "the next stage started from OPD's start" in printed


def test_warn_says_so_and_hands_on_opds_model(sft, capsys):
    opd = _opd(sft, "warn", "warn")
    assert "opd guard: at step 2 the student is worse" in capsys.readouterr().err
    assert opd.guard is not None and opd.guard["kept"] == "opd" and opd.kept is None and opd.handed_on is opd


def test_stop_stops_and_a_resumed_run_decides_as_one_that_ran_through(sft, capsys):
    root = sft[0]
    with pytest.raises(StageError, match=r"the teacher is not better than the student.*stopped \(\[opd\] guard"):
        _opd(sft, "stop", "stop-before")
    assert not (root / "pipeline" / "stop-before" / "checkpoints" / "opd").exists()  # nothing trained

    # Without the teacher's evaluation the guard looks during OPD only: the student is worse at
    # step 2, which is saved, and the run stops there; resumed in "stop" mode it stops again.
    unseen = dataclasses.replace(sft[1], evaluation=None)
    for _ in range(2):
        with pytest.raises(StageError, match=r"at step 2 the student is worse than where OPD started.*stopped"):
            _opd(sft, "stop", "stopped", teacher=unseen)
    # Another mode goes on from step 2 (the guard is not part of OPD's training fingerprint), and
    # decides as the uninterrupted keep-best run of the test above.
    resumed = _opd(sft, "keep-best", "stopped", teacher=unseen)
    through = _opd(sft, "keep-best", "through", teacher=unseen)
    assert [row["step"] for row in resumed.history] == [1, 2, 3, 4] and resumed.history == through.history
    assert resumed.guard is not None and through.guard is not None
    assert _decision(resumed.guard) == _decision(through.guard) and resumed.guard["kept"] == "start"
    assert resumed.guard["said"] == through.guard["said"]


def _evaluation(correct: list[int]) -> Evaluation:
    rewards = np.asarray(correct, float)
    return Evaluation(accuracy=float(rewards.mean()), mean_reward=float(rewards.mean()), n=len(rewards),
                      nfe_per_token=1.0, generated_tokens=1.0, rewards=tuple(rewards.tolist()))


def test_a_change_within_the_noise_is_not_acted_on():
    """Worse means the paired interval lies below zero: one problem of 32 lost is noise."""
    start = _evaluation([1] * 16 + [0] * 16)
    guard = Guard("stop", start)
    assert not guard.observe(2, _evaluation([1] * 15 + [0] * 17))
    assert guard.observe(4, _evaluation([0] * 32)) and "at step 4" in str(guard.stop_error())
    with pytest.raises(StageError, match="at step 4"):
        Guard("stop", start).restore(guard.points)
    keep = Guard("keep-best", start)
    keep.observe(4, _evaluation([1] * 15 + [0] * 17), final=True)
    assert keep.record()["kept"] == "opd"
