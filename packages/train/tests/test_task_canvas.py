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


def test_every_problem_of_a_math_file_is_fitted_at_the_start_and_named_by_line(tmp_path):
    """The math task's file was checked for its first 512 training problems only: a long one
    later stopped the run part way, with no file or line. Every problem is fitted now, and the
    refusal names the file and line."""
    import json

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(600)]
    rows[550]["prompt"] = "what is " * 20 + "1+1="
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    config = _preset(tmp_path, {"path": str(data), "eval_path": str(held)}, prompt_len=8)
    config["task"]["name"] = "math"
    with pytest.raises(StageError, match=rf"^canvas\.prompt_len: train problem 550 of task 'math' "
                                         rf"\({data}:551\) .* takes \d+ tokens but canvas\.prompt_len = 8; raise "
                                         r"prompt_len \(a multiple of block_size = 4\) or shorten or remove that "
                                         r"problem"):
        check_adopted(parse_pipeline_config(config))


def test_task_keys_the_data_would_ignore_are_said_by_key(tmp_path, capsys):
    """`name = "math"` beside the user's JSONL files was ignored without a word (exact match
    rewarded them), and `overlong` with a built-in task did nothing. Both are said at the start
    (not refused: a checkpoint's recorded config may hold them, and must still load)."""
    data = tomllib.loads(SMOKE.read_text())
    files = tmp_path / "d.jsonl"
    files.write_text('{"prompt": "1=", "completion": "1"}\n')
    data["task"] = {"name": "math", "params": {"max_chars": 64}, "train_jsonl": str(files), "eval_jsonl": str(files)}
    check_adopted(parse_pipeline_config(data))
    err = capsys.readouterr().err
    assert "task.name: unused beside train_jsonl / eval_jsonl, whose answers are rewarded by exact match" in err
    assert "task.params: unused beside train_jsonl" in err
    data["task"] = {"name": "sort", "params": {"length": 3}, "overlong": "skip"}
    check_adopted(parse_pipeline_config(data))
    assert "task.overlong = 'skip': unused with a built-in task" in capsys.readouterr().err
    data["task"] = {"name": "sort", "params": {"length": 3}}
    check_adopted(parse_pipeline_config(data))
    assert "task." not in capsys.readouterr().err


def test_what_an_over_long_policy_dropped_is_said_at_the_start(tmp_path, capsys):
    """`overlong = "skip"` trained on what was left without a word: 15 of 16 lines dropped once."""
    import json

    data = tomllib.loads(SMOKE.read_text())
    rows = [{"prompt": "1=", "completion": "1"}] + [{"prompt": "9" * 40 + "=", "completion": "9"}] * 15
    files = tmp_path / "d.jsonl"
    files.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data["task"] = {"train_jsonl": str(files), "eval_jsonl": str(files), "overlong": "skip"}
    check_adopted(parse_pipeline_config(data))
    err = capsys.readouterr().err
    assert f"task.train_jsonl: {files}: over-long policy 'skip': 0 truncated, 15 skipped of 16 (lines 2, 3, 4" in err
    assert "task.eval_jsonl: " in err
