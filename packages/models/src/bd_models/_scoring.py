"""Exact scoring of replayed tokens: per-token log-probs (and entropies) under a
`SamplingDistribution`, with the gradient flowing only when asked; and the parameter-free
log-probability of a `random`-strategy commit schedule.

Shape letters: see bd_core (B batch, T packed tokens, V vocab, R trace steps, b block).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.special import gammaln
from jaxtyping import Array, Float

from bd_core import DiffusionTokenBatch, DiffusionTrace

from ._logits_chunks import map_logits
from ._sampling_dist import SamplingDistribution, entropy, token_logprob


class TokenScores(NamedTuple):
    """What `token_scores` gives, `[B, T]` each, 0 where `batch.weights == 0`.

    Attributes:
        logp: each target's log-prob under the distribution.
        entropy: the distribution's entropy there, or None when not asked for.
        unfiltered_logp: each target's log-prob under `distribution.without_filters()` (the
            distribution a KL between models is taken under), or None when not asked for; the same
            array as `logp` when the distribution has no top-k or top-p.
    """

    logp: Float[Array, "B T"]
    entropy: Float[Array, "B T"] | None
    unfiltered_logp: Float[Array, "B T"] | None


def token_scores(
    model,
    batch: DiffusionTokenBatch,
    distribution: SamplingDistribution,
    *,
    stop_gradient: bool = True,
    with_entropy: bool = False,
    with_unfiltered: bool = False,
) -> TokenScores:
    """Log-prob of each target where `batch.weights > 0` (0 elsewhere) and, if asked, the entropy
    of `distribution` there and the log-prob under its unfiltered twin (`without_filters`), from
    one pass over the logits. `stop_gradient=True` (old-policy and reference scoring) blocks the
    gradient into the model; pass False for the policy being optimized. A rollout's distribution
    is `SamplerConfig.distribution`; passed into a jitted caller, its values are traced, so one
    compile serves them all. With the model's `logits_chunk` the logits are computed a slice of
    the positions at a time (`map_logits`), with the same values and gradients.
    """
    filtered = distribution.top_k is not None or distribution.top_p is not None
    unfiltered = distribution.without_filters()

    def score(logits_BxTxV, targets_BxT, active_BxT):
        if stop_gradient:
            logits_BxTxV = jax.lax.stop_gradient(logits_BxTxV)
        logp_BxTxV = distribution.logprobs(logits_BxTxV)
        # inactive targets may be banned ids (-inf): score a finite id there so gradients stay finite
        targets_BxT = jnp.where(active_BxT, targets_BxT, jnp.argmax(logp_BxTxV, axis=-1))
        pick = lambda logp: jnp.where(active_BxT, token_logprob(logp, targets_BxT), 0.0)  # noqa: E731
        logp_BxT = pick(logp_BxTxV)
        entropy_BxT = jnp.where(active_BxT, entropy(logp_BxTxV), 0.0) if with_entropy else None
        unfiltered_BxT = None
        if with_unfiltered:
            unfiltered_BxT = pick(unfiltered.logprobs(logits_BxTxV)) if filtered else logp_BxT
        return logp_BxT, entropy_BxT, unfiltered_BxT

    # position by position: with the model's logits_chunk, a slice of the logits at a time
    return TokenScores(*map_logits(model, batch.layout, score, batch.targets, batch.weights > 0))


def token_logprobs(
    model,
    batch: DiffusionTokenBatch,
    distribution: SamplingDistribution,
    *,
    stop_gradient: bool = True,
    with_entropy: bool = False,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"] | None]:
    """`token_scores`' log-probs and (if asked) entropies: `(logp [B, T], entropy [B, T] | None)`."""
    scores = token_scores(model, batch, distribution, stop_gradient=stop_gradient, with_entropy=with_entropy)
    return scores.logp, scores.entropy


def schedule_logprob(trace: DiffusionTrace) -> Float[Array, " B"]:
    """log P(schedule) of a trace sampled with `strategy="random"`: a step that commits k of the m
    positions still masked in its block drew them uniformly, with probability 1 / C(m, k). It does
    not depend on the parameters, so with it a trace's exact log-probability is this plus the sum
    of its committed log-probs. For the other strategies the schedule depends on the model and this
    is not its probability.
    """
    valid_BxR = jnp.asarray(trace.step_valid)
    k_BxR = jnp.where(valid_BxR, jnp.sum(jnp.asarray(trace.committed), axis=-1), 0).astype(jnp.float32)
    block_BxR = jnp.asarray(trace.block_ids)
    steps = block_BxR.shape[1]
    earlier_RxR = jnp.arange(steps)[None, :] < jnp.arange(steps)[:, None]  # [r, r'] : r' before r
    same_BxRxR = (block_BxR[:, :, None] == block_BxR[:, None, :]) & earlier_RxR
    m_BxR = trace.block_size - jnp.einsum("brs,bs->br", same_BxRxR.astype(jnp.float32), k_BxR)
    log_choose_BxR = gammaln(m_BxR + 1) - gammaln(k_BxR + 1) - gammaln(m_BxR - k_BxR + 1)
    return -jnp.sum(jnp.where(valid_BxR, log_choose_BxR, 0.0), axis=-1)
