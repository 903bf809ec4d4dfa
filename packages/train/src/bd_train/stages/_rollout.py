"""One rollout helper for OPD, GRPO, RFT and evaluation: sample on the mesh, gather the per-row
arrays once, decode, score the rewards, count NFE; the group rollouts GRPO and RFT sample, and
GRPO's batch built from them (replay, advantages), shared by the stage and by studies of its
gradient.

On a mesh the prompts are split over its data axes (across processes too) and the sharded model
samples them; the trace stays on the mesh for replay, and only the small per-row arrays
(completion tokens and flags, NFE) are gathered, so every process scores every row the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from bd_core import DiffusionTrace, RolloutOutput
from bd_data import Example, PromptBatch
from bd_models import SamplerConfig, decode_completions, sample, shard_batch, to_host, token_logprobs

from .._grpo import GRPOBatch, GRPOConfig, compute_advantages
from .._replay import build_replay, replay_capacity

if TYPE_CHECKING:
    from ._run import Run


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """A sampled batch: `rollout` as sampled (on the mesh, with its trace), and on the host the
    scored rows' `texts` and `rewards` plus every row's `nfe` and `generated` token counts;
    `host` is the rollout's per-row arrays on the host (every row, no trace).

    Attributes:
        rollout: the sampled batch with its trace.
        texts: the decoded completions of the scored rows.
        rewards: their rewards.
        nfe: forward passes per row.
        generated: generated tokens per row.
        host: the rollout's per-row arrays on the host (every row, no trace).
    """

    rollout: RolloutOutput
    texts: list[str]
    rewards: np.ndarray
    nfe: np.ndarray
    generated: np.ndarray
    host: RolloutOutput = dataclasses.field(repr=False)

    def sequence_logprobs(self) -> np.ndarray:
        """Per scored row, the sum of its committed tokens' log-probs as the exact trace recorded
        them (under the distribution sampled): the model's own confidence in the sample."""
        if self.rollout.trace is None:
            raise ValueError("sequence_logprobs: this rollout kept no trace")
        return to_host(_sequence_logprobs(self.rollout.trace))[:len(self.texts)]

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
    return Rollouts(rollout, texts, rewards, per_row.nfe[:rows], per_row.completion_valid[:rows].sum(axis=1),
                    per_row)


@jax.jit
def _sequence_logprobs(trace: DiffusionTrace) -> jax.Array:
    return jnp.sum(jnp.where(trace.committed, trace.logprobs, 0.0), axis=(1, 2))


@eqx.filter_jit
def _reference_logprobs(model, batch, distribution):
    """The reference's log-probs for the KL: under the sampling distribution without top-k or
    top-p, as the policy's side of the KL is scored (`distribution_score(..., kl=True)`)."""
    return token_logprobs(model, batch, distribution.without_filters())[0]


def grpo_config(run: Run) -> GRPOConfig:
    """The objective `[grpo]` configures."""
    section = run.config.grpo
    return GRPOConfig(advantage=section.advantage, ratio=section.ratio, aggregation=section.aggregation,
                      epsilon_low=section.epsilon_low, epsilon_high=section.epsilon_high, beta=section.beta,
                      norm_length=run.config.canvas.max_new_tokens)


def group_rollouts(run: Run, model: Any, prompts: PromptBatch, group: int, sampler: SamplerConfig, *,
                   key: jax.Array, mesh: jax.sharding.Mesh | None) -> Rollouts:
    """`group` rollouts of each prompt by `model` at `sampler`, scored (rows prompt by prompt)."""
    repeat = lambda x: np.repeat(x, group, 0)  # noqa: E731
    return roll_out(model, (repeat(prompts.tokens), repeat(prompts.valid)),
                    [e for e in prompts.examples for _ in range(group)], sampler, tokenizer=run.tokenizer,
                    reward=run.reward, key=key, mesh=mesh)


def rollout_batch(run: Run, model: Any, prompts: PromptBatch, *, key: jax.Array, mesh: jax.sharding.Mesh | None,
                  reference: Any = None) -> tuple[GRPOBatch, Rollouts]:
    """One GRPO batch: `[grpo] group_size` rollouts of each prompt by `model` at `[grpo] sampler`,
    scored, replayed and given group advantages (and the `reference` model's log-probs when given),
    placed on the mesh; with the rollouts themselves."""
    section, group = run.config.grpo, run.config.grpo.group_size
    sampler = run.sampler_config(section.sampler)
    out = group_rollouts(run, model, prompts, group, sampler, key=key, mesh=mesh)
    replay = build_replay(out.rollout, mask_id=run.tokenizer.mask_id, num_views=replay_capacity(sampler))
    ref_logp = None if reference is None else _reference_logprobs(reference, replay.batch, sampler.distribution)
    advantages = compute_advantages(out.rewards.astype(np.float32), group, section.advantage,
                                    eps=grpo_config(run).advantage_eps)
    return on_mesh(GRPOBatch(replay.batch, replay.recorded_logprobs, advantages, ref_logp), mesh), out
