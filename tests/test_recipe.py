"""The SDAR-Chat recipe (`flows/configs/sdar_1p7b_chat.toml`, docs/guides/sdar-chat.md) as it is
written — Hub repo ids, the math task with the tokenizer's own chat template, a LoRA teacher, the
chunked logits, export — runs every stage to its summary. The released checkpoints are replaced by
the tiny SDAR-format fixture with a ChatML template, in a Hub cache under the same repo ids
(offline); only what a CPU cannot run, or would run for hours, is changed: the attention (`pallas`
is the GPU's kernel), the steps and the batch sizes. The v5e-8 preset is the same recipe with
XLA's `blocked` attention over 8 chips."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

from bd_train.stages import RunDir, parse_pipeline_config, pipeline_config
from bd_train.stages.cli import run_chain

ROOT = Path(__file__).resolve().parents[1]
GPU, V5E8 = (ROOT / "flows" / "configs" / f"{name}.toml" for name in ("sdar_1p7b_chat", "sdar_1p7b_chat_v5e8"))
TEACHER, STUDENT = "JetLM/SDAR-8B-Chat", "JetLM/SDAR-1.7B-Chat"
COMMIT = "c" * 40


def _released(hub_cache) -> None:
    """Both repo ids in the Hub cache: the SDAR fixture's weights with the ChatML fixture's tokenizer
    (whose `tokenizer_config.json` holds a chat template, as SDAR-Chat's does)."""
    for repo in (TEACHER, STUDENT):
        hub_cache("sdar", repo, COMMIT, tokenizer_from="chatml")


def test_the_recipe_runs_every_stage_from_hub_ids_with_the_chat_template(hub_cache, tmp_path, monkeypatch):
    _released(hub_cache)
    data = tomllib.loads(GPU.read_text())
    for role in ("teacher", "student"):
        data[role]["attention"] = "blocked"  # pallas: GPU only
    data["task"]["params"] = {key: str(ROOT / value) if key.endswith("path") else value
                              for key, value in data["task"]["params"].items()}
    data["sft"].update(steps=2, batch_size=8, microbatches=2)
    data["opd"].update(steps=2, prompts_per_step=4, microbatches=2)
    data["grpo"].update(steps=2, prompts_per_step=2, group_size=4, microbatches=2)
    data["canvas"].update(max_new_tokens=16)  # the prompt keeps its 128 tokens: the template is long
    data["eval"] = {"n": 4, "batch_size": 4, "samples": 0, "thresholds": []}
    data["run"].update(output_dir=str(tmp_path / "runs"), checkpoint_every=1)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    config = parse_pipeline_config(data)
    results = run_chain(config, RunDir.create(config, run_id="recipe"))

    assert list(results) == ["sft-teacher", "sft-student", "opd", "grpo"]
    for name, result in results.items():
        repo = TEACHER if result.role == "teacher" else STUDENT
        assert result.identity["fields"]["pretrained_source"] == {"repo_id": repo, "revision": "main",
                                                                  "commit": COMMIT}, name
        assert result.evaluation is not None and result.step > 0
        export = Path(result.export_dir)  # a Hugging Face checkpoint that names its source and template
        assert json.loads((export / "bdlm_source.json").read_text())["pretrained"]["repo_id"] == repo
        assert "<|im_start|>" in (export / "chat_template.jinja").read_text()
    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    assert summary


def test_the_v5e8_preset_is_the_gpu_recipe_on_tpu(hub_cache, monkeypatch):
    """Only the attention and the mesh differ between the two recipe presets."""
    _released(hub_cache)
    monkeypatch.chdir(ROOT)  # the presets' data paths are relative to the repository
    gpu, tpu = (pipeline_config(parse_pipeline_config(path.read_text())).to_dict() for path in (GPU, V5E8))
    assert (gpu["teacher"]["attention"], tpu["teacher"]["attention"]) == ("pallas", "blocked")
    assert (gpu["mesh"]["fsdp"], tpu["mesh"]["fsdp"]) == (1, 8)
    for config in (gpu, tpu):
        for role in ("teacher", "student"):
            config[role].pop("attention")
        config.pop("mesh")
    assert gpu == tpu
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # nothing above reached the Hub
