"""A built-in task whose problems do not fit the canvas is refused before anything trains."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from bd_train.stages import StageError, check_adopted, parse_pipeline_config

SMOKE = Path(__file__).resolve().parents[3] / "flows" / "configs" / "smoke.toml"


def _preset(tmp_path, params, **canvas):
    data = tomllib.loads(SMOKE.read_text())
    data["task"]["params"] = params
    data["canvas"].update(canvas)
    data["run"]["output_dir"] = str(tmp_path)
    return parse_pipeline_config(data)


def test_a_built_in_tasks_problems_are_fitted_to_the_canvas_before_training(tmp_path):
    """Sort's answer of 4 digits needs 5 tokens with the end-of-text token: a canvas of 4 new
    tokens is refused by key (it used to fail inside SFT's data pipeline, with a traceback);
    its prompt of 5 bytes in a 4-token prompt too. Held-out problems need only their prompt."""
    with pytest.raises(StageError, match=r"^canvas\.max_new_tokens: training problem 0 of task 'sort' has an answer "
                                         r"of 4 tokens, 5 with the end-of-text token, but canvas\.max_new_tokens = 4; "
                                         r"raise max_new_tokens \(a multiple of block_size = 4\)"):
        check_adopted(_preset(tmp_path, {"length": 4}, max_new_tokens=4))
    with pytest.raises(StageError, match=r"^canvas\.prompt_len: train problem 0 of task 'sort' \('\d{4}='\) takes 5 "
                                         r"tokens but canvas\.prompt_len = 4"):
        check_adopted(_preset(tmp_path, {"length": 4}, prompt_len=4))
    check_adopted(_preset(tmp_path, {"length": 3}, prompt_len=4, max_new_tokens=4))
