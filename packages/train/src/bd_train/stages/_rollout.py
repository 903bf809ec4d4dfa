"""One rollout helper for OPD, GRPO and evaluation: sample on the mesh, gather the per-row
arrays once, decode, score the rewards, count NFE.

On a mesh the prompts are split over its data axes (across processes too) and the sharded model
samples them; the trace stays on the mesh for replay, and only the small per-row arrays
(completion tokens and flags, NFE) are gathered, so every process scores every row the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from bd_core import RolloutOutput
from bd_data import Example
from bd_models import SamplerConfig, decode_completions, sample, shard_batch, to_host


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """A sampled batch: `rollout` as sampled (on the mesh, with its trace), and on the host the
    scored rows' `texts` and `rewards` plus every row's `nfe` and `generated` token counts."""

    rollout: RolloutOutput
    texts: list[str]
    rewards: np.ndarray
    nfe: np.ndarray
    generated: np.ndarray

    @property
    def nfe_per_token(self) -> float:
        return float(self.nfe.sum() / max(1, self.generated.sum()))

    def metrics(self) -> dict[str, float]:
        """The per-step rollout metrics a stage logs (rewards reduced in float32, as trained on)."""
        rewards = self.rewards.astype(np.float32)
        return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
                "rollout_accuracy": float(np.mean(rewards == 1.0)),
                "completion_length": float(np.mean([len(t) for t in self.texts])),
                "nfe_per_token": self.nfe_per_token, "tokens": float(self.generated.sum())}


def on_mesh(batch: Any, mesh: jax.sharding.Mesh | None) -> Any:
    """A batch placed over the mesh's data axes (unchanged without a mesh). Every process passes
    the same global batch; arrays computed on the mesh are resharded as they are."""
    return batch if mesh is None else shard_batch(batch, mesh)


def roll_out(model: Any, prompts: tuple[np.ndarray, np.ndarray], examples: Sequence[Example],
             sampler: SamplerConfig, *, tokenizer: Any, reward: Callable[[Example, str], float], key: jax.Array,
             mesh: jax.sharding.Mesh | None) -> Rollouts:
    """Sample every prompt row (tokens, valid) with `sampler`; the first `len(examples)` rows are
    decoded and scored with `reward` (further rows are padding, kept out of the numbers)."""
    rollout = sample(model, on_mesh(prompts, mesh), sampler, key=key)
    rows = len(examples)
    per_row = to_host(dataclasses.replace(rollout, trace=None))  # the per-row arrays, gathered once
    texts = decode_completions(tokenizer, per_row, stop_ids=sampler.stop_ids)[:rows]
    rewards = np.asarray([reward(e, t) for e, t in zip(examples, texts)], np.float64)
    return Rollouts(rollout, texts, rewards, per_row.nfe[:rows], per_row.completion_valid[:rows].sum(axis=1))
