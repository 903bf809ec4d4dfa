"""Which key tiles a query tile can see: the tile-level summary of `bd_core.allowed`.

The rule itself lives in bd_core (`TokenMeta`, `allowed`); the blocked kernel asks `tile_needed`
which key tiles to visit and `needed_first` in which order. Shape letters: see bd_core (B, T, S;
Q/U query/key tile, I/J their counts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bd_core import CLEAN_VIEW, TokenMeta

Array = jax.Array


def tile_needed(q: TokenMeta, k: TokenMeta, q_tile: int, k_tile: int) -> Array:
    """`[I, J]` bool: may any row's query tile i attend any key in key tile j.

    Rule 1 is summarized exactly (min clean key block < max query block); rules 2 and 3 by the
    overlap of (view, block) code ranges, which over-approximates only for tiles that mix
    non-contiguous views. A tile computed needlessly costs time, never exactness. O(T) memory.
    """
    big = jnp.iinfo(jnp.int32).max
    n_blocks = jnp.maximum(jnp.max(jnp.where(q.valid, q.block_ids, 0)), jnp.max(jnp.where(k.valid, k.block_ids, 0))) + 1

    def tiles(meta: TokenMeta, size: int):
        b, t = meta.valid.shape
        return TokenMeta(*(a.reshape(b, t // size, size) for a in meta))

    qt, kt = tiles(q, q_tile), tiles(k, k_tile)
    q_code = qt.view_ids * n_blocks + qt.block_ids
    k_code = kt.view_ids * n_blocks + kt.block_ids
    q_block_max_BxI = jnp.max(jnp.where(qt.valid, qt.block_ids, -1), axis=-1)
    k_clean_min_BxJ = jnp.min(jnp.where(kt.valid & (kt.view_ids == CLEAN_VIEW), kt.block_ids, big), axis=-1)
    q_lo_BxI = jnp.min(jnp.where(qt.valid, q_code, big), axis=-1)
    q_hi_BxI = jnp.max(jnp.where(qt.valid, q_code, -1), axis=-1)
    k_lo_BxJ = jnp.min(jnp.where(kt.valid, k_code, big), axis=-1)
    k_hi_BxJ = jnp.max(jnp.where(kt.valid, k_code, -1), axis=-1)
    rule1_BxIxJ = k_clean_min_BxJ[:, None, :] < q_block_max_BxI[:, :, None]
    overlap_BxIxJ = (q_lo_BxI[:, :, None] <= k_hi_BxJ[:, None, :]) & (k_lo_BxJ[:, None, :] <= q_hi_BxI[:, :, None])
    return jnp.any(rule1_BxIxJ | overlap_BxIxJ, axis=0)


def needed_first(need_IxJ: Array) -> tuple[Array, Array]:
    """A visiting plan from `[I, J]` needed flags: per row the indices of its needed columns first,
    in order (`[I, J]` int32; the unneeded follow), and how many are needed (`[I]` int32)."""
    return (jnp.argsort(~need_IxJ, axis=1, stable=True).astype(jnp.int32),
            jnp.sum(need_IxJ, axis=1, dtype=jnp.int32))
