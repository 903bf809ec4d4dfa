"""Activation shardings: rows over the data-parallel axes, features as their weights split them.

Under FSDP a projection's weight is split over `fsdp` on its input (embedding) axis and the rows
of its input over (`data`, `fsdp`): the same mesh axis on both sides of the contraction. XLA may
then gather the activations instead of the weight, and the backward pass keeps every gathered
input, so each chip holds the whole batch's activations: planning SDAR-8B's LoRA SFT on a v5e-8
found 51.6 GiB of temporaries per chip at 4 rows per chip. Pinning the activations to their rows
makes the weights the thing gathered, layer by layer, which is what FSDP means. Without a mesh set
with `jax.set_mesh` (or one without the data-parallel axes) these are the identity.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from ._attention import BATCH_AXES, MODEL_AXIS


def rows(x: jax.Array, features: str | None = None) -> jax.Array:
    """`x [rows, ..., features]` with its rows over (`data`, `fsdp`) and its last axis over
    `features` (`"model"` for heads and the MLP's hidden units, None for the residual stream and
    the logits); unchanged without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {*BATCH_AXES, MODEL_AXIS} <= set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, P(BATCH_AXES, *[None] * (x.ndim - 2), features))
