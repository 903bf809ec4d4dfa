"""Token batches: the packed view layout, the diffusion training batch and the distillation batch.

All are pytrees of arrays (jit/vmap/sharding pass them through unchanged). `validate()` runs the
static checks (ranks, shapes, dtypes) always and the value checks when the arrays are concrete.
Shape letters: see bd_core (B batch, T packed tokens, V vocab).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.core  # named so that `jax.core.Tracer` resolves statically
import jax.numpy as jnp
import numpy as np

from ._validate import (
    ContractError,
    as_array,
    as_int32,
    check_bool,
    check_finite_nonneg,
    check_float,
    check_int,
    check_rank,
    check_real_or_bool,
    check_shape,
    is_concrete,
)

Array = jax.Array

CLEAN_VIEW = 0
"""The view id of the clean stream in a `ViewLayout` (noisy views are 1, 2, ...)."""


def _holds_arrays(contract: Any) -> bool:
    """Every leaf is a numpy or jax array that is not a tracer. Pytree code rebuilds contracts
    with other leaves (tracers under jit/vmap, where a vmapped row is rank 1; partition specs;
    sentinels), and those are not checked on construction."""
    leaves = jax.tree_util.tree_leaves(contract)
    return bool(leaves) and all(isinstance(x, (np.ndarray, jax.Array)) and not isinstance(x, jax.core.Tracer)
                                for x in leaves)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ViewLayout:
    """A packed set of views of each sequence, all fields `[B, T]`.

    `positions` is the RoPE position in the canvas (equal for a token in every view), `block_ids`
    the canvas block, `view_ids` 0 for the clean stream and v >= 1 for noisy view v.

    Attributes:
        tokens: token ids `[B, T]`.
        positions: RoPE positions in the canvas, equal for a token in every view.
        block_ids: the canvas block of each token.
        view_ids: 0 for the clean stream, v ≥ 1 for noisy view v.
        valid: False for padding (never attended, never supervised).
    """

    tokens: Array | np.ndarray
    positions: Array | np.ndarray
    block_ids: Array | np.ndarray
    view_ids: Array | np.ndarray
    valid: Array | np.ndarray

    @classmethod
    def create(cls, tokens, positions, block_ids, view_ids, valid, *, validate: bool = True) -> ViewLayout:
        """A layout from its five `[B, T]` arrays (ints as int32), validated unless `validate=False`."""
        layout = cls(
            tokens=as_int32(tokens),
            positions=as_int32(positions),
            block_ids=as_int32(block_ids),
            view_ids=as_int32(view_ids),
            valid=as_array(valid),
        )
        return layout.validate() if validate else layout

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(np.shape(self.tokens))  # type: ignore[return-value]

    def __post_init__(self):
        if _holds_arrays(self):  # built from arrays here (not tracers, specs or sentinels): check the structure
            self._check_structure(stacked=True)

    def _check_structure(self, *, stacked: bool = False) -> tuple[int, ...]:
        """Every field `[B, T]` (with `stacked`, `[..., B, T]`: microbatches stack on a leading
        axis) of the right dtype."""
        owner = "ViewLayout"
        shape = tuple(np.shape(self.tokens))
        ranks = {np.ndim(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if not (stacked and len(shape) > 2 and len(ranks) == 1):
            shape = check_rank(owner, "tokens", self.tokens, 2, "B, T")
        for name in ("tokens", "positions", "block_ids", "view_ids"):
            check_shape(owner, name, getattr(self, name), shape, "B, T")
            check_int(owner, name, getattr(self, name))
        check_shape(owner, "valid", self.valid, shape, "B, T")
        check_bool(owner, "valid", self.valid)
        return shape

    def validate(self) -> ViewLayout:
        """Shapes and dtypes (also checked on construction from arrays), then values where they
        can be read."""
        owner = "ViewLayout"
        self._check_structure()
        if is_concrete(self):
            valid = np.asarray(self.valid)
            for name in ("positions", "block_ids", "view_ids"):
                values = np.asarray(getattr(self, name))[valid]
                if values.size and values.min() < 0:
                    raise ContractError(
                        f"{owner}.{name}: expected values >= 0 at valid positions, found {values.min()}")
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DiffusionTokenBatch:
    """A packed layout with target-aligned targets and per-token loss weights.

    `targets[b, i]` is the clean token at position i (no shift); inactive targets are 0 with weight
    0. `denom_weights` is what each position adds to the loss denominator (for `elbo` weighting,
    the valid completion tokens; for `none`, the masked ones); by default `weights > 0`.

    Attributes:
        layout: the packed views.
        targets: the clean token at each position (0 where inactive).
        weights: each position's loss weight.
        denom_weights: what each position adds to the loss denominator.
    """

    layout: ViewLayout
    targets: Array | np.ndarray
    weights: Array | np.ndarray
    denom_weights: Array | np.ndarray

    @classmethod
    def create(cls, layout: ViewLayout, targets, weights, denom_weights=None, *, vocab_size: int | None = None,
               validate: bool = True) -> DiffusionTokenBatch:
        """A batch from its parts, arrays converted to int32/float32 (boolean weights become 0/1) and validated unless
        `validate=False`."""
        weights = as_array(weights)
        if weights.dtype == np.bool_:
            weights = weights.astype(np.float32)
        denom_weights = (weights > 0) if denom_weights is None else as_array(denom_weights)
        if jnp.issubdtype(weights.dtype, jnp.floating):
            denom_weights = denom_weights.astype(weights.dtype)
        batch = cls(layout, as_int32(targets), weights, denom_weights)
        return batch.validate(vocab_size=vocab_size) if validate else batch

    @property
    def shape(self) -> tuple[int, int]:
        return self.layout.shape

    def __post_init__(self):
        if _holds_arrays(self):  # built from arrays here (not tracers, specs or sentinels): check the structure
            self._check_structure(stacked=True)

    def _check_structure(self, *, stacked: bool = False) -> None:
        owner = "DiffusionTokenBatch"
        if not isinstance(self.layout, ViewLayout):
            raise ContractError(f"{owner}.layout: expected a ViewLayout, got {type(self.layout).__name__}")
        shape = self.layout._check_structure(stacked=stacked)
        check_shape(owner, "targets", self.targets, shape, "B, T")
        check_int(owner, "targets", self.targets)
        for name in ("weights", "denom_weights"):
            check_shape(owner, name, getattr(self, name), shape, "B, T")
            check_real_or_bool(owner, name, getattr(self, name))

    def validate(self, *, vocab_size: int | None = None) -> DiffusionTokenBatch:
        """Shapes and dtypes (also checked on construction from arrays), then values where they
        can be read: weights finite and >= 0, active targets in the vocabulary and valid."""
        owner = "DiffusionTokenBatch"
        self._check_structure()
        self.layout.validate()
        if is_concrete(self):
            check_finite_nonneg(owner, "weights", self.weights)
            check_finite_nonneg(owner, "denom_weights", self.denom_weights)
            active = np.asarray(self.weights) > 0
            targets = np.asarray(self.targets)[active]
            if targets.size and targets.min() < 0:
                raise ContractError(f"{owner}.targets: active targets must be >= 0, found {targets.min()}")
            if vocab_size is not None and targets.size and targets.max() >= vocab_size:
                raise ContractError(
                    f"{owner}.targets: active targets must be < vocab_size={vocab_size}, found {targets.max()}"
                )
            if np.any(active & ~np.asarray(self.layout.valid)):
                raise ContractError(f"{owner}.weights: positive weight on a position that layout.valid marks invalid")
        return self


class Unsplit:
    """A part of a batch pytree that is not per row: microbatching hands every microbatch the whole
    of it (a teacher's LM head) instead of splitting it on its leading axis like the rest."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TeacherHead(Unsplit):
    """The teacher's LM head, which turns `DistillationBatch.teacher_features` into the teacher's
    logits inside the loss, a chunk of positions at a time.

    Attributes:
        weight: the embedding `[V, D]` when `tied`, else the head `[D, V]`.
        tied: whether `weight` is the (tied) embedding.
        compute_dtype: the dtype the teacher's head multiplies in (its `ModelConfig.compute_dtype`).
    """

    weight: Array
    tied: bool = dataclasses.field(metadata={"static": True})
    compute_dtype: str = dataclasses.field(metadata={"static": True})

    @property
    def vocab_size(self) -> int:
        return int(np.shape(self.weight)[0 if self.tied else 1])

    @property
    def d_model(self) -> int:
        return int(np.shape(self.weight)[1 if self.tied else 0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DistillationBatch:
    """A student diffusion batch with the teacher's target-aligned outputs: its logits `[B, T, V]`,
    or its final hidden states `teacher_features` `[B, T, D]` and its `teacher_head`, from which
    the loss computes the teacher's logits a chunk at a time (so they are never held whole).

    Attributes:
        student: the student's batch (the replayed views).
        teacher_logits: the teacher's logits on the student's layout, or None with features.
        teacher_features: the teacher's final hidden states on that layout, or None with logits.
        teacher_head: the teacher's LM head, with `teacher_features` only.
    """

    student: DiffusionTokenBatch
    teacher_logits: Array | None = None
    teacher_features: Array | None = None
    teacher_head: TeacherHead | None = None

    @classmethod
    def create(cls, student: DiffusionTokenBatch, teacher_logits: Any = None, *, teacher_features: Any = None,
               teacher_head: TeacherHead | None = None, validate: bool = True) -> DistillationBatch:
        """A distillation batch from a student batch and the teacher's logits (or features and head)
        on the same layout, validated unless `validate=False`."""
        batch = cls(student, None if teacher_logits is None else jnp.asarray(teacher_logits),
                    None if teacher_features is None else jnp.asarray(teacher_features), teacher_head)
        return batch.validate() if validate else batch

    def validate(self) -> DistillationBatch:
        """Check shapes, dtypes and that the teacher's outputs cover the student's layout; returns
        self or raises `ContractError`."""
        owner = "DistillationBatch"
        if not isinstance(self.student, DiffusionTokenBatch):
            raise ContractError(f"{owner}.student: expected a DiffusionTokenBatch, got {type(self.student).__name__}")
        self.student.validate()
        b, t = self.student.shape
        if (self.teacher_logits is None) == (self.teacher_features is None):
            raise ContractError(f"{owner}: expected either teacher_logits or teacher_features (with teacher_head), "
                                "not both and not neither")
        if (self.teacher_features is None) != (self.teacher_head is None):
            raise ContractError(f"{owner}.teacher_head: expected with teacher_features, and only with them")
        name = "teacher_logits" if self.teacher_logits is not None else "teacher_features"
        value = getattr(self, name)
        last = "V" if name == "teacher_logits" else "D"
        shape = check_rank(owner, name, value, 3, f"B, T, {last}")
        if shape[:2] != (b, t):
            raise ContractError(f"{owner}.{name}: expected target-aligned shape ({b}, {t}, {last}) matching the "
                                f"student batch, got {shape}")
        check_float(owner, name, value)
        if self.teacher_head is not None:
            if not isinstance(self.teacher_head, TeacherHead):
                raise ContractError(f"{owner}.teacher_head: expected a TeacherHead, got "
                                    f"{type(self.teacher_head).__name__}")
            check_rank(owner, "teacher_head.weight", self.teacher_head.weight, 2, "V, D" if self.teacher_head.tied
                       else "D, V")
            check_float(owner, "teacher_head.weight", self.teacher_head.weight)
            if self.teacher_head.d_model != shape[2]:
                raise ContractError(f"{owner}.teacher_head: its weight {tuple(np.shape(self.teacher_head.weight))} "
                                    f"(tied={self.teacher_head.tied}) does not take features of width {shape[2]}")
        if is_concrete(value) and not np.all(np.isfinite(np.asarray(value, np.float32))):
            raise ContractError(f"{owner}.{name}: expected finite values")
        return self
