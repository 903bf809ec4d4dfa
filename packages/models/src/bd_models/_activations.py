"""Activation shardings: rows over the data-parallel axes, features as their weights split them.

Under FSDP a projection's weight is split over `fsdp` on its input (embedding) axis and the rows
of its input over (`data`, `fsdp`): the same mesh axis on both sides of the contraction. XLA may
then gather the activations instead of the weight, and the backward pass keeps every gathered
input, so each chip holds the whole batch's activations: planning SDAR-8B's LoRA SFT on a v5e-8
found 51.6 GiB of temporaries per chip at 4 rows per chip. Pinning the activations to their rows
makes the weights the thing gathered, layer by layer, which is what FSDP means. Without a mesh set
with `jax.set_mesh` (or one without the data-parallel axes) these are the identity.

The vocabulary is the exception (`vocab_logits`): a head `[D, V]` gathered whole is SDAR's largest
weight (151,936 x 2,048), and its gradient, summed over a loss's logit chunks before it is
reduce-scattered, is held whole in float32 too (2.3 GiB per chip for SDAR-1.7B's OPD step on a
v5p-16). So where `fsdp` divides the vocabulary (`vocab_split`), the head and the embedding are
split over `fsdp` on the vocabulary axis and the logits are computed split the same way: the rows
of the final hidden states (rows x D, small) are gathered over `fsdp` instead, each chip computes
its slice of the vocabulary for them, and the softmax's sums over the vocabulary are collectives.
No chip then holds the head or its gradient whole, and a chip's logits are as large as before.
The embedding's lookup (`embed_rows`) is written out per shard for the same reason: left to the
partitioner, XLA:CPU gathers the whole table (and scatters its gradient into a whole one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ._attention import BATCH_AXES, MODEL_AXIS


def _mesh() -> jax.sharding.AbstractMesh | None:
    """The mesh set with `jax.set_mesh`, or None without one (or one without bdlm's axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or not {*BATCH_AXES, MODEL_AXIS} <= set(mesh.axis_names) else mesh


def rows(x: jax.Array, features: str | None = None) -> jax.Array:
    """`x [rows, ..., features]` with its rows over (`data`, `fsdp`) and its last axis over
    `features` (`"model"` for heads and the MLP's hidden units, None for the residual stream and
    the logits); unchanged without a mesh."""
    if _mesh() is None:
        return x
    return jax.lax.with_sharding_constraint(x, P(BATCH_AXES, *[None] * (x.ndim - 2), features))


def vocab_split(vocab_size: int, fsdp: int) -> bool:
    """Whether the vocabulary axis (of the embedding, the head and the logits) is split over
    `fsdp`: when `fsdp` > 1 divides it (every released checkpoint's padded vocabulary does);
    otherwise the embedding axis is split, as every other weight's."""
    return fsdp > 1 and vocab_size % fsdp == 0


def vocab_logits(x: jax.Array) -> jax.Array:
    """Logits `[rows, ..., V]`: with `vocab_split`, rows over `data` and the vocabulary over
    `fsdp`; otherwise rows over (`data`, `fsdp`) with the vocabulary whole (`rows`)."""
    mesh = _mesh()
    if mesh is None or not vocab_split(x.shape[-1], mesh.shape["fsdp"]):
        return rows(x)
    return jax.lax.with_sharding_constraint(x, P("data", *[None] * (x.ndim - 2), "fsdp"))


def embed_rows(table_VxD: jax.Array, tokens_BxT: jax.Array, dtype) -> jax.Array:
    """`table[tokens]` in `dtype`, rows over (`data`, `fsdp`). With `vocab_split` (and rows that the
    data-parallel axes divide; XLA partitions the others), per shard under `jax.shard_map`: the
    token ids of the `fsdp` group are gathered, each chip looks up the ids in its slice of the
    vocabulary (zeros elsewhere), and a reduce-scatter over `fsdp` adds the slices and hands each
    chip its rows back (exactly: every sum is one lookup and zeros). The table and its gradient
    stay split; the collectives move ids and rows x D."""
    mesh = _mesh()
    if mesh is None or not vocab_split(table_VxD.shape[0], mesh.shape["fsdp"]) \
            or tokens_BxT.shape[0] % (mesh.shape["data"] * mesh.shape["fsdp"]):  # rows that do not split evenly
        return rows(jnp.take(table_VxD, tokens_BxT, axis=0).astype(dtype))

    def lookup(table_local, tokens_local):
        tokens = jax.lax.all_gather(tokens_local, "fsdp", axis=0, tiled=True)  # the fsdp group's rows
        local = tokens - jax.lax.axis_index("fsdp") * table_local.shape[0]
        mine = (local >= 0) & (local < table_local.shape[0])
        x = jnp.take(table_local, jnp.where(mine, local, 0), axis=0).astype(dtype)
        x = jnp.where(mine[..., None], x, jnp.zeros((), dtype))
        return jax.lax.psum_scatter(x, "fsdp", scatter_dimension=0, tiled=True)

    return jax.shard_map(lookup, mesh=mesh, in_specs=(P("fsdp", None), P(BATCH_AXES, None)),
                         out_specs=P(BATCH_AXES, None, None))(table_VxD, tokens_BxT)
