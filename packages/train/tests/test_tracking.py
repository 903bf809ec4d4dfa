"""The stage's W&B run and summary: a stage that stops on an error is marked failed; best-of-n reaches the summary."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bd_train.stages._tracking import Tracker


def _tracker(tmp_path, codes: list) -> Tracker:
    tracker = Tracker(root=tmp_path, project="bdlm", stage="sft", group="g", config={}, mode="disabled")
    tracker.run.finish()  # the real run ends here; a recorder stands in for it
    tracker.run = SimpleNamespace(finish=lambda exit_code=None: codes.append(exit_code))
    return tracker


def test_a_stage_that_raises_marks_its_run_failed(tmp_path):
    codes: list = []
    with _tracker(tmp_path, codes):
        pass
    with pytest.raises(RuntimeError), _tracker(tmp_path, codes):
        raise RuntimeError("a stage's error, a guard's stop or a preemption")
    assert codes == [0, 1]


def test_the_summary_keeps_best_of_n(tmp_path):
    """`[eval] best_of`'s accuracies reach summary.json under the names BestOfN gives them (only the
    stage cards had them)."""
    from bd_train.stages import summarize
    from bd_train.stages._best_of import BestOfN

    best = BestOfN(n=4, rule="vote", accuracy=0.5, mean_reward=0.6, pass_at_n=0.75, nfe_per_problem=9.0)
    evaluation = SimpleNamespace(metrics=lambda: {"accuracy": 0.25, "mean_reward": 0.3, "n": 8, "nfe_per_token": 1.1},
                                 pass_at_k={"pass@1": 0.25}, best_of=(best,), accuracy_vs_nfe=())
    result = SimpleNamespace(evaluation=evaluation, params=None, gain=None, guard=None)
    where = SimpleNamespace(run_dir=tmp_path, outputs=tmp_path)
    rows = ("teacher_sft", "student_sft", "student_opd", "student_grpo")
    summary = summarize(dict.fromkeys(rows, result), where)  # pyright: ignore[reportArgumentType]
    assert summary["student_grpo"]["best_of@4_vote"] == 0.5
    assert summary["student_grpo"]["nfe_per_problem@4"] == 9.0
