"""On-policy distillation: forward KL(teacher_T ‖ student_T)·T² on replayed student views.

The teacher is a stop-gradient target; an optional hard cross-entropy term joins the same
numerator. Positions are the committed tokens (the batch weights) or every masked position.
Legend: B batch, T packed tokens, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from bd_core import CLEAN_VIEW, DistillationBatch, LossOutput, TeacherHead, WeightedMetric, config_error
from bd_models import first_argmax, head_logits, logits_chunk, sum_logits

from ._sft import token_cross_entropy


@dataclasses.dataclass(frozen=True)
class OPDConfig:
    """`temperature` softens both distributions (the KL is scaled by T² so gradients keep their
    size); `hard_ce_weight` adds CE to the batch targets; `positions` picks `committed` tokens
    (weights > 0) or every `masked` position of a noisy view (needs `mask_id`).

    Attributes:
        temperature: softens both distributions; the KL is scaled by T².
        hard_ce_weight: weight of the cross-entropy to the batch targets (0: off).
        positions: `committed` tokens, or every `masked` position of a noisy view.
        mask_id: the mask token (needed with `masked`).
    """

    temperature: float = 1.0
    hard_ce_weight: float = 0.0
    positions: Literal["committed", "masked"] = "committed"
    mask_id: int | None = None

    def __post_init__(self):
        if not self.temperature > 0:
            raise config_error("OPDConfig", "temperature", self.temperature, "a value > 0", "use 1.0 for none")
        if not self.hard_ce_weight >= 0:
            raise config_error("OPDConfig", "hard_ce_weight", self.hard_ce_weight, "a value >= 0", "use 0 to disable")
        if self.positions not in ("committed", "masked"):
            raise config_error("OPDConfig", "positions", self.positions, "'committed' or 'masked'")
        if self.positions == "masked" and self.mask_id is None:
            raise config_error("OPDConfig", "mask_id", None, "the tokenizer's mask_id with positions='masked'")
        if self.positions == "masked" and self.hard_ce_weight > 0:
            raise config_error("OPDConfig", "hard_ce_weight", self.hard_ce_weight, "0 with positions='masked'",
                               "hard CE needs targets at every distilled position, and a replay batch has them only "
                               "where tokens were committed; use positions='committed'")


def _opd_terms(student_logits: Float[Array, "B T V"], teacher_logits: Float[Array, "B T V"], active: Any,
               targets: Any, *, config: OPDConfig, gather: bool = True) -> tuple[Array, Array | None, Array]:
    """Per position: KL(teacher_T ‖ student_T), the hard CE (None without it) and whether the two
    argmaxes agree; position by position, so `sum_logits` may compute it a chunk at a time."""
    t = config.temperature
    teacher_logp = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32) / t, axis=-1)
    student_logp = jax.nn.log_softmax(student_logits.astype(jnp.float32) / t, axis=-1)
    kl = jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - student_logp), axis=-1)
    kl = jnp.where(active, kl, 0.0)
    ce = token_cross_entropy(student_logits, targets, active, gather=gather) if config.hard_ce_weight > 0 else None
    agree = (first_argmax(student_logits) == first_argmax(teacher_logits)) & active
    return kl, ce, agree


def _per_token(kl: Array, ce: Array | None, config: OPDConfig) -> Array:
    """What the loss sums, weighted: KL·T² (+ α·CE)."""
    per_token = kl * config.temperature**2
    return per_token if ce is None else per_token + config.hard_ce_weight * ce


def _opd_piece(student_logits: Float[Array, "B T V"], teacher: Float[Array, "B T V"] | Float[Array, "B T D"],
               active: Any, targets: Any, *head_weight: Array, config: OPDConfig, head: tuple[bool, str] | None,
               gather: bool = True) -> tuple[Array, tuple[Array, Array | None, Array]]:
    """`_opd_terms` as `sum_logits` takes them: (the summed term, the terms). With the teacher's
    `head` (a `TeacherHead`'s tied and compute dtype; its weight is `head_weight`), `teacher` is its
    final hidden states, and its logits are computed here for the positions at hand."""
    if head is not None:
        tied, dtype = head
        teacher = head_logits(teacher, head_weight[0], tied=tied, dtype=jnp.dtype(dtype))
    kl, ce, agree = _opd_terms(student_logits, teacher, active, targets, config=config, gather=gather)
    return _per_token(kl, ce, config), (kl, ce, agree)


def _opd_output(kl: Array, ce: Array | None, agree: Array, weights: Array, denom: Array,
                config: OPDConfig, numerator: Array | None = None) -> LossOutput:
    """The loss Σ w·(KL·T² + α·CE) (or `numerator`, the same sum with its gradient from
    `sum_logits`) over Σ denom, and the metrics."""
    active = weights > 0
    den = jnp.sum(denom)
    aux: dict[str, Any] = {"kl": WeightedMetric(jnp.sum(weights * kl), den)}
    if ce is not None:
        aux["hard_ce"] = WeightedMetric(jnp.sum(weights * ce), den)
    aux["teacher_agreement"] = WeightedMetric(jnp.sum(agree.astype(jnp.float32)), jnp.sum(active.astype(jnp.float32)))
    numerator = jnp.sum(weights * _per_token(kl, ce, config)) if numerator is None else numerator
    return LossOutput(WeightedMetric(numerator, den), aux)


def _weights(weights: Any, denom_weights: Any, targets: Any, config: OPDConfig) -> tuple[Array, Array, Array]:
    weights = jnp.asarray(weights, jnp.float32)
    denom = weights if denom_weights is None else jnp.asarray(denom_weights, jnp.float32)
    if config.hard_ce_weight > 0 and targets is None:
        raise ValueError("opd_loss: hard_ce_weight > 0 needs targets=")
    return weights, denom, jnp.zeros(weights.shape, jnp.int32) if targets is None else jnp.asarray(targets)


def opd_loss(student_logits: Float[Array, "B T V"], teacher_logits: Float[Array, "B T V"],
             weights: Float[Array | np.ndarray, "B T"], config: OPDConfig, *, targets: Any = None,
             denom_weights: Any = None) -> LossOutput:
    """Σ w·(KL·T² + α·CE) / Σ denom_weights (default: Σ w, a weighted mean)."""
    weights, denom, targets = _weights(weights, denom_weights, targets, config)
    terms = _opd_terms(student_logits, teacher_logits, weights > 0, targets, config=config)
    return _opd_output(*terms, weights, denom, config)


def opd_positions(batch: DistillationBatch, config: OPDConfig) -> tuple[Any, Any]:
    """(weights, denominator weights) of the positions distilled on."""
    student = batch.student
    if config.positions == "committed":
        return jnp.asarray(student.weights, jnp.float32), jnp.asarray(student.denom_weights, jnp.float32)
    layout = student.layout
    masked = layout.valid & (layout.view_ids != CLEAN_VIEW) & (layout.tokens == config.mask_id)
    masked = masked.astype(jnp.float32)
    return masked, masked


def opd_objective(model: Any, batch: DistillationBatch, key: jax.Array | None = None, *,
                  config: OPDConfig) -> LossOutput:
    """The student's logits on the replayed views against the batch's teacher logits; with the
    student's `logits_chunk`, a slice of the positions at a time, the head's gradient with them
    (`bd_models.sum_logits`: the backward pass does not read the teacher's outputs). A batch with
    the teacher's features and head gets the teacher's logits computed a slice at a time too, so
    neither model's `[B, T, V]` logits are ever held whole."""
    del key
    weights, denom = opd_positions(batch, config)
    weights, denom, targets = _weights(weights, denom, batch.student.targets, config)
    head = batch.teacher_head
    teacher = batch.teacher_logits if head is None else batch.teacher_features
    piece = functools.partial(_opd_piece, config=config, head=None if head is None else (head.tied, head.compute_dtype),
                              gather=logits_chunk(model) <= 0)
    numerator, _, (kl, ce, agree) = sum_logits(model, batch.student.layout, piece, weights, teacher,
                                               weights > 0, targets, whole=() if head is None else (head.weight,))
    return _opd_output(kl, ce, agree, weights, denom, config, numerator)


def teacher_head(teacher: Any) -> TeacherHead:
    """The teacher's LM head as a `DistillationBatch` carries it beside the teacher's features
    (`teacher.features(layout)`): its weight as it is (placed where the teacher's is)."""
    return TeacherHead(teacher.head_weight, teacher.lm_head is None, teacher.config.compute_dtype)


def make_opd_loss(config: OPDConfig) -> Callable[[Any, DistillationBatch, jax.Array], LossOutput]:
    """A trainer `loss_fn` with `config` bound."""
    return lambda model, batch, key: opd_objective(model, batch, key, config=config)
