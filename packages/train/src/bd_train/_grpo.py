"""GRPO-family objective over replayed diffusion traces, as one numerator/denominator pair.

Per action token: a clipped importance-ratio objective (token or `gspo-token` sequence ratio,
DAPO's `epsilon_low/high`), plus β·k3 KL to a reference. Aggregations are written as sums over
tokens and sequences so microbatch accumulation stays exact. Legend: B rows, T packed tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from bd_core import DiffusionTokenBatch, LossOutput, MaxMetric, RolloutOutput, WeightedMetric, config_error
from bd_models import SamplingDistribution, TokenScores, token_scores

ArrayLike = Array | np.ndarray
Advantage = Literal["grpo", "drgrpo", "rloo"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """`ratio`: `token` (per-token ratios) or `gspo-token` (the sequence's geometric-mean ratio,
    with per-token gradients). `aggregation`: `token-mean` (Σ over all tokens / tokens),
    `seq-mean-token-mean` (mean over sequences of per-sequence token means) or
    `seq-mean-token-sum-norm` (Dr. GRPO: per-sequence token sums / `norm_length`, mean over
    sequences). `beta` weighs the k3 KL to the reference policy.

    Attributes:
        advantage: `grpo`, `drgrpo` or `rloo`.
        ratio: `token` or `gspo-token` (see above).
        aggregation: how token losses combine (see above).
        epsilon_low: the ratio's lower clip, 1 − epsilon_low.
        epsilon_high: the ratio's upper clip, 1 + epsilon_high.
        beta: weight of the k3 KL to the reference policy (0: off).
        norm_length: the fixed length of `seq-mean-token-sum-norm` (default: the completion length).
        advantage_eps: added to the group's standard deviation before dividing.
    """

    advantage: Advantage = "grpo"
    ratio: Literal["token", "gspo-token"] = "token"
    aggregation: Aggregation = "token-mean"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    norm_length: int | None = None
    advantage_eps: float = 1e-4

    def __post_init__(self):
        def fail(field, expected, fix):
            raise config_error("GRPOConfig", field, getattr(self, field), expected, fix)

        if self.advantage not in ("grpo", "drgrpo", "rloo"):
            fail("advantage", "one of 'grpo', 'drgrpo', 'rloo'", None)
        if self.ratio not in ("token", "gspo-token"):
            fail("ratio", "'token' or 'gspo-token'", None)
        if self.aggregation not in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            fail("aggregation", "'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum-norm'", None)
        if not 0 <= self.epsilon_low < 1:
            fail("epsilon_low", "a value in [0, 1)", "use e.g. 0.2")
        if not self.epsilon_high >= 0:
            fail("epsilon_high", "a value >= 0", "use e.g. 0.2 or 0.28 (clip-higher)")
        if not self.beta >= 0:
            fail("beta", "a value >= 0", "use 0 to drop the KL term")
        if self.aggregation == "seq-mean-token-sum-norm" and (self.norm_length is None or self.norm_length < 1):
            fail("norm_length", "a positive constant with aggregation='seq-mean-token-sum-norm'",
                 "set it to the maximum number of completion tokens")
        if not self.advantage_eps > 0:
            fail("advantage_eps", "a value > 0", "use e.g. 1e-4")


def compute_advantages(rewards: Float[ArrayLike, " B"], group_size: int, kind: Advantage = "grpo", *,
                       eps: float = 1e-4) -> Float[Array, " B"]:
    """Group-relative advantages; rows are consecutive groups of `group_size` samples of a prompt.

    `grpo`: (r − mean) / (std + eps) with the unbiased std; `drgrpo`: r − mean; `rloo`: r minus the
    mean of the other samples of the group.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    (b,) = rewards.shape
    if group_size < 1 or b % group_size:
        raise ValueError(f"compute_advantages: {b} rewards do not form groups of group_size={group_size}; "
                         "pass the rewards of whole groups")
    if kind in ("grpo", "rloo") and group_size < 2:
        raise ValueError(f"compute_advantages: kind={kind!r} compares samples of a prompt and needs group_size >= 2")
    grouped = rewards.reshape(b // group_size, group_size)
    centered = grouped - jnp.mean(grouped, axis=1, keepdims=True)
    if kind == "grpo":
        out = centered / (jnp.std(grouped, axis=1, ddof=1, keepdims=True) + eps)
    elif kind == "drgrpo":
        out = centered
    elif kind == "rloo":
        out = centered * group_size / (group_size - 1)
    else:
        raise ValueError(f"compute_advantages: unknown kind {kind!r}; use 'grpo', 'drgrpo' or 'rloo'")
    return out.reshape(b)


def grpo_objective(new_logp: Float[Array, "B T"], old_logp: Float[ArrayLike, "B T"], mask: Any,
                   advantages: Float[ArrayLike, " B"], config: GRPOConfig, *, ref_logp: Any = None,
                   entropy: Any = None, kl_logp: Any = None) -> LossOutput:
    """The clipped surrogate (negated, to minimize) over action tokens `mask > 0`.

    `old_logp` are the rollout's recorded log-probs, `ref_logp` the reference policy's (needed
    when `beta > 0`), `entropy` the policy's per-token entropy (reported only). The KL compares
    `ref_logp` with `kl_logp`, the policy's log-probs under the same distribution as the
    reference's (default `new_logp`). With a top-k or top-p sampler both must be scored without
    the filters (`SamplingDistribution.without_filters`, `distribution_score(..., kl=True)`): a
    token one model's filter keeps and the other's drops would have an infinite log-ratio.
    A token the policy's filter has dropped since the rollout (a later update of the same
    rollout) has ratio 0; `replay_drift` leaves it out and `dropped_by_filter` counts it.
    """
    m = jnp.asarray(mask, jnp.float32)
    active = m > 0
    old_logp = jax.lax.stop_gradient(jnp.asarray(old_logp, jnp.float32))
    new_logp = new_logp.astype(jnp.float32)
    log_ratio = jnp.where(active, new_logp - old_logp, 0.0)
    tokens_per_row = jnp.sum(m, axis=1)
    has_tokens = tokens_per_row > 0
    safe_len = jnp.where(has_tokens, tokens_per_row, 1.0)
    if config.ratio == "gspo-token":
        seq_log_ratio = jnp.sum(m * log_ratio, axis=1) / safe_len
        # Value: the sequence ratio; gradient: each token's own log-prob (GSPO-token).
        log_ratio = jnp.where(active, jax.lax.stop_gradient(seq_log_ratio)[:, None] + new_logp
                              - jax.lax.stop_gradient(new_logp), 0.0)
    ratio = jnp.exp(log_ratio)
    adv = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))[:, None]
    low, high = 1.0 - config.epsilon_low, 1.0 + config.epsilon_high
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, low, high) * adv)
    per_token = -surrogate
    aux: dict[str, Any] = {}
    count = jnp.sum(m)
    if ref_logp is not None:
        kl_logp = new_logp if kl_logp is None else jnp.asarray(kl_logp, jnp.float32)
        delta = jnp.where(active, jax.lax.stop_gradient(jnp.asarray(ref_logp, jnp.float32)) - kl_logp, 0.0)
        # k3 = r − log r − 1 with r = π_ref / π: non-negative, and an unbiased estimate of KL(π ‖ π_ref)
        # for tokens drawn from π (the first update of a rollout)
        kl = jnp.exp(delta) - delta - 1.0
        per_token = per_token + config.beta * kl
        aux["kl"] = WeightedMetric(jnp.sum(m * kl), count)
    elif config.beta > 0:
        raise ValueError("grpo_objective: GRPOConfig.beta > 0 needs ref_logp= (the reference policy's log-probs)")
    per_token = jnp.where(active, per_token, 0.0)

    if config.aggregation == "token-mean":
        loss = WeightedMetric(jnp.sum(m * per_token), count)
    else:
        row_sum = jnp.sum(m * per_token, axis=1)
        norm = safe_len if config.aggregation == "seq-mean-token-mean" else cast(int, config.norm_length)  # validated
        row = row_sum / norm
        loss = WeightedMetric(jnp.sum(jnp.where(has_tokens, row, 0.0)), jnp.sum(has_tokens.astype(jnp.float32)))

    clipped = ((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0))
    kept = active & jnp.isfinite(new_logp)  # not dropped by the policy's top-k / top-p since the rollout
    aux.update(
        ratio_mean=WeightedMetric(jnp.sum(m * ratio), count),
        ratio_max=MaxMetric(jnp.max(jnp.where(active, ratio, -jnp.inf), initial=0.0)),
        clip_fraction=WeightedMetric(jnp.sum(m * clipped), count),
        replay_drift=WeightedMetric(jnp.sum(jnp.where(kept, m * jnp.abs(new_logp - old_logp), 0.0)),
                                    jnp.sum(jnp.where(kept, m, 0.0))),
        dropped_by_filter=WeightedMetric(jnp.sum(jnp.where(active & ~kept, m, 0.0)), count),
        advantage_mean=WeightedMetric(jnp.sum(jnp.where(has_tokens, adv[:, 0], 0.0)),
                                      jnp.sum(has_tokens.astype(jnp.float32))),
    )
    if entropy is not None:
        aux["entropy"] = WeightedMetric(jnp.sum(m * jnp.where(active, jnp.asarray(entropy, jnp.float32), 0.0)),
                                        count)
    return LossOutput(loss, aux)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GRPOBatch:
    """A replay batch (weights > 0 mark the committed action tokens) with the rollout's recorded
    log-probs `[B, T]`, per-row advantages `[B]` and, optionally, reference log-probs `[B, T]`.

    Attributes:
        batch: the replay batch; weights > 0 mark the action tokens.
        old_logp: `[B, T]` the rollout's recorded log-probabilities.
        advantages: `[B]` each row's advantage.
        ref_logp: `[B, T]` the reference policy's log-probabilities (for `beta`), or None.
    """

    batch: DiffusionTokenBatch
    old_logp: Array
    advantages: Array
    ref_logp: Array | None = None


def require_trace(rollout: RolloutOutput) -> RolloutOutput:
    """GRPO scores exactly the distribution that was sampled, through the trace; a rollout without
    one is refused rather than rescored autoregressively."""
    if rollout.trace is None:
        raise ValueError("GRPO needs the denoising trace of every rollout to replay its log-probs exactly; use "
                         "rollouts from the block-diffusion sampler, which records one, instead of rescoring "
                         "completions")
    return rollout


ScoreFn = Callable[[Any, DiffusionTokenBatch], tuple[Array, Array | None] | TokenScores]


def make_grpo_loss(config: GRPOConfig, score: ScoreFn) -> Callable[[Any, GRPOBatch, jax.Array], LossOutput]:
    """A trainer `loss_fn`: `score(model, replay_batch)` must give the differentiable log-probs of
    the replayed tokens under the sampling distribution and their entropies (or None), e.g.
    `distribution_score(...)`; a third entry, when given and not None, is the log-probs the KL to
    the reference compares with `ref_logp` (`TokenScores.unfiltered_logp`)."""

    def loss_fn(model: Any, batch: GRPOBatch, key: jax.Array | None = None) -> LossOutput:
        del key
        new_logp, entropy, *rest = score(model, batch.batch)
        return grpo_objective(new_logp, batch.old_logp, batch.batch.weights, batch.advantages, config,
                              ref_logp=batch.ref_logp, entropy=entropy, kl_logp=rest[0] if rest else None)

    return loss_fn


def distribution_score(distribution: SamplingDistribution, *, kl: bool = False) -> ScoreFn:
    """A `score` for `make_grpo_loss`: the replayed tokens' log-probs (with gradients) and
    entropies under the distribution the rollout sampled (`SamplerConfig.distribution`); with
    `kl=True` (GRPO with `beta > 0`) also their log-probs under `distribution.without_filters()`,
    the distribution the reference's log-probs must then be scored under."""
    return lambda model, batch: token_scores(model, batch, distribution, stop_gradient=False, with_entropy=True,
                                             with_unfiltered=kl)
