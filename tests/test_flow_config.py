"""A new user's mistakes: each is one clear message that names the key or file, no traceback."""

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bd_train.stages import ConfigError, Run, parse_pipeline_config, pipeline_config

ROOT = Path(__file__).resolve().parents[1]
FLOW = ROOT / "flows" / "bd_pipeline.py"


def run_flow(*args, cwd):
    env = {**os.environ, "METAFLOW_USER": "tester"}
    return subprocess.run([sys.executable, str(FLOW), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("preset", sorted((ROOT / "flows" / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_presets_are_valid(preset, hub_cache):
    """Every preset parses; a preset's Hub repo ids (the SDAR-Chat recipe's) are read from a Hub
    cache that holds the tiny SDAR fixture with a chat template under those ids (offline)."""
    import tomllib

    from bd_core import is_repo_id

    data = tomllib.loads(preset.read_text())
    for repo in {data.get(role, {}).get("pretrained", "") for role in ("teacher", "student")}:
        if is_repo_id(repo):
            hub_cache("sdar", repo, "c" * 40, tokenizer_from="chatml")
    config = pipeline_config(parse_pipeline_config(data))
    assert config.canvas.prompt_len % config.canvas.block_size == 0


@pytest.mark.parametrize("preset, study, arm", [("countdown.toml", "countdown", "grpo"),
                                                ("default.toml", "countdown_teach", "grpo_lr2e-4")])
def test_a_presets_stages_are_its_studys(tmp_path, preset, study, arm):
    """The preset's stages are the chain and GRPO arm (at 128 updates) that `bench/rl_study.py`
    measured: the numbers README and the results page give for the preset are the study's."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from rl_study import ARMS, study_config
    finally:
        sys.path.remove(str(ROOT / "bench"))
    config = pipeline_config(parse_pipeline_config((ROOT / "flows" / "configs" / preset).read_text()))
    measured = pipeline_config(study_config(study, 0, tmp_path, ARMS[arm].sections, {"grpo": {"steps": 128}}))
    assert config.grpo == measured.grpo
    assert (config.task, config.canvas, config.teacher, config.student, config.sft, config.opd) == (
        measured.task, measured.canvas, measured.teacher, measured.student, measured.sft, measured.opd)


def test_the_studys_rft_arm_samples_as_its_grpo_arm(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from rl_study import arm_sections, study_config
    finally:
        sys.path.remove(str(ROOT / "bench"))
    study = pipeline_config(study_config("argsort", 0, tmp_path, *arm_sections("argsort", "rft", tmp_path)))
    grpo = pipeline_config(study_config("argsort", 0, tmp_path, *arm_sections("argsort", "grpo", tmp_path))).grpo
    rft = study.rft
    assert (rft.prompts_per_step, rft.group_size, rft.sampler) == (grpo.prompts_per_step, grpo.group_size, grpo.sampler)
    assert rft.min_reward == 1.0  # verified correct


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
        ("[grpo.optim]\neps = 0.0\n", "grpo.optim.eps: expected a value > 0, got 0.0"),
        ("[sft.corruption]\nviews = 0\n", "sft.corruption.views: expected an int >= 1"),
        ("[rft]\nmin_reward = 1.5\n", "rft.min_reward: expected a reward in [0, 1], got 1.5"),
        ("[rft]\nprompts_per_step = 3\nmicrobatches = 2\ngroup_size = 1\n", "rft.microbatches: 2 does not divide"),
        ("[eval]\nsamples = 0\nbest_of = ['vote']\n", "eval.best_of: expected no rules while samples = 0"),
        # refused when the preset loads, not when the stage that reads them starts after others trained
        ("[grpo]\nsampler = { top_p = 1.5 }\n", "grpo.sampler.top_p: expected a number in (0, 1]"),
        ("[eval.sampler]\ntemperature = -1.0\n", "eval.sampler.temperature: expected 0 (greedy) or a finite number"),
        ("[opd.sampler]\nstrategy = 'steps'\nsteps_per_block = 0\n",
         "opd.sampler.steps_per_block: expected an int >= 1"),
        ("[grpo]\nepsilon_low = 1.5\n", "grpo.epsilon_low: expected a value in [0, 1), got 1.5"),
        ("[grpo.sampler]\ntemperature = 0\n", "grpo.sampler.temperature: expected > 0 (e.g. 1.0), got 0; greedy"),
        ("[mesh]\ndata = 3\n", "sft.batch_size: batch_size = 128 in 1 microbatch(es) gives 128 rows per microbatch, "
                              "which the mesh's data x fsdp = 3 devices must divide"),
        ("[mesh]\nmodel = 2\n[student]\nn_kv_heads = 1\n",
         "student.n_kv_heads: 1 does not divide the mesh's model = 2 devices it is split over"),
        ("[run]\nlog_every = 0\n", "run.log_every: expected an integer >= 1, got 0"),
        ("[run]\nmatmul_precision = 'float32'\n",
         "run.matmul_precision: expected one of ['default', 'high', 'highest'], got 'float32'"),
        ("[run]\nmax_to_keep = 0\n", "run.max_to_keep: expected an integer >= 1, got 0; max_to_keep = 0 would delete"),
        ("[run]\nallow_changes = ['sft.optim.lr']\n", "run.allow_changes: expected a fingerprint field under one of"),
        ("[run]\nallow_changes = ['training.grpo.optim.lrr']\n",
         "run.allow_changes: 'training.grpo.optim.lrr': [grpo.optim] has no key 'lrr'"),
        ("[run]\nallow_changes = ['identity.archtecture.d_model', 'identity.architecture.d_modl']\n",
         "run.allow_changes: 'identity.architecture.d_modl': a model's architecture has no key 'd_modl'"),
        ("[task]\nname = 'sort'\nparams = 4\n", "task.params: expected a table (e.g. { key = value }), got 4"),
        ("[sft]\nteacher_steps = -1\n", "sft.teacher_steps: expected a value > 0, got -1"),
        ("[grpo.optim]\nb2 = 1.0\n", "grpo.optim.b2: expected a decay in [0, 1), got 1.0"),
        ("[eval.sampler]\ntemperature = 1e-39\n", "a smaller one overflows float32 logits / temperature into NaN"),
    ],
)
def test_config_errors_name_the_key(text, message):
    with pytest.raises(ConfigError) as err:
        parse_pipeline_config(text)
    assert message in str(err.value)


def test_a_table_given_in_part_keeps_the_rest_of_its_own_default():
    """A key a table leaves out takes the value it has when the whole table is left out (the
    enclosing section's default), not its class's: setting one key never changes another."""
    whole = pipeline_config(parse_pipeline_config(""))
    assert (whole.grpo.optim.warmup_steps, whole.eval.sampler.temperature, whole.teacher.n_layers) == (0, 0.0, 3)
    config = pipeline_config(parse_pipeline_config(
        "[grpo.optim]\nlr = 1e-4\n[eval.sampler]\nthreshold = 0.7\n[teacher]\nremat = 'full'\n"
        "[opd]\noptim = { b2 = 0.95 }\n"))
    assert config.grpo.optim == dataclasses.replace(whole.grpo.optim, lr=1e-4)
    assert config.eval.sampler == dataclasses.replace(whole.eval.sampler, threshold=0.7)  # still greedy
    assert config.teacher == dataclasses.replace(whole.teacher, remat="full")
    assert config.opd.optim == dataclasses.replace(whole.opd.optim, b2=0.95)
    assert config.sft == whole.sft and config.student == whole.student


def test_adam_eps_reaches_the_optimizer():
    config = pipeline_config(parse_pipeline_config("[grpo.optim]\neps = 1e-3\nlr = 1e-4\n"))
    grpo, sft = Run.optimizer_config(config.grpo.optim, 10), Run.optimizer_config(config.sft.optim, 10)
    assert (grpo.eps, grpo.learning_rate) == (1e-3, 1e-4) and sft.eps == 1e-8


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
    how = Run(parse_pipeline_config(base.replace("[student]\n", "[student]\nattention = 'dense'\nremat = 'full'\n"
                                                               "logits_chunk = 64\n")))
    assert how.identity("student").digest == identity.digest
    assert how.model_config("student").logits_chunk == 64
    wider = Run(parse_pipeline_config(base.replace("[student]\nd_model = 16", "[student]\nd_model = 32")))
    # head_dim follows d_model / n_heads unless set, and is recorded resolved
    assert set(wider.identity("student").diff(identity)) == {"architecture.d_model", "architecture.d_ff",
                                                              "architecture.head_dim"}


def test_noisy_views_reach_the_sft_batches():
    from bd_train.stages import Run

    base = (ROOT / "flows" / "configs" / "smoke.toml").read_text()
    one, three = (Run(parse_pipeline_config(base + f"\n[sft.corruption]\nviews = {k}\n")) for k in (1, 3))
    canvas = one.config.canvas
    n, c = canvas.max_new_tokens, canvas.prompt_len + canvas.max_new_tokens
    assert next(one.sft_batches("sft-student")).shape[1] == c + n
    batch = next(three.sft_batches("sft-student"))
    assert batch.shape[1] == c + 3 * n and int(batch.layout.view_ids.max()) == 3
    assert set(three.training("sft-student").diff(one.training("sft-student"))) == {"sft.corruption.views"}


def test_rollout_semantics_pin_the_sampling_distribution():
    from bd_train.stages import Run

    setup = Run(parse_pipeline_config((ROOT / "flows" / "configs" / "smoke.toml").read_text()))
    grpo = setup.config.grpo.sampler
    hotter = setup.rollout_semantics(dataclasses.replace(grpo, temperature=1.5))
    assert set(hotter.diff(setup.rollout_semantics(grpo))) == {"temperature"}


def test_a_python_without_metaflow_is_told_how_to_run_the_flow(tmp_path):
    """A bare `python` in a fresh shell has no Metaflow: one message with the commands that work."""
    out = subprocess.run([sys.executable, "-S", str(FLOW), "show"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)  # -S: no site-packages, so no Metaflow
    assert out.returncode != 0
    assert "has no Metaflow" in out.stderr and "make run PRESET=smoke" in out.stderr, out.stderr
    assert ".venv/bin/python flows/bd_pipeline.py" in out.stderr and "Traceback" not in out.stderr, out.stderr


def make_dry_run(*args):
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    return subprocess.run(["make", "-n", "run", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "preset, config",
    [("smoke", "flows/configs/smoke.toml"), ("smoke.toml", "flows/configs/smoke.toml"),
     ("flows/configs/pretrained.toml", "flows/configs/pretrained.toml")],
)
def test_make_run_passes_the_preset_to_the_flow(preset, config):
    out = make_dry_run(f"PRESET={preset}")
    assert out.returncode == 0, out.stderr
    assert f"flows/bd_pipeline.py --config config {config} run --max-workers 2" in out.stdout, out.stdout


def test_make_run_takes_a_preset_file_anywhere(tmp_path):
    mine = tmp_path / "mine.toml"
    mine.write_text("[sft]\nsteps = 3\n")
    out = make_dry_run(f"PRESET={mine}")
    assert out.returncode == 0, out.stderr
    assert f"flows/bd_pipeline.py --config config {mine} run" in out.stdout, out.stdout


def test_plain_make_run_is_the_default_preset():
    out = make_dry_run()
    assert out.returncode == 0, out.stderr
    assert "flows/bd_pipeline.py run --max-workers 2" in out.stdout and "--config" not in out.stdout, out.stdout


def test_make_run_refuses_an_unknown_preset_before_anything_runs():
    out = make_dry_run("PRESET=smok")
    assert out.returncode != 0
    message = re.search(r"PRESET=smok: no such preset; give a name in flows/configs/ \((.*)\) or the path of a "
                        r"\.toml file", out.stderr)
    assert message and {"default", "smoke"} <= set(message.group(1).split()), out.stderr
    assert "bd_pipeline.py" not in out.stdout


@pytest.fixture
def flow_module(monkeypatch):
    """flows/bd_pipeline.py imported (its `__main__` block does not run); the variables it sets
    at import are put back afterwards."""
    for name in ("METAFLOW_USER", "WANDB_MODE", "PATH"):
        monkeypatch.setenv(name, os.environ.get(name, "tester" if name == "METAFLOW_USER" else "offline"))
    spec = importlib.util.spec_from_file_location("bd_pipeline_under_test", FLOW)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_end_names_every_card_by_stage_and_role_with_its_task(flow_module):
    """Teacher and student SFT are two tasks of the step `sft` with one card id; only the task's
    pathspec tells them apart, and each command names one."""
    cards = {"sft/teacher": "BDPipeline/17/sft/4", "sft/student": "BDPipeline/17/sft/5",
             "opd/student": "BDPipeline/17/opd/9", "grpo/student": "BDPipeline/17/grpo/12",
             "summary": "BDPipeline/17/end/14"}
    lines = flow_module.card_commands(cards).splitlines()
    command = ".venv/bin/python flows/bd_pipeline.py card get"
    assert lines[1:] == [
        f"  sft/teacher   {command} 17/sft/4 sft-teacher.html",
        f"  sft/student   {command} 17/sft/5 sft-student.html",
        f"  opd/student   {command} 17/opd/9 opd-student.html",
        f"  grpo/student  {command} 17/grpo/12 grpo-student.html",
        f"  summary       {command} 17/end/14 summary.html",
    ]


def test_a_run_folder_that_cannot_be_made_is_refused_by_key(tmp_path, capsys):
    """`[run] output_dir` under a file, and a `--run-id` that is not one folder name, are refused
    before anything runs, by name."""
    from bd_train.stages import RunDir, StageError
    from bd_train.stages.cli import main

    (tmp_path / "a_file").write_text("")
    config = parse_pipeline_config({"run": {"output_dir": str(tmp_path / "a_file" / "runs")}})
    with pytest.raises(StageError, match=r"^run\.output_dir: cannot create .*a_file/runs/pipeline/x' \(Not a "
                                         r"directory\); set \[run\] output_dir to a folder this process can write"):
        RunDir.create(config, run_id="x")
    preset = tmp_path / "p.toml"
    preset.write_text(f"[run]\noutput_dir = '{tmp_path / 'runs'}'\n")
    for run_id in ("", "../elsewhere", "a/b"):
        with pytest.raises(SystemExit) as exit_:
            main(["run", str(preset), "--run-id", run_id])
        assert exit_.value.code == 2 and f"--run-id {run_id!r}: a run id names one folder" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_the_stages_command_names_a_folder_given_as_a_preset_and_a_damaged_summary(tmp_path, capsys):
    from bd_train.stages.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", str(tmp_path)])
    assert exit_.value.code == 2 and "is a folder; give a preset's .toml file" in capsys.readouterr().err
    preset = tmp_path / "p.toml"
    preset.write_text(f"[run]\noutput_dir = '{tmp_path / 'runs'}'\n")
    (tmp_path / "runs" / "latest").mkdir(parents=True)
    (tmp_path / "runs" / "latest" / "summary.json").write_text("{cut short")
    assert main(["summary", str(preset)]) == 1
    assert "summary.json: not a summary this version can read (JSONDecodeError" in capsys.readouterr().err
