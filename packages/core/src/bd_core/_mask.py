"""The attention rule of the view layout, once, for any query set against any key set.

`allowed(q, k)` reads a `TokenMeta` (view, block, validity) of queries and of keys that need not be
the same tokens (key tiles, KV-cache entries); `attention_allowed(layout)` is `allowed(m, m)` for a
whole packed layout. Shape letters: see bd_core (B batch, T queries, S keys).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ._batch import CLEAN_VIEW, ViewLayout

Array = jax.Array


class TokenMeta(NamedTuple):
    """What the rule reads of each token, all `[B, T]`."""

    view_ids: Array
    block_ids: Array
    valid: Array

    @classmethod
    def from_layout(cls, layout: ViewLayout) -> TokenMeta:
        """The view ids, block ids and validity of a layout's tokens."""
        return cls(jnp.asarray(layout.view_ids), jnp.asarray(layout.block_ids), jnp.asarray(layout.valid))

    def slice(self, start, size: int, axis: int = 1) -> TokenMeta:
        """The metadata of `size` tokens from `start` along `axis` (a query or key tile)."""
        return TokenMeta(*(jax.lax.dynamic_slice_in_dim(a, start, size, axis) for a in self))

    def pad_to(self, length: int) -> TokenMeta:
        """Right-pad with invalid tokens (they are never attended, and attend nothing)."""
        extra = length - self.valid.shape[1]
        if extra == 0:
            return self
        pad = lambda a: jnp.pad(a, ((0, 0), (0, extra)))  # noqa: E731
        return TokenMeta(pad(self.view_ids), pad(self.block_ids), pad(self.valid))


def allowed(q: TokenMeta, k: TokenMeta) -> Array:
    """`[B, T, S]` bool: may query t attend key s (DESIGN.md, "View layout").

    Both valid, and: s is clean from an earlier block; or both are clean in the same block; or both
    belong to the same noisy view and the same block.
    """
    vq_BxTx1, vk_Bx1xS = q.view_ids[:, :, None], k.view_ids[:, None, :]
    bq_BxTx1, bk_Bx1xS = q.block_ids[:, :, None], k.block_ids[:, None, :]
    both_valid = q.valid[:, :, None] & k.valid[:, None, :]
    earlier_clean = (vk_Bx1xS == CLEAN_VIEW) & (bk_Bx1xS < bq_BxTx1)
    same_block_same_view = (vq_BxTx1 == vk_Bx1xS) & (bk_Bx1xS == bq_BxTx1)
    return both_valid & (earlier_clean | same_block_same_view)


def attention_allowed(layout: ViewLayout) -> Array:
    """The rule over one packed layout, `[B, T, T]` bool: `allowed(m, m)` for its `TokenMeta`."""
    meta = TokenMeta.from_layout(layout)
    return allowed(meta, meta)
