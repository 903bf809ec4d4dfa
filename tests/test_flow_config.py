"""A new user's mistakes: each is one clear message that names the key or file, no traceback."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bd_train.stages import ConfigError, parse_pipeline_config, pipeline_config

ROOT = Path(__file__).resolve().parents[1]
FLOW = ROOT / "flows" / "bd_pipeline.py"


def run_flow(*args, cwd):
    env = {**os.environ, "METAFLOW_USER": "tester"}
    return subprocess.run([sys.executable, str(FLOW), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("preset", sorted((ROOT / "flows" / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_presets_are_valid(preset):
    config = pipeline_config(parse_pipeline_config(preset.read_text()))
    assert config.canvas.prompt_len % config.canvas.block_size == 0


@pytest.mark.parametrize(
    "text, message",
    [
        ("[sft]\nstep = 3\n", "sft.step: unknown key; valid keys for [sft] are"),
        ("[sft.optim]\nlr = -1e-3\n", "sft.optim.lr: expected a value > 0, got -0.001"),
        ("[task]\ntrain_jsonl = 'no/such.jsonl'\neval_jsonl = 'no/such.jsonl'\n",
         "task.train_jsonl: file 'no/such.jsonl' does not exist"),
        ("[grpo]\ngroup_size = 1\n", "grpo.group_size: expected >= 2"),
        ("[canvas]\nblock_size = 3\n", "canvas.prompt_len: expected a multiple of block_size=3, got 16"),
        ("[teacher]\nd_model = 'big'\n", "teacher.d_model: expected an integer, got 'big'"),
        ("[sft\n", "not valid TOML"),
        ("[canvas]\npolicy = 'contiguous'\n", "canvas.policy: the pipeline's rollouts"),
        ("[teacher]\ncheckpoint = 'no/such/folder'\n", "teacher.checkpoint: folder 'no/such/folder' does not exist"),
        ("[opd]\nhard_ce_weight = 0.5\n", "opd.hard_ce_weight: hard CE needs a target at each distilled position"),
    ],
)
def test_config_errors_name_the_key(text, message):
    with pytest.raises(ConfigError) as err:
        parse_pipeline_config(text)
    assert message in str(err.value)


def test_flow_show_prints_the_graph(tmp_path):
    out = run_flow("show", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for step in ("start", "sft", "join", "opd", "grpo", "end"):
        assert f"Step {step}" in out.stdout


@pytest.mark.parametrize(
    "write, expected",
    [
        (None, "could not be read"),
        ("[sft]\nstepz = 3\n", "sft.stepz: unknown key"),
        ("[sft.optim]\nlr = -0.1\n", "sft.optim.lr: expected a value > 0"),
        ("[task]\ntrain_jsonl = 'missing.jsonl'\neval_jsonl = 'missing.jsonl'\n",
         "task.train_jsonl: file 'missing.jsonl' does not exist"),
    ],
    ids=["missing-file", "unknown-key", "negative-lr", "missing-jsonl"],
)
def test_bad_input_to_the_flow_is_one_clear_message(tmp_path, write, expected):
    path = tmp_path / "preset.toml"
    if write is not None:
        path.write_text(write)
    out = run_flow("--config", "config", str(path), "run", cwd=tmp_path)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert expected in text, text
    assert "Traceback" not in text, text


def test_identity_pins_what_the_model_computes_not_how():
    from bd_train.stages import Run

    base = (ROOT / "flows" / "configs" / "smoke.toml").read_text()
    identity = Run(parse_pipeline_config(base)).identity("student")
    how = Run(parse_pipeline_config(base.replace("[student]\n", "[student]\nattention = 'dense'\nremat = 'full'\n")))
    assert how.identity("student").digest == identity.digest
    wider = Run(parse_pipeline_config(base.replace("[student]\nd_model = 16", "[student]\nd_model = 32")))
    # head_dim follows d_model / n_heads unless set, and is recorded resolved
    assert set(wider.identity("student").diff(identity)) == {"architecture.d_model", "architecture.d_ff",
                                                              "architecture.head_dim"}


def test_rollout_semantics_pin_the_sampling_distribution():
    from bd_train.stages import Run

    setup = Run(parse_pipeline_config((ROOT / "flows" / "configs" / "smoke.toml").read_text()))
    grpo = setup.config.grpo.sampler
    hotter = setup.rollout_semantics(dataclasses.replace(grpo, temperature=1.5))
    assert set(hotter.diff(setup.rollout_semantics(grpo))) == {"temperature"}
