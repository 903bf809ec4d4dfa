"""The Metaflow pipeline run for real through the Runner API, on flows/configs/lora.toml: every
stage starts from a Hugging Face checkpoint folder (the tiny SDAR-format fixture) and is exported
back as one; the teacher is fine-tuned fully, the student trains LoRA adapters in every stage.
(tests/test_group.py runs the flow on 2 nodes, on models trained from scratch.)

One run is made to fail inside GRPO (after a checkpoint) and is finished by `resume`: that run
proves the whole flow, the import and the exports, the W&B offline logs, the cards and resume at
once. A second run adopts a teacher checkpoint with another block size and must fail closed at the
start, before anything trains.
"""

import base64
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from metaflow import Runner

from bd_core import ViewLayout
from bd_models import from_pretrained, read_hf_config
from bd_train import Checkpointer, make_optimizer
from bd_train.stages import Run, StageError, parse_pipeline_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "flows" / "configs" / "smoke.toml"
LORA = ROOT / "flows" / "configs" / "lora.toml"


def absolute_preset(preset: Path, out: Path) -> Path:
    """The preset with its checkpoint folders made absolute (the flow runs in a temp dir)."""
    lines = [f'pretrained = "{ROOT / line.split(chr(34))[1]}"' if line.startswith("pretrained = ") else line
             for line in preset.read_text().splitlines()]
    out.write_text("\n".join(lines) + "\n")
    assert Path(tomllib.loads(out.read_text())["student"]["pretrained"]).is_dir()
    return out


def wandb_records(path: Path):
    """Records of a W&B offline log (`run-*.wandb`): a LevelDB-style log of protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_runs(root: Path) -> list[dict]:
    runs = []
    for log in sorted(root.glob("runs/wandb/wandb/offline-run-*/run-*.wandb")):
        info = {"keys": set()}
        for record in wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                info.update(job_type=record.run.job_type, group=record.run.run_group, run_id=record.run.run_id)
            elif kind == "history":
                info["keys"] |= {item.key or "/".join(item.nested_key) for item in record.history.item}
        runs.append(info)
    return runs


EVAL = "[eval]\nsamples = 2\nthresholds = [0.5, 0.9]\n"  # pass@k and a curve, with fewer samplers to compile


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, flow_runs):
    """The LoRA flow (with a smaller evaluation: `EVAL`), crashed after GRPO update 2 (checkpoint
    saved), then `resume`."""
    cwd = tmp_path_factory.mktemp("pipeline")
    preset = absolute_preset(LORA, cwd / "lora.toml")
    preset.write_text(preset.read_text().replace("[eval]\n", EVAL))
    run, origin = flow_runs.crash_and_resume(preset, cwd, fault="grpo:2")
    return cwd, run, origin


def test_exports_read_back_with_the_trained_logits(resumed_run):
    cwd, _, _ = resumed_run
    config = parse_pipeline_config((cwd / "lora.toml").read_text())
    run_dir = next((cwd / "runs" / "pipeline").iterdir())
    assert sorted(p.name for p in (run_dir / "export").iterdir()) == ["grpo", "opd", "sft-student", "sft-teacher"]
    export = run_dir / "export" / "grpo"
    exported = from_pretrained(export)
    assert read_hf_config(export)["model_type"] == "sdar" and read_hf_config(export)["mask_token_id"] == 287
    assert (export / "tokenizer.json").is_file()
    setup = Run(config)
    # GRPO's checkpoint holds adapters only; its model is rebuilt on the chain of bases
    # (pretrained -> + SFT adapters -> + OPD adapters) and its own adapters merged
    trained = setup.restore_model(run_dir / "checkpoints" / "grpo", setup.model_config("student"),
                                  setup.identity("student"), what="grpo")
    with Checkpointer(run_dir / "checkpoints" / "grpo", create=False) as checkpoints:
        saved = checkpoints._manager.item_metadata(checkpoints.latest_step())["model"]
        names = {str(path[-1].key) for path, _ in jax.tree_util.tree_flatten_with_path(dict(saved))[0]}
        assert names == {"lora_a", "lora_b"}, names
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(exported), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    start = from_pretrained(config["student"]["pretrained"])
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(start)))
    assert moved > 1e-4  # the stages trained the imported weights
    ids = np.arange(2 * 16).reshape(2, 16) % 280
    pos = np.broadcast_to(np.arange(16), (2, 16))
    layout = ViewLayout(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(pos // 4), jnp.zeros((2, 16), jnp.int32),
                        jnp.ones((2, 16), bool))
    np.testing.assert_array_equal(np.asarray(trained(layout)), np.asarray(exported(layout)))
    assert from_pretrained(run_dir / "export" / "sft-teacher").config == exported.config


def test_adapters_on_another_base_are_refused_by_name(resumed_run, tmp_path):
    """The same architecture and tensor names (so the same identity), one weight changed: the
    base digest the adapters pinned tells them apart."""
    from safetensors.numpy import load_file, save_file

    cwd, _, _ = resumed_run
    config = parse_pipeline_config((cwd / "lora.toml").read_text())
    source = Path(config["student"]["pretrained"])
    changed = tmp_path / "sdar-changed"
    shutil.copytree(source, changed)
    file, tensors = next((f, t) for f in sorted(changed.glob("*.safetensors")) for t in [load_file(str(f))]
                         if any("mlp.up_proj" in k for k in t))
    name = next(k for k in tensors if "mlp.up_proj" in k)
    tensors[name] = tensors[name].copy()
    tensors[name].flat[0] += 0.5
    save_file(tensors, str(file), metadata={"format": "pt"})
    config["student"]["pretrained"] = str(changed)
    run_dir = next((cwd / "runs" / "pipeline").iterdir())
    setup = Run(config)
    assert setup.identity("student").fields["architecture"] == Run(
        parse_pipeline_config((cwd / "lora.toml").read_text())).identity("student").fields["architecture"]
    with pytest.raises(StageError, match="adapters.base_digest differs") as err:
        setup.restore_model(run_dir / "checkpoints" / "grpo", setup.model_config("student"), setup.identity("student"),
                            what="grpo")
    assert "sft-student" in str(err.value)  # the first link of the chain: the SFT adapters' pretrained base


def test_resume_continues_grpo_from_its_latest_checkpoint(resumed_run):
    _, run, origin = resumed_run
    grpo = run["grpo"].task.data.grpo_result
    steps = [row["step"] for row in grpo.history]
    assert steps == [2, 4, 6, 8], steps  # 4 rollouts x 2 updates; the curve keeps the one before the failure
    assert grpo.step == 8
    assert origin in grpo.checkpoint_dir  # checkpoints live under the origin run: stable across resume
    assert run["sft"].task.origin_pathspec is not None  # finished steps were cloned, not rerun


def test_resume_of_a_resumed_run_clones_what_finished(resumed_run, flow_runs):
    """`resume grpo` from the resumed run: SFT and OPD (cloned once already) are cloned again, not
    rerun (flows/bd_resume.py), and GRPO continues from its final checkpoint: nothing trains."""
    cwd, run, _ = resumed_run
    # W&B off: the other tests read this folder's logs of the crashed run and its resume
    with Runner(flow_runs.flow, show_output=False, cwd=str(cwd), env=flow_runs.env(WANDB_MODE="disabled")).resume(
            origin_run_id=run.id, step_to_rerun="grpo") as again:
        assert again.status == "successful", again.stdout[-3000:] + again.stderr[-3000:]
        rerun = again.run
        for name in ("sft", "sft_nodes", "opd", "opd_nodes"):
            assert all(task.origin_pathspec is not None for task in rerun[name]), name
        assert rerun["grpo"].task.origin_pathspec is None
        before, after = run["grpo"].task.data.grpo_result, rerun["grpo"].task.data.grpo_result
        assert after.step == before.step and after.history == before.history


def test_summary_table_is_kept_and_written(resumed_run):
    cwd, run, _ = resumed_run
    summary = run["end"].task.data.summary
    assert list(summary) == ["teacher_sft", "student_sft", "student_opd", "student_grpo"]
    for row in summary.values():
        assert row["n"] == 16 and 0.0 <= row["accuracy"] <= 1.0 and 0.0 <= row["mean_reward"] <= 1.0
        assert 0.0 <= row["pass@1"] <= row["pass@2"] <= 1.0 and "pass@4" not in row  # [eval] samples = 2
        assert row["params_trained"] <= row["params_total"]
        curve = row["accuracy_vs_nfe"]
        assert [p["decoding"] for p in curve] == ["τ 0.5", "τ 0.9", "one per step"]
        assert curve[-1]["nfe_per_token"] >= max(p["nfe_per_token"] for p in curve[:-1])
    assert summary["teacher_sft"]["params_trained"] == summary["teacher_sft"]["params_total"]  # full fine-tuning
    for row in ("student_sft", "student_opd", "student_grpo"):  # LoRA: the adapters of one stage
        assert summary[row]["params_trained"] < 0.5 * summary[row]["params_total"]
    # each stage's paired gain over the model it started from (GRPO: the one OPD's guard handed on)
    guard = summary["student_opd"]["guard"]
    assert guard["mode"] == "keep-best" and [p["step"] for p in guard["points"]] == [2, 3]  # checkpoint_every 2
    handed_on = "student_sft" if guard["kept"] == "start" else "student_opd"
    for row, over in (("student_opd", "student_sft"), ("student_grpo", handed_on)):
        gain = summary[row]["gain"]
        assert gain["over"] == over and set(gain) == {"over", "accuracy", "mean_reward", "pass@1", "pass@2"}
        assert all(gain[k]["low"] <= gain[k]["estimate"] <= gain[k]["high"] for k in gain if k != "over")
    assert "gain" not in summary["teacher_sft"] and "gain" not in summary["student_sft"]
    assert json.loads((cwd / "runs" / "latest" / "summary.json").read_text()) == summary
    # what `make run` prints after the flow: the latest run's tables for the preset
    shown = subprocess.run([sys.executable, "-m", "bd_train.stages", "summary", "lora.toml"], cwd=cwd,
                           capture_output=True, text=True, check=True).stdout
    teacher = next(line for line in shown.splitlines() if line.startswith("teacher_sft")).split()
    assert float(teacher[1]) == pytest.approx(summary["teacher_sft"]["accuracy"], abs=5e-4)
    missing = subprocess.run([sys.executable, "-m", "bd_train.stages", "summary", "lora.toml"], cwd=cwd / "runs",
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "lora.toml: no such preset file" in missing.stderr


def test_wandb_offline_logs_hold_the_stage_metrics(resumed_run):
    cwd, _, origin = resumed_run
    runs = wandb_runs(cwd)
    by_stage, run_ids, attempts = {}, {}, {}
    for info in runs:
        assert info["group"] == origin
        by_stage.setdefault(info["job_type"], set()).update(info["keys"])
        run_ids.setdefault(info["job_type"], set()).add(info["run_id"])
        attempts[info["job_type"]] = attempts.get(info["job_type"], 0) + 1
    assert set(by_stage) == {"sft-teacher", "sft-student", "opd", "grpo"}
    # the crashed GRPO attempt and its resume log into one W&B run; every stage has its own
    assert attempts["grpo"] == 2 and all(len(ids) == 1 for ids in run_ids.values()), (attempts, run_ids)
    assert len(set().union(*run_ids.values())) == 4
    common = {"loss", "grad_norm", "learning_rate", "tokens", "skipped_total", "eval/accuracy", "eval/mean_reward"}
    for stage, keys in by_stage.items():
        assert common <= keys, (stage, common - keys)
    assert {"kl", "teacher_agreement", "nfe_per_token", "guard/accuracy", "guard/change_low"} <= by_stage["opd"]
    for stage in ("opd", "grpo"):  # the paired gain over the model the stage started from
        assert {"eval/gain/accuracy", "eval/gain/accuracy_low", "eval/gain/accuracy_high"} <= by_stage[stage]
    assert {"reward_mean", "reward_std", "rollout_accuracy", "kl", "clip_fraction", "ratio_mean", "entropy",
            "nfe_per_token", "completion_length", "ratio_first_update"} <= by_stage["grpo"]


def test_cards_show_curves_eval_samples_and_a_trace(resumed_run, flow_runs):
    cwd, run, _ = resumed_run
    out = cwd / "grpo_card.html"
    env = {**os.environ, **flow_runs.env()}
    done = subprocess.run([sys.executable, flow_runs.flow, "card", "get", f"{run.id}/grpo", str(out)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # The card's components are embedded in the page as base64 JSON.
    encoded = re.search(r'window.__MF_DATA__\["[^"]+"\] = "([^"]+)"', out.read_text()).group(1)
    card = base64.b64decode(encoded).decode()
    for text in ("Held-out evaluation", "Sample completions", "denoising trace", "mean_reward", "pass@2",
                 "Accuracy vs NFE", "one per step", "trained parameters", "Gain over"):
        assert text in card
    assert card.count('"type": "image"') == 3  # training curves, accuracy vs NFE and the trace picture
    summary_card = cwd / "summary_card.html"
    done = subprocess.run([sys.executable, flow_runs.flow, "card", "get", f"{run.id}/end", str(summary_card)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    encoded = re.search(r'window.__MF_DATA__\["[^"]+"\] = "([^"]+)"', summary_card.read_text()).group(1)
    card = base64.b64decode(encoded).decode()
    for text in ("Held-out summary", "pass@2", "Accuracy @ NFE per token", "student_grpo", "one per step",
                 "trained params", "Gain over the previous stage", "paired 95% bootstrap interval", "OPD guard"):
        assert text in card
    assert card.count('"type": "image"') == 1  # the four models' accuracy-vs-NFE curves

    # one card per stage and role: `end` prints the exact command of each, the teacher's SFT card included
    cards = run["end"].task.data.cards
    assert set(cards) == {"sft/teacher", "sft/student", "opd/student", "grpo/student", "summary"}
    stdout = run["end"].task.stdout
    teacher_card = cwd / "sft_teacher_card.html"
    for role in ("teacher", "student"):
        assert f"card get {cards[f'sft/{role}'].split('/', 1)[1]} sft-{role}.html" in stdout
    done = subprocess.run([sys.executable, flow_runs.flow, "card", "get", cards["sft/teacher"].split("/", 1)[1],
                           str(teacher_card)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    encoded = re.search(r'window.__MF_DATA__\["[^"]+"\] = "([^"]+)"', teacher_card.read_text()).group(1)
    card = base64.b64decode(encoded).decode()
    assert "sft-teacher" in card and "sft-student" not in card


def test_first_grpo_update_has_ratio_one(resumed_run):
    _, run, _ = resumed_run
    history = run["grpo"].task.data.grpo_result.history
    for row in history:
        assert abs(row["ratio_first_update"] - 1.0) <= 1e-5
        assert row["clip_fraction_first_update"] == 0.0


def test_teacher_with_another_block_size_fails_closed_at_the_start(tmp_path, flow_runs):
    # A real SFT checkpoint of a teacher trained with block size 8.
    text = SMOKE.read_text().replace("block_size = 4", "block_size = 8")
    other = Run(parse_pipeline_config(text))
    optimizer = make_optimizer(other.optimizer_config(other.config.sft.optim, 10))
    state = other.fresh_state(other.model_config("teacher"), optimizer, key=jax.random.key(0))
    teacher_dir = tmp_path / "teacher-b8"
    with Checkpointer(teacher_dir) as checkpoints:
        checkpoints.save(state, fingerprints={"identity": other.identity("teacher")})
    preset = tmp_path / "adopt.toml"
    preset.write_text(SMOKE.read_text().replace("[teacher]\n", f"[teacher]\ncheckpoint = '{teacher_dir}'\n"))
    with Runner(flow_runs.flow, show_output=False, cwd=str(tmp_path), env=flow_runs.env(),
                config=[("config", str(preset))]).run(max_workers=2) as running:
        assert running.status == "failed"
        log = running.stdout + running.stderr
    assert "/start/" in log and "block_size: saved 8, current 4" in log, log[-3000:]  # before any training
    assert "/sft/" not in log
    assert "The teacher must use the config's tokenizer, block size and canvas" in log
