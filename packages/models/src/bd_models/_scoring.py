"""Exact scoring of replayed tokens: per-token log-probs (and entropies) under a
`SamplingDistribution`, with the gradient flowing only when asked; and the parameter-free
log-probability of a `random`-strategy commit schedule.

Shape letters: see bd_core (B batch, T packed tokens, V vocab, R trace steps, b block).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.special import gammaln
from jaxtyping import Array, Float

from bd_core import DiffusionTokenBatch, DiffusionTrace

from ._logits_chunks import map_logits
from ._sampling_dist import SamplingDistribution, entropy, token_logprob


def token_logprobs(
    model,
    batch: DiffusionTokenBatch,
    distribution: SamplingDistribution,
    *,
    stop_gradient: bool = True,
    with_entropy: bool = False,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"] | None]:
    """Log-prob of each target where `batch.weights > 0` (0 elsewhere) and, if asked, the entropy
    of `distribution` there. `stop_gradient=True` (old-policy and reference scoring) blocks the
    gradient into the model; pass False for the policy being optimized. A rollout's distribution
    is `SamplerConfig.distribution`; passed into a jitted caller, its values are traced, so one
    compile serves them all. With the model's `logits_chunk` the logits are computed a slice of
    the positions at a time (`map_logits`), with the same values and gradients.
    """

    def score(logits_BxTxV, targets_BxT, active_BxT):
        if stop_gradient:
            logits_BxTxV = jax.lax.stop_gradient(logits_BxTxV)
        logp_BxTxV = distribution.logprobs(logits_BxTxV)
        # inactive targets may be banned ids (-inf): score a finite id there so gradients stay finite
        targets_BxT = jnp.where(active_BxT, targets_BxT, jnp.argmax(logp_BxTxV, axis=-1))
        logp_BxT = jnp.where(active_BxT, token_logprob(logp_BxTxV, targets_BxT), 0.0)
        entropy_BxT = jnp.where(active_BxT, entropy(logp_BxTxV), 0.0) if with_entropy else None
        return logp_BxT, entropy_BxT

    # position by position: with the model's logits_chunk, a slice of the logits at a time
    logp_BxT, entropy_BxT = map_logits(model, batch.layout, score, batch.targets, batch.weights > 0)
    return logp_BxT, entropy_BxT


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
