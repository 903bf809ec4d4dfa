"""The pipeline stages on a (data 2, fsdp 2, model 2) mesh of 8 virtual devices, without Metaflow:
SFT gives the single-device losses, and OPD and GRPO run sharded with exact replay (ratio 1)."""

from pathlib import Path

import jax
import numpy as np
import pytest

from bd_train.stages import (PipelineContext, StageError, StageResult, parse_pipeline_config, run_grpo, run_opd,
                             run_sft)

SMOKE = Path(__file__).resolve().parents[1] / "flows" / "configs" / "smoke.toml"

pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs the 8 virtual CPU devices of conftest.py")


def config(mesh: str) -> dict:
    return parse_pipeline_config(SMOKE.read_text() + f"\n[mesh]\n{mesh}\n")


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("mesh"))  # runs/ (checkpoints, W&B) lands in the temp dir
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("BDLM_PROGRESS", "0")
        sharded = config("data = 2\nfsdp = 2\nmodel = 2")
        context = PipelineContext.create(sharded, run_id="mesh")
        teacher = run_sft(sharded, context, role="teacher")
        student = run_sft(sharded, context, role="student")
        opd = run_opd(sharded, context, teacher=teacher, student=student)
        grpo = run_grpo(sharded, context, start=opd)
        single = config("data = 1")
        reference = run_sft(single, PipelineContext.create(single, run_id="single"), role="student")
    return student, opd, grpo, reference


def test_sharded_sft_matches_the_single_device_losses(stages):
    student, _, _, reference = stages
    sharded = [row["loss"] for row in student.history]
    single = [row["loss"] for row in reference.history]
    assert len(sharded) == len(single) == 6
    np.testing.assert_allclose(sharded, single, rtol=1e-5)


def test_opd_and_grpo_run_sharded_with_exact_replay(stages):
    _, opd, grpo, _ = stages
    assert opd.step == 3 and np.isfinite([row["kl"] for row in opd.history]).all()
    assert grpo.step == 8
    for row in grpo.history:
        assert abs(row["ratio_first_update"] - 1.0) <= 1e-5 and row["clip_fraction_first_update"] == 0.0
    assert 0.0 <= grpo.evaluation["accuracy"] <= 1.0 and grpo.evaluation["n"] == 16


def test_rollout_stages_refuse_to_start_across_processes(monkeypatch, tmp_path):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    context = PipelineContext(run_id="x", flow_name="BDPipeline", run_dir=str(tmp_path))
    result = StageResult(stage="sft-student", role="student", checkpoint_dir=str(tmp_path), step=0, identity={},
                         history=[], evaluation={}, samples=[])
    with pytest.raises(StageError, match=r"OPD: runs in one process for now \(2 joined\)"):
        run_opd(config("data = 1"), context, teacher=result, student=result)
    with pytest.raises(StageError, match=r"GRPO: runs in one process for now \(2 joined\)"):
        run_grpo(config("data = 1"), context, start=result)
