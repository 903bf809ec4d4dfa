"""`bd_train.evaluate` on a checkpoint the smoke preset's student SFT writes: the same numbers on
every evaluation, pass@k equal to a brute-force count, and one clear message for a bad folder."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from bd_train.evaluate import evaluate, pass_at_k
from bd_train.stages import RunDir, parse_pipeline_config, run_sft

SMOKE = Path(__file__).resolve().parents[3] / "flows" / "configs" / "smoke.toml"


@pytest.mark.parametrize("n, c, k", [(n, c, k) for n in range(1, 7) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_correct_one(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("evaluate")
    data = tomllib.loads(SMOKE.read_text())
    data["run"]["output_dir"] = str(folder)
    config = parse_pipeline_config(data)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("BDLM_PROGRESS", "0")
        return run_sft(config, RunDir.create(config, run_id="eval"), role="student").checkpoint_dir


def test_the_same_checkpoint_gives_the_same_numbers(checkpoint):
    first, second = (evaluate(checkpoint, samples=4, n=8, thresholds=(0.5, 0.9)) for _ in range(2))
    for report in (first, second):
        for point in report["accuracy_vs_nfe"]:
            assert point.pop("tokens_per_second") > 0
    assert first == second
    assert set(first["pass_at_k"]) == {"pass@1", "pass@2", "pass@4"}
    intervals = first["intervals"]  # Wilson for the accuracy, a bootstrap over problems for pass@k
    assert set(intervals) == {"accuracy", "pass@1", "pass@2", "pass@4"} and intervals["accuracy"]["method"] == "Wilson"
    for key, value in [("accuracy", first["greedy"]["accuracy"]), *first["pass_at_k"].items()]:
        assert intervals[key]["low"] <= value <= intervals[key]["high"] and intervals[key]["estimate"] == value
    assert intervals["accuracy"]["high"] > 0  # Wilson's interval has width even at 0 of 8
    assert first["greedy"]["n"] == 8 and [p["decoding"] for p in first["accuracy_vs_nfe"]] == [
        "τ 0.5", "τ 0.9", "one per step"]
    one_per_step = first["accuracy_vs_nfe"][-1]
    assert one_per_step["nfe_per_token"] >= max(p["nfe_per_token"] for p in first["accuracy_vs_nfe"][:-1])
    # --samples 0, as [eval] samples = 0: greedy decoding only, no pass@k (the command refused 0)
    from bd_train.evaluate import format_report

    greedy = evaluate(checkpoint, samples=0, n=8, thresholds=())
    assert greedy["pass_at_k"] == {} and greedy["greedy"] == first["greedy"]
    assert set(greedy["intervals"]) == {"accuracy"}
    assert "no sampled rollouts (--samples 0): no pass@k" in format_report(greedy)


def test_the_command_writes_json_and_a_plot_and_refuses_a_bad_folder_in_one_line(checkpoint, tmp_path,
                                                                                 child_xla_flags):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": child_xla_flags}
    out = tmp_path / "eval.json"
    done = subprocess.run([sys.executable, "-m", "bd_train.evaluate", "--checkpoint", checkpoint, "--n", "8",
                           "--samples", "2", "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pass@2" in done.stdout and "one per step" in done.stdout and "(Wilson 95%)" in done.stdout
    assert json.loads(out.read_text())["n"] == 8 and out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    missing = subprocess.run([sys.executable, "-m", "bd_train.evaluate", "--checkpoint", str(tmp_path / "nope")],
                             env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert f"checkpoint folder {str(tmp_path / 'nope')!r} does not exist; give a stage's checkpoint" in missing.stderr


def test_an_output_path_that_cannot_hold_the_results_is_refused_before_the_work(tmp_path, capsys):
    """`--out` (evaluate) and `--json` (plan) are checked before minutes of decoding or compiling:
    a plot path that would overwrite the JSON, and a folder that does not exist."""
    from bd_train.evaluate import main as evaluate
    from bd_train.plan import main as plan

    for out, message in ((tmp_path / "r.png", "the plot is written beside the JSON with the suffix .png"),
                         (tmp_path / "nope" / "r.json", f"the folder {str(tmp_path / 'nope')!r} does not exist"),
                         (tmp_path, "is a folder; give a file path in it")):
        with pytest.raises(SystemExit) as exit_:
            evaluate(["--checkpoint", str(tmp_path), "--out", str(out)])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    for flags, message in ((["--samples", "-1"], "--samples must be at least 0"),
                           (["--samples", "0", "--best-of", "vote"], "--best-of chooses among the --samples rollouts")):
        with pytest.raises(SystemExit) as exit_:
            evaluate(["--checkpoint", str(tmp_path), *flags])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    for out, message in ((tmp_path / "nope" / "plan.json", "does not exist; create it first"),
                         (tmp_path, "is a folder; give a file path in it")):
        with pytest.raises(SystemExit) as exit_:
            plan(["preset.toml", "--topology", "v5e:2x2", "--json", str(out)])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_step_folder_or_a_missing_path_is_refused_naming_what_to_give(checkpoint, tmp_path):
    from bd_core import ConfigError
    from bd_train.evaluate import load
    from bd_train.stages import StageError

    step = next(p for p in Path(checkpoint).iterdir() if p.name.isdigit())
    with pytest.raises(StageError, match=rf"{str(step)!r} is one step of the checkpoint folder {checkpoint!r}; "
                                         r"give that folder"):
        load(step)
    missing = str(tmp_path.name) + "/nope"  # an org/name shape: not a local folder, and no --config for a Hub id
    with pytest.raises(StageError, match=r"/nope: no such folder here; read as a Hub repo id it records no task"):
        load(missing)
    with pytest.raises(ConfigError, match=r"^--checkpoint .*/nope: "):  # the flag, not teacher.pretrained
        load(missing, config=SMOKE.read_text())


def test_mistakes_of_the_flags_are_named_by_flag_before_any_decoding(checkpoint, tmp_path):
    """A stage's checkpoint evaluates under its recorded config: `--config` is refused, not
    ignored; a `--task` whose problems the checkpoint's canvas cannot hold, or that needs a file,
    is named by the flag; a training file gone since (evaluation reads only the held-out one) is
    no obstacle."""
    from bd_core import ConfigError
    from bd_train.evaluate import _held_out_only, _overridden, load
    from bd_train.stages import StageError

    with pytest.raises(StageError, match=r"^--config: .* is a stage's checkpoint, which evaluates under the config it "
                                         r"was trained with"):
        load(checkpoint, config=SMOKE.read_text())
    with pytest.raises(StageError, match=r"^--task countdown: eval problem 0 of task 'countdown' \(.*\) takes \d+ "
                                         r"tokens but canvas\.prompt_len = 8, the canvas this checkpoint was trained"):
        load(checkpoint, task="countdown")
    with pytest.raises(ConfigError, match=r"^--task math: task\.params\.path: "):
        load(checkpoint, task="math")
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text('{"prompt": "1=", "completion": "1"}\n')
    config = {"task": {"train_jsonl": str(tmp_path / "gone.jsonl"), "eval_jsonl": str(held_out)}}
    assert _held_out_only(config)["task"]["train_jsonl"] == str(held_out)
    held_out.unlink()  # named as the held-out file (it was named as the training file standing in for it)
    with pytest.raises(StageError, match=r"^task\.eval_jsonl: file '.*eval\.jsonl' does not exist"):
        _held_out_only(config)
    assert "eval_jsonl" not in _held_out_only(_overridden(dict(config), "sort", None))["task"]  # --task: no file


def test_another_task_keeps_the_prompt_format_and_every_decoding_setting_builds():
    """`--task` swaps the problems, not how prompts are written (the checkpoint's chat template);
    the accuracy-vs-NFE settings build from a `steps` sampler too (they crashed after training)."""
    from bd_train.evaluate import _overridden
    from bd_train.stages import Run
    from bd_train.stages._evaluate import decoding_settings

    config = {"task": {"name": "sort", "params": {"length": 4}, "chat_template": True}}
    assert _overridden(dict(config), "argsort", None)["task"] == {"name": "argsort", "chat_template": True}
    assert _overridden(dict(config), "sort", None)["task"] == config["task"]  # its own task keeps its params
    jsonl = {"task": {"train_jsonl": "t.jsonl", "eval_jsonl": "e.jsonl", "overlong": "skip", "chat_template": True}}
    assert _overridden(dict(jsonl), "sort", None)["task"] == {"name": "sort", "chat_template": True}  # files only
    run = Run(parse_pipeline_config({"eval": {"sampler": {"strategy": "steps", "steps_per_block": 2}}}))
    settings = decoding_settings(run.config.eval.sampler, (0.5, 0.9))
    assert [run.sampler_config(section).strategy for _, section in settings] == ["threshold"] * 3
