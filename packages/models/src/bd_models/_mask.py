"""The attention rule between any query set and any key set, and its tile-level summary.

`allowed(q, k)` evaluates bd_core.attention_allowed's three rules plus validity for queries and
keys that need not be the same tokens (key tiles, KV-cache entries); `allowed(m, m)` equals
`attention_allowed(layout)`. `tile_needed` says, conservatively, which key tiles a query tile can see.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from bd_core import CLEAN_VIEW, ViewLayout

Array = jax.Array


class TokenMeta(NamedTuple):
    """What the rule reads of each token, all `[B, T]`."""

    view_ids: Array
    block_ids: Array
    valid: Array

    @classmethod
    def from_layout(cls, layout: ViewLayout) -> TokenMeta:
        return cls(jnp.asarray(layout.view_ids), jnp.asarray(layout.block_ids), jnp.asarray(layout.valid))

    def slice(self, start, size: int, axis: int = 1) -> TokenMeta:
        return TokenMeta(*(jax.lax.dynamic_slice_in_dim(a, start, size, axis) for a in self))

    def pad_to(self, length: int) -> TokenMeta:
        """Right-pad with invalid tokens (they are never attended, and attend nothing)."""
        extra = length - self.valid.shape[1]
        if extra == 0:
            return self
        pad = lambda a: jnp.pad(a, ((0, 0), (0, extra)))  # noqa: E731
        return TokenMeta(pad(self.view_ids), pad(self.block_ids), pad(self.valid))


def allowed(q: TokenMeta, k: TokenMeta) -> Array:
    """`[B, Tq, Tk]` bool: may query i attend key j (DESIGN.md, "View layout")."""
    vq, vk = q.view_ids[:, :, None], k.view_ids[:, None, :]
    bq, bk = q.block_ids[:, :, None], k.block_ids[:, None, :]
    both_valid = q.valid[:, :, None] & k.valid[:, None, :]
    earlier_clean = (vk == CLEAN_VIEW) & (bk < bq)
    same_block_same_view = (vq == vk) & (bk == bq)
    return both_valid & (earlier_clean | same_block_same_view)


def tile_needed(q: TokenMeta, k: TokenMeta, q_tile: int, k_tile: int) -> Array:
    """`[N, M]` bool: may any row's query tile n attend any key in key tile m.

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
    q_block_max = jnp.max(jnp.where(qt.valid, qt.block_ids, -1), axis=-1)  # [B, N]
    k_clean_min = jnp.min(jnp.where(kt.valid & (kt.view_ids == CLEAN_VIEW), kt.block_ids, big), axis=-1)
    q_lo = jnp.min(jnp.where(qt.valid, q_code, big), axis=-1)
    q_hi = jnp.max(jnp.where(qt.valid, q_code, -1), axis=-1)
    k_lo = jnp.min(jnp.where(kt.valid, k_code, big), axis=-1)
    k_hi = jnp.max(jnp.where(kt.valid, k_code, -1), axis=-1)
    rule1 = k_clean_min[:, None, :] < q_block_max[:, :, None]
    overlap = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    return jnp.any(rule1 | overlap, axis=0)
