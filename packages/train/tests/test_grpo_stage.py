"""GRPO's rollout batch as the stage builds it, with a KL reference and a top-k sampler."""

from __future__ import annotations

import tomllib
from pathlib import Path

import jax
import numpy as np

from bd_models import BlockDiffusionLM
from bd_train import distribution_score, make_grpo_loss
from bd_train.stages import Run, grpo_config, parse_pipeline_config, rollout_batch

SMOKE = Path(__file__).resolve().parents[3] / "flows" / "configs" / "smoke.toml"


def test_a_top_k_sampler_with_a_kl_reference_gives_a_finite_loss(tmp_path):
    """The reference's filter drops tokens the policy sampled (two unrelated models, top-2 of the
    vocabulary): the stage scores the reference without the filter, as the loss scores the policy's
    side of the KL, so the KL is finite, positive, and the update's loss and gradient are finite."""
    data = tomllib.loads(SMOKE.read_text())
    data["grpo"].update(beta=0.1, sampler={"temperature": 1.0, "top_k": 2})
    data["run"]["output_dir"] = str(tmp_path)
    run = Run(parse_pipeline_config(data))
    config = run.model_config("student")
    policy, reference = (BlockDiffusionLM(config, key=jax.random.key(seed)) for seed in (0, 1))
    batch, _ = rollout_batch(run, policy, next(run.prompts("grpo", 4)), key=jax.random.key(2), mesh=None,
                             reference=reference)
    assert batch.ref_logp is not None and np.isfinite(np.asarray(batch.ref_logp)).all()
    distribution = run.sampler_config(run.config.grpo.sampler).distribution
    loss_fn = make_grpo_loss(grpo_config(run), distribution_score(distribution, kl=True))
    out = loss_fn(policy, batch)
    grads = jax.grad(lambda m: loss_fn(m, batch).loss.compute())(policy)
    assert np.isfinite(float(out.loss.compute())) and float(out.aux["kl"].compute()) > 0
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
