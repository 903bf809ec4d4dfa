"""Supervised fine-tuning objective: float32 weighted cross-entropy on target-aligned targets.

No shift: the target of position i is the clean token at i. Inactive targets are sanitized before
indexing; numerator Σ w·CE, denominator Σ denom_weights (DESIGN.md, "Losses and reduction").
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from bd_core import DiffusionTokenBatch, LossOutput, WeightedMetric
from bd_models import first_argmax, logits_chunk, sum_logits, token_logprob, with_dropout_keys


def token_cross_entropy(logits: Float[Array, "B T V"], targets: Int[Array | np.ndarray, "B T"],
                        active: Any, *, gather: bool = True) -> Float[Array, "B T"]:
    """Per-position float32 CE; inactive positions read target 0 and return exactly 0. The target's
    logit is gathered, or with `gather=False` picked by `token_logprob`'s compare and sum: the same
    values, and over logits split by their vocabulary no index arrays of the logits' size (the
    chunked losses use it). The whole-logits path keeps the gather: on CPU the two fuse differently,
    and the pipeline's printed results were measured with the gather."""
    logits = logits.astype(jnp.float32)
    safe_targets = jnp.where(active, targets, 0)
    logz = jax.nn.logsumexp(logits, axis=-1)
    if gather:
        picked = jnp.take_along_axis(logits, safe_targets[..., None], axis=-1)[..., 0]
    else:
        picked = token_logprob(logits, safe_targets)
    return jnp.where(active, logz - picked, 0.0)


def _sft_terms(logits: Float[Array, "B T V"], targets: Any, active: Any, *, gather: bool = True) -> tuple[Array, Array]:
    """Per-position CE and whether the argmax is the target (position by position: `sum_logits`)."""
    ce = token_cross_entropy(logits, targets, active, gather=gather)
    return ce, (first_argmax(logits) == targets) & active


def _sft_output(ce: Array, correct: Array, batch: DiffusionTokenBatch, numerator: Array | None = None) -> LossOutput:
    """The loss Σ w·CE (or `numerator`, the same sum with its gradient from `sum_logits`) and metrics."""
    weights = batch.weights.astype(jnp.float32)
    counted = (weights > 0).astype(jnp.float32)
    numerator = jnp.sum(weights * ce) if numerator is None else numerator
    return LossOutput(
        loss=WeightedMetric(numerator, jnp.sum(batch.denom_weights.astype(jnp.float32))),
        aux={
            "ce": WeightedMetric(jnp.sum(ce), jnp.sum(counted)),
            "token_accuracy": WeightedMetric(jnp.sum(correct.astype(jnp.float32)), jnp.sum(counted)),
        },
    )


def sft_loss(logits: Float[Array, "B T V"], batch: DiffusionTokenBatch) -> LossOutput:
    """Σ w·CE / Σ denom_weights, with unweighted CE and accuracy on the active tokens as aux."""
    return _sft_output(*_sft_terms(logits, batch.targets, batch.weights > 0), batch)


def sft_objective(model: Any, batch: DiffusionTokenBatch, key: jax.Array | None = None) -> LossOutput:
    """`loss_fn` for the trainer: the model's logits on the batch layout, scored by `sft_loss`.
    The forward pass is deterministic (corruption happened in the data pipeline) except for LoRA
    adapters with dropout, which draw their masks from `key`. With the model's `logits_chunk` the
    logits are computed a slice of the positions at a time, the head's gradient with them
    (`bd_models.sum_logits`)."""
    if key is not None:
        model = with_dropout_keys(model, key)
    terms = functools.partial(_sft_terms, gather=logits_chunk(model) <= 0)
    numerator, ce, correct = sum_logits(model, batch.layout, terms, batch.weights, batch.targets, batch.weights > 0)
    return _sft_output(ce, correct, batch, numerator)
