"""The Metaflow pipeline on flows/configs/pretrained.toml: SFT -> OPD -> GRPO starting from a
Hugging Face checkpoint folder (the tiny SDAR-format fixture), every stage exported back as a
Hugging Face checkpoint that reads back with the trained model's logits."""

from __future__ import annotations

import tomllib
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from metaflow import Runner

from bd_core import ViewLayout
from bd_models import BlockDiffusionLM, from_pretrained, read_hf_config
from bd_train import Checkpointer
from bd_train.stages import Run, parse_pipeline_config

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "flows" / "configs" / "pretrained.toml"


def _absolute(preset: Path, out: Path) -> Path:
    """The preset with its checkpoint folders made absolute (the flow runs in a temp dir)."""
    lines = [f'pretrained = "{ROOT / line.split(chr(34))[1]}"' if line.startswith("pretrained = ") else line
             for line in preset.read_text().splitlines()]
    out.write_text("\n".join(lines) + "\n")
    assert Path(tomllib.loads(out.read_text())["student"]["pretrained"]).is_dir()
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory, flow_runs):
    cwd = tmp_path_factory.mktemp("pretrained")
    preset = _absolute(PRESET, cwd / "pretrained.toml")
    with Runner(flow_runs.flow, show_output=False, cwd=str(cwd), env=flow_runs.env(),
                config=[("config", str(preset))]).run(max_workers=2) as result:
        assert result.status == "successful", result.stdout[-3000:] + result.stderr[-3000:]
        return cwd, result.run, preset


def test_every_stage_runs_on_the_imported_checkpoint(finished):
    _, run, _ = finished
    summary = run["end"].task.data.summary
    assert list(summary) == ["teacher_sft", "student_sft", "student_opd", "student_grpo"]
    for row in summary.values():
        assert row["n"] == 16 and 0.0 <= row["accuracy"] <= 1.0


def test_exports_read_back_with_the_trained_logits(finished):
    cwd, _, preset = finished
    config = parse_pipeline_config(preset.read_text())
    run_dir = next((cwd / "runs" / "pipeline").iterdir())
    assert sorted(p.name for p in (run_dir / "export").iterdir()) == ["grpo", "opd", "sft-student", "sft-teacher"]
    export = run_dir / "export" / "grpo"
    exported = from_pretrained(export)
    assert read_hf_config(export)["model_type"] == "sdar" and read_hf_config(export)["mask_token_id"] == 287
    setup = Run(config)
    target = eqx.filter_eval_shape(BlockDiffusionLM, setup.model_config("student"), key=jax.random.key(0))
    checkpoints = Checkpointer(run_dir / "checkpoints" / "grpo", create=False)
    trained = checkpoints.restore_model(target, fingerprints={"identity": setup.identity("student")})
    checkpoints.close()
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
    assert (export / "tokenizer.json").is_file()
    assert from_pretrained(run_dir / "export" / "sft-teacher").config == exported.config

