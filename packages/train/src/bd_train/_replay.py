"""Packed replay of a denoising trace: one `DiffusionTokenBatch` holding every step at once.

Layout `[clean stream: prompt + completion (view 0) | one view per valid step]`; view v holds its
block's canvas as it stood before that step (committed-so-far tokens, mask elsewhere), and its
targets are the tokens committed in that step. Valid steps are compacted and padded to a bucket.
Shape letters: see bd_core (B batch, R trace steps, W replay views, b block size, C canvas, T = C + W*b).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from bd_core import CLEAN_VIEW, DiffusionTokenBatch, DiffusionTrace, RolloutOutput, ViewLayout, is_concrete
from bd_models import to_host


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReplayBatch:
    """A replay `batch` with the rollout's `recorded_logprobs` `[B, T]` (0 off-target) and, per view,
    the trace step it replays (`step_index` `[B, W]`, -1 for padding views).

    Attributes:
        batch: the packed replay views.
        recorded_logprobs: `[B, T]` the trace's log-probabilities (0 off-target).
        step_index: `[B, W]` the trace step each view replays (-1: padding).
    """

    batch: DiffusionTokenBatch
    recorded_logprobs: Array
    step_index: Array

    @property
    def mask(self) -> Array | np.ndarray:
        """Where a replayed token is scored: the committed positions of valid steps."""
        return self.batch.weights > 0


def replay_capacity(sampler: Any) -> int:
    """Replay views that hold every step a rollout of `sampler` (a `SamplerConfig`) can take: one
    fixed shape, so a training step compiles once."""
    return sampler.num_blocks * sampler.steps_cap


def replay_views(rollout: RolloutOutput, *, multiple: int = 8) -> int:
    """The smallest multiple of `multiple` that holds every row's valid steps (a shape bucket).
    A rollout that spans processes is read through a gather: every process must call this."""
    if rollout.trace is None:
        raise ValueError("replay_views: the rollout has no trace; sample with a trace to replay it")
    needed = int(np.max(np.sum(to_host(rollout.trace.step_valid), axis=1), initial=0))
    return max(multiple, -(-needed // multiple) * multiple)


def build_replay(rollout: RolloutOutput, *, mask_id: int, num_views: int | None = None) -> ReplayBatch:
    """The packed replay batch of a rollout's trace; `num_views` defaults to `replay_views(rollout)`.

    Pass `num_views` to fix the shape (e.g. inside jit); it must hold every row's valid steps.
    """
    trace = rollout.trace
    if trace is None:
        raise ValueError("build_replay: the rollout has no trace; sample with a trace to replay it")
    if num_views is None:
        num_views = replay_views(rollout)
    if is_concrete(trace.step_valid):
        needed = int(np.max(np.sum(np.asarray(trace.step_valid), axis=1), initial=0))
        if needed > num_views:
            raise ValueError(f"build_replay: num_views={num_views} cannot hold a row with {needed} valid steps; "
                             f"use replay_views(rollout) or at least {needed}")
    return _build(rollout, trace, mask_id, num_views)


def _build(rollout: RolloutOutput, trace: DiffusionTrace, mask_id: int, num_views: int) -> ReplayBatch:
    batch, steps, b = trace.committed.shape
    committed_BxRxb = trace.committed
    step_valid_BxR = trace.step_valid
    # canvas before step s: what earlier valid steps of the same block committed
    earlier_BxRxR = ((trace.block_ids[:, :, None] == trace.block_ids[:, None, :])
                     & (jnp.arange(steps)[None, :, None] > jnp.arange(steps)[None, None, :])
                     & step_valid_BxR[:, None, :])
    earlier = earlier_BxRxR.astype(jnp.int32)
    seen_BxRxb = jnp.einsum("bst,bti->bsi", earlier, committed_BxRxb.astype(jnp.int32)) > 0
    seen_tokens = jnp.einsum("bst,bti->bsi", earlier, jnp.where(committed_BxRxb, trace.tokens, 0).astype(jnp.int32))
    before_BxRxb = jnp.where(seen_BxRxb, seen_tokens, mask_id)

    # valid steps first, in trace order; the first num_views of them become the views
    order_BxR = jnp.argsort(~step_valid_BxR, axis=1, stable=True)
    if num_views > steps:
        order_BxR = jnp.pad(order_BxR, ((0, 0), (0, num_views - steps)), constant_values=0)
    index_BxW = order_BxR[:, :num_views]
    view_valid_BxW = jnp.take_along_axis(step_valid_BxR, index_BxW, axis=1)
    if num_views > steps:
        view_valid_BxW = view_valid_BxW & (jnp.arange(num_views) < steps)[None, :]
    take = lambda a: jnp.take_along_axis(a, index_BxW[:, :, None], axis=1)  # noqa: E731
    committed = take(committed_BxRxb) & view_valid_BxW[:, :, None]
    shape = (batch, num_views * b)
    block_BxW = jnp.take_along_axis(trace.block_ids, index_BxW, axis=1)
    views = ViewLayout(
        tokens=take(before_BxRxb).reshape(shape),
        positions=(block_BxW[:, :, None] * b + jnp.arange(b)).reshape(shape).astype(jnp.int32),
        block_ids=jnp.broadcast_to(block_BxW[:, :, None], (batch, num_views, b)).reshape(shape),
        view_ids=jnp.broadcast_to(1 + jnp.arange(num_views, dtype=jnp.int32)[None, :, None],
                                  (batch, num_views, b)).reshape(shape),
        valid=jnp.broadcast_to(view_valid_BxW[:, :, None], (batch, num_views, b)).reshape(shape),
    )
    view_targets = jnp.where(committed, take(trace.tokens), 0).reshape(shape)
    view_logprobs = jnp.where(committed, take(trace.logprobs), 0.0).reshape(shape)

    tokens = jnp.concatenate([rollout.prompt_tokens, rollout.completion_tokens], axis=1).astype(jnp.int32)
    length = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
    clean = ViewLayout(tokens, positions, positions // b, jnp.full(tokens.shape, CLEAN_VIEW, jnp.int32),
                       jnp.concatenate([rollout.prompt_valid, rollout.completion_valid], axis=1))
    layout = jax.tree_util.tree_map(lambda x, y: jnp.concatenate([x, y], axis=1), clean, views)
    zeros = jnp.zeros(tokens.shape, jnp.float32)
    weights = jnp.concatenate([zeros, committed.reshape(shape).astype(jnp.float32)], axis=1)
    diffusion = DiffusionTokenBatch(layout, jnp.concatenate([jnp.zeros_like(tokens), view_targets], axis=1),
                                    weights, weights)
    step_index = jnp.where(view_valid_BxW, index_BxW, -1).astype(jnp.int32)
    return ReplayBatch(diffusion, jnp.concatenate([zeros, view_logprobs], axis=1), step_index)
