"""Gradient accumulation as a higher-order function around a loss, plus microbatch splitting.

Every microbatch adds Σ∇numerator and Σdenominator into float32 accumulators; the gradient is
normalized once by the global denominator (DESIGN.md, "Losses and reduction"), so any split of a
batch, padded with zero-weight rows, gives the gradient of the whole batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from bd_core import LossOutput, MaxMetric, MetricError, Unsplit, WeightedMetric, as_loss_output, reduce_metrics
from bd_models import zeros_placed_like

LossFn = Callable[[Any, Any, jax.Array], Any]


class Accumulated(eqx.Module):
    """Unnormalized sums over microbatches: float32 Σ∇numerator (shaped like the trainable
    arrays), the loss as a scalar `WeightedMetric` (Σnumerator, Σdenominator), how many
    microbatches were added and their aux metrics as float32 sums (`_aux_sums`), reduced once by
    `metrics`. The one accumulator type: `accumulate` returns it for the microbatches of one
    call, and a streaming `TrainState` carries it across calls.

    `zeros(params)` has `aux` None: the first addition then fixes the aux keys and the loss's
    `eps`/`min_denom`. `zeros(params, like=...)` fixes them up front from one microbatch's
    `LossOutput` (or its shapes), so that the accumulator has one pytree structure from the start:
    a streaming train state is then the same program input at every call. Every addition must
    report the keys and settings fixed."""

    grads: Any
    loss: WeightedMetric
    count: jax.Array
    aux: dict[str, Any] | None

    @classmethod
    def zeros(cls, params: Any, like: LossOutput | None = None) -> Accumulated:
        """Zero gradients shaped like `params` and zero metrics shaped like `like`: the start of an accumulation."""
        zero = jnp.zeros((), jnp.float32)
        if like is None:
            return cls(zeros_like_grads(params), WeightedMetric(zero, zero), jnp.zeros((), jnp.int32), None)
        loss = WeightedMetric(zero, zero, like.loss.eps, like.loss.min_denom)
        return cls(zeros_like_grads(params), loss, jnp.zeros((), jnp.int32), _aux_zeros(like.aux))

    def emptied(self) -> Accumulated:
        """Zero sums of the same structure (the accumulator after an update)."""
        zero = jnp.zeros((), jnp.float32)
        return Accumulated(jax.tree_util.tree_map(zeros_placed_like, self.grads),
                           dataclasses.replace(self.loss, numerator=zero, denominator=zero), jnp.zeros((), jnp.int32),
                           None if self.aux is None else _aux_zeros(self.aux))

    def __add__(self, other: Accumulated) -> Accumulated:
        if other.aux is None:
            return self
        if self.aux is None:  # an empty accumulator adds nothing, and fixes no settings yet
            return other
        if self.loss.settings != other.loss.settings:
            raise MetricError(
                f"accumulation: the loss's WeightedMetric settings changed within one update: "
                f"{_settings(other.loss)} in the microbatches added now, {_settings(self.loss)} in those "
                "added before; every call of an update must build its loss with the same eps and min_denom"
            )
        return Accumulated(jax.tree_util.tree_map(jnp.add, self.grads, other.grads), self.loss + other.loss,
                           self.count + other.count, _add_aux(self.aux, other.aux))

    def metrics(self) -> dict[str, jax.Array]:
        """The loss and aux metrics of every microbatch added, reduced once with
        `reduce_metrics`: what one scan over all of them reports."""
        aux = {key: value if isinstance(value, (WeightedMetric, MaxMetric)) else value / self.count
               for key, value in (self.aux or {}).items()}
        return reduce_metrics({"loss": self.loss, **aux})


def _aux_zeros(aux: dict[str, Any]) -> dict[str, Any]:
    """Empty float32 sums of `aux`'s keys and kinds: what adding no microbatch gives."""
    zero = jnp.zeros((), jnp.float32)

    def empty(value):
        if isinstance(value, WeightedMetric):
            return WeightedMetric(zero, zero, value.eps, value.min_denom)
        if isinstance(value, MaxMetric):
            return MaxMetric(jnp.full((), -jnp.inf, jnp.float32))
        return zero

    return {key: empty(value) for key, value in aux.items()}


def _settings(metric: WeightedMetric) -> str:
    return f"eps={metric.eps}, min_denom={metric.min_denom}"


def _aux_sums(aux: dict[str, Any]) -> dict[str, Any]:
    """Aux metrics with a leading microbatch axis as float32 sums that add across calls:
    weighted metrics as (Σnumerator, Σdenominator), maxima as the maximum, plain arrays as the sum
    of per-microbatch means (`Accumulated.metrics` divides it by the count)."""

    def fold(value):
        if isinstance(value, WeightedMetric):
            return WeightedMetric(jnp.sum(jnp.asarray(value.numerator, jnp.float32)),
                                  jnp.sum(jnp.asarray(value.denominator, jnp.float32)), value.eps, value.min_denom)
        if isinstance(value, MaxMetric):
            return MaxMetric(jnp.max(jnp.asarray(value.value, jnp.float32)))
        value = jnp.asarray(value, jnp.float32)
        return jnp.sum(jnp.mean(value, axis=tuple(range(1, value.ndim))))

    return {key: fold(value) for key, value in aux.items()}


def _kind(value: Any) -> str:
    return "weighted" if isinstance(value, WeightedMetric) else "max" if isinstance(value, MaxMetric) else "plain"


def _add_aux(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    if a.keys() != b.keys():
        raise MetricError(f"accumulation: the aux metrics changed within one update: keys {sorted(b)} in the "
                          f"microbatches added now, {sorted(a)} in those added before; every call of an update "
                          "must report the same aux keys")
    out = {}
    for key, x in a.items():
        y = b[key]
        if _kind(x) != _kind(y):
            raise MetricError(f"accumulation: aux metric {key!r} is {_kind(y)} now but was {_kind(x)} earlier in "
                              "the update; a key must keep its kind")
        if isinstance(x, WeightedMetric) and isinstance(y, WeightedMetric):
            if x.settings != y.settings:
                raise MetricError(f"accumulation: aux metric {key!r} has {_settings(y)} now but {_settings(x)} "
                                  "earlier in the update; build it with the same settings in every call")
            out[key] = x + y
        elif isinstance(x, MaxMetric) and isinstance(y, MaxMetric):
            out[key] = MaxMetric(jnp.maximum(x.value, y.value))
        else:
            out[key] = x + y
    return out


def _is_unsplit(x: Any) -> bool:
    return isinstance(x, Unsplit)


def per_row(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """`(rows, rebuild)`: a batch's per-row arrays as a flat list (None in place of its `Unsplit`
    parts), and the function that rebuilds the batch from such a list, putting the `Unsplit` parts
    back. (Flattened, not partitioned: a batch type may check its fields' types when rebuilt.)"""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_unsplit)

    def rebuild(rows: list[Any]) -> Any:
        return jax.tree_util.tree_unflatten(treedef, [x if _is_unsplit(x) else r for x, r in zip(leaves, rows)])

    return [None if _is_unsplit(x) else x for x in leaves], rebuild


def map_rows(fn: Callable[[Any], Any], tree: Any) -> Any:
    """`fn` on every per-row array of a batch; its `Unsplit` parts as they are."""
    return jax.tree_util.tree_map(lambda x: x if _is_unsplit(x) else fn(x), tree, is_leaf=_is_unsplit)


def _leading_size(tree: Any) -> int:
    leaves = jax.tree_util.tree_leaves(per_row(tree)[0])
    sizes = {int(np.shape(leaf)[0]) for leaf in leaves if np.ndim(leaf) > 0}
    if len(sizes) != 1:
        raise ValueError(f"microbatching: every array in the batch needs the same leading (batch) axis, got sizes "
                         f"{sorted(sizes)}")
    return sizes.pop()


def _pad_rows(tree: Any, rows: int) -> Any:
    # An all-zero row is a zero-weight row: for DiffusionTokenBatch/DistillationBatch it is invalid
    # (valid=False), has weights 0 and denominator 0, so it adds nothing to any weighted sum.
    def pad(leaf):
        leaf = jnp.asarray(leaf)
        return jnp.concatenate([leaf, jnp.zeros((rows - leaf.shape[0],) + leaf.shape[1:], leaf.dtype)], axis=0)

    return map_rows(pad, tree)


def split_microbatches(batch: Any, num_microbatches: int | None = None, *, sizes: Sequence[int] | None = None) -> Any:
    """Split a batch on its leading axis into a stacked `[k, rows, ...]` batch.

    Give `num_microbatches` for k contiguous, near-equal parts, or `sizes` for explicit (possibly
    unequal) parts. Short parts are padded with all-zero rows, which carry zero weight. `Unsplit`
    parts (a teacher's head) stay whole: every microbatch sees all of them.
    """
    total = _leading_size(batch)
    if sizes is None:
        if num_microbatches is None or num_microbatches < 1:
            raise ValueError(f"split_microbatches: num_microbatches must be >= 1, got {num_microbatches}; "
                             "or pass sizes=[...]")
        base, extra = divmod(total, num_microbatches)
        sizes = [base + (i < extra) for i in range(num_microbatches)]
    sizes = [int(s) for s in sizes]
    if sum(sizes) != total or min(sizes) < 0:
        raise ValueError(f"split_microbatches: sizes {sizes} must be >= 0 and sum to the batch size {total}")
    rows = max(max(sizes), 1)
    offsets = np.cumsum([0] + sizes)
    parts = [
        per_row(_pad_rows(map_rows(lambda x, a=a, b=b: jnp.asarray(x)[a:b], batch), rows))[0]
        for a, b in zip(offsets[:-1], offsets[1:])
    ]
    return per_row(batch)[1](jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *parts))


def interleave_microbatches(batch: Any, num_microbatches: int) -> Any:
    """Inside jit: `[B, ...] -> [k, B/k, ...]` taking every k-th row into the same microbatch.

    With the batch sharded contiguously over devices, each microbatch then keeps an equal share of
    rows on every device, so the scan needs no cross-device data movement. `Unsplit` parts stay whole.
    """
    total = _leading_size(batch)
    if total % num_microbatches:
        raise ValueError(f"the batch size {total} is not divisible by microbatches={num_microbatches}; pad the "
                         "batch, change TrainerConfig.microbatches, or pre-split it with split_microbatches")

    def split(x):
        x = jnp.asarray(x)
        return jnp.swapaxes(x.reshape((total // num_microbatches, num_microbatches) + x.shape[1:]), 0, 1)

    return map_rows(split, batch)


def stack_one(batch: Any) -> Any:
    """`[B, ...] -> [1, B, ...]`: a batch as one microbatch (`Unsplit` parts stay whole)."""
    return map_rows(lambda x: jnp.asarray(x)[None], batch)


def microbatch_key(key: jax.Array, update_step: jax.Array | int, index: jax.Array | int) -> jax.Array:
    """The key of microbatch `index` of update `update_step`: the same however the update is split
    into calls, which is what makes streaming accumulation reproduce the scanned update."""
    return jax.random.fold_in(jax.random.fold_in(key, update_step), index)


def zeros_like_grads(params: Any) -> Any:
    return jax.tree_util.tree_map(zeros_placed_like, params)


def accumulate(loss_fn: LossFn, params: Any, static: Any, microbatches: Any, *, key: jax.Array,
               update_step: jax.Array, start_index: jax.Array | int = 0) -> tuple[Accumulated, dict[str, Any]]:
    """Scan `loss_fn(model, microbatch, key)` over the leading axis of `microbatches`.

    `params`/`static` are the `eqx.partition` of the model; only `params` is differentiated.
    Returns the unnormalized sums (divide with `normalize`; reduce with `Accumulated.metrics`)
    and the aux metrics with a leading microbatch axis.
    """

    def numerator(p, mb, mb_key):
        out: LossOutput = as_loss_output(loss_fn(eqx.combine(p, static), mb, mb_key))
        total = out.loss.total()
        # The denominator counts tokens; it must not carry gradient even if a loss computes it
        # from something differentiable.
        total = WeightedMetric(total.numerator, jax.lax.stop_gradient(total.denominator), total.eps, total.min_denom)
        return total.numerator.astype(jnp.float32), (total, out.aux)

    grad_fn = jax.value_and_grad(numerator, has_aux=True)
    count = _leading_size(microbatches)
    rows, rebuild = per_row(microbatches)  # the scan steps through the rows; `Unsplit` parts stay whole

    def body(carry, xs):
        grads, num, den = carry
        mb, index = xs
        mb = rebuild(mb)
        (_, (total, aux)), g = grad_fn(params, mb, microbatch_key(key, update_step, start_index + index))
        grads = jax.tree_util.tree_map(lambda a, b: a + b.astype(jnp.float32), grads, g)
        return (grads, num + total.numerator.astype(jnp.float32), den + total.denominator.astype(jnp.float32)), (
            total, aux)

    init = (zeros_like_grads(params), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (grads, num, den), (totals, aux) = jax.lax.scan(body, init, (rows, jnp.arange(count)))
    loss = WeightedMetric(num, den, totals.eps, totals.min_denom)
    return Accumulated(grads, loss, jnp.asarray(count, jnp.int32), _aux_sums(aux)), aux


def normalize(grads: Any, loss: WeightedMetric) -> Any:
    """Σ∇numerator / effective Σdenominator, exactly 0 when the denominator is 0."""
    den = loss.effective_denominator()
    safe = jnp.where(den == 0, jnp.ones_like(den), den)
    return jax.tree_util.tree_map(lambda g: jnp.where(den == 0, jnp.zeros_like(g), g / safe), grads)
