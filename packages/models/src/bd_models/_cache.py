"""`KVCache`: the clean stream of committed blocks, one slot per canvas position.

Slot index == canvas position, so every row shares the block grid (prompts are left-padded to a
block boundary). Entries are clean view-0 keys; `valid` says which slots hold one.
Shape letters: see bd_core (L layers, B, S slots, K kv heads, E head dim, T chunk tokens).
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, Shaped

from bd_core import CLEAN_VIEW, TokenMeta


class KVCache(eqx.Module):
    """Rotated keys and values `[L, B, S, K, E]` (S = the most canvas positions it holds), with
    per-slot validity and canvas block ids `[B, S]`."""

    k: Shaped[Array, "L B S K E"]
    v: Shaped[Array, "L B S K E"]
    valid: Bool[Array, "B S"]
    block_ids: Int[Array, "B S"]

    @property
    def max_len(self) -> int:
        return int(self.valid.shape[1])

    @classmethod
    def empty(cls, n_layers: int, batch_size: int, max_len: int, n_kv_heads: int, head_dim: int,
              dtype) -> KVCache:
        shape = (n_layers, batch_size, max_len, n_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch_size, max_len), bool),
                   jnp.zeros((batch_size, max_len), jnp.int32))

    def meta(self) -> TokenMeta:
        """What the attention rule reads: every cached entry is clean (view 0)."""
        return TokenMeta(jnp.full_like(self.block_ids, CLEAN_VIEW), self.block_ids, self.valid)

    def write(self, k_LxBxTxKxE, v_LxBxTxKxE, positions_BxT, block_ids_BxT, commit_BxT) -> KVCache:
        """Store the committed entries at slot = position; the others are dropped."""
        b, t = positions_BxT.shape
        slot_BxT = jnp.where(commit_BxT, positions_BxT, self.max_len)  # out of range -> dropped
        row_BxT = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        return KVCache(
            k=self.k.at[:, row_BxT, slot_BxT].set(k_LxBxTxKxE.astype(self.k.dtype), mode="drop"),
            v=self.v.at[:, row_BxT, slot_BxT].set(v_LxBxTxKxE.astype(self.v.dtype), mode="drop"),
            valid=self.valid.at[row_BxT, slot_BxT].set(True, mode="drop"),
            block_ids=self.block_ids.at[row_BxT, slot_BxT].set(block_ids_BxT, mode="drop"),
        )
