"""Exact scoring of replayed tokens: per-token log-probs (and entropies) under a
`SamplingDistribution`, with the gradient flowing only when asked.

Shape letters: see bd_core (B batch, T packed tokens, V vocab).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from bd_core import DiffusionTokenBatch

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
    compile serves them all.
    """
    logits_BxTxV = model(batch.layout)
    if stop_gradient:
        logits_BxTxV = jax.lax.stop_gradient(logits_BxTxV)
    logp_BxTxV = distribution.logprobs(logits_BxTxV)
    active_BxT = batch.weights > 0
    # inactive targets may be banned ids (-inf): score a finite id there so gradients stay finite
    targets_BxT = jnp.where(active_BxT, batch.targets, jnp.argmax(logp_BxTxV, axis=-1))
    logp_BxT = jnp.where(active_BxT, token_logprob(logp_BxTxV, targets_BxT), 0.0)
    entropy_BxT = jnp.where(active_BxT, entropy(logp_BxTxV), 0.0) if with_entropy else None
    return logp_BxT, entropy_BxT
