"""The stage's W&B run: a stage that stops on an error is marked failed, not finished."""

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
