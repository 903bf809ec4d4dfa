"""Exact scoring of replayed tokens: per-token log-probs (and entropies) under the sampler's
distribution (`bd_models.sampling_logprobs`: temperature -> top-k -> top-p, banned ids), with the
gradient flowing only when asked. Legend: B batch, T packed tokens, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from bd_core import DiffusionTokenBatch
from bd_models import entropy, sampling_logprobs, token_logprob


def token_logprobs(
    model,
    batch: DiffusionTokenBatch,
    *,
    temperature: float | int | Float[Array, ""],
    top_k: int | Int[Array, ""] | None = None,
    top_p: float | int | Float[Array, ""] | None = None,
    banned_ids: Sequence[int] = (),
    stop_gradient: bool = True,
    with_entropy: bool = False,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"] | None]:
    """Log-prob of each target where `batch.weights > 0` (0 elsewhere) and, if asked, the entropy
    of the sampling distribution there. `stop_gradient=True` (old-policy and reference scoring)
    blocks the gradient into the model; pass False for the policy being optimized.
    `SamplerConfig.distribution_kwargs()` gives the distribution keywords of a rollout; the knobs
    may also be traced scalars, so a jitted caller compiles once for all their values.
    """
    logits_BxTxV = model(batch.layout)
    if stop_gradient:
        logits_BxTxV = jax.lax.stop_gradient(logits_BxTxV)
    logp_BxTxV = sampling_logprobs(logits_BxTxV, temperature=temperature, top_k=top_k, top_p=top_p,
                                   banned_ids=banned_ids)
    active = batch.weights > 0
    # inactive targets may be banned ids (-inf): score a finite id there so gradients stay finite
    targets = jnp.where(active, batch.targets, jnp.argmax(logp_BxTxV, axis=-1))
    logp = jnp.where(active, token_logprob(logp_BxTxV, targets), 0.0)
    ent = jnp.where(active, entropy(logp_BxTxV), 0.0) if with_entropy else None
    return logp, ent
