"""`KVCache`: the clean stream of committed blocks, one slot per canvas position.

Slot index == canvas position, so every row shares the block grid (prompts are left-padded to a
block boundary). Entries are clean view-0 keys; `valid` says which slots hold one.
Shape letters: see bd_core (B, K kv heads, S slots, E head dim, T chunk tokens).
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Shaped

from bd_core import CLEAN_VIEW, TokenMeta


class KVCache(eqx.Module):
    """Rotated keys and values of each layer, with per-slot validity and canvas block ids `[B, S]`
    (S = the most canvas positions it holds), and the RoPE cos/sin of those positions.

    Stored as attention reads them, so a decoding step copies nothing of the cache: one array per
    layer (slicing a stacked `[L, ...]` array per layer copied the layer's whole cache on every
    step), keys transposed `[B, K, E, S]` (the right operand of `q @ k^T`) and values `[B, K, S, E]`.
    A step looks its chunk's RoPE angles up in `rope_cos`/`rope_sin` (`E2` = E/2) instead of
    computing them: inside a sampling loop XLA:CPU fused the cos/sin into every q and k rotation of
    every layer, per head (BENCHMARKS.md, sampler).

    Attributes:
        k: each layer's rotated keys `[B, K, E, S]`.
        v: each layer's values `[B, K, S, E]`.
        valid: `[B, S]` which slots hold a token.
        block_ids: `[B, S]` each slot's canvas block.
        rope_cos: `[S, E/2]` RoPE cosines of the slots' positions.
        rope_sin: `[S, E/2]` RoPE sines of the slots' positions.
    """

    k: tuple[Shaped[Array, "B K E S"], ...]
    v: tuple[Shaped[Array, "B K S E"], ...]
    valid: Bool[Array, "B S"]
    block_ids: Int[Array, "B S"]
    rope_cos: Float[Array, "S E2"]
    rope_sin: Float[Array, "S E2"]

    @property
    def max_len(self) -> int:
        return int(self.valid.shape[1])

    @classmethod
    def empty(cls, n_layers: int, batch_size: int, n_kv_heads: int, dtype, rope: tuple[Array, Array]) -> KVCache:
        """Every slot invalid; `rope`: cos, sin `[S, E/2]` of positions 0..S-1 (`rope_table`)."""
        max_len, head_dim = rope[0].shape[0], 2 * rope[0].shape[1]
        k = tuple(jnp.zeros((batch_size, n_kv_heads, head_dim, max_len), dtype) for _ in range(n_layers))
        v = tuple(jnp.zeros((batch_size, n_kv_heads, max_len, head_dim), dtype) for _ in range(n_layers))
        return cls(k, v, jnp.zeros((batch_size, max_len), bool), jnp.zeros((batch_size, max_len), jnp.int32), *rope)

    def rope_angles(self, positions_BxT) -> tuple[Array, Array]:
        """cos, sin `[B, T, E/2]` of canvas positions below `max_len`: `rope_angles`' values."""
        return self.rope_cos[positions_BxT], self.rope_sin[positions_BxT]

    def meta(self) -> TokenMeta:
        """What the attention rule reads: every cached entry is clean (view 0)."""
        return TokenMeta(jnp.full_like(self.block_ids, CLEAN_VIEW), self.block_ids, self.valid)

    def write(self, k_BxKxTxE: list[Array], v_BxKxTxE: list[Array], positions_BxT, block_ids_BxT,
              commit_BxT) -> KVCache:
        """Store each layer's committed entries at slot = position; the others are dropped."""
        b, t = positions_BxT.shape
        slot_BxT = jnp.where(commit_BxT, positions_BxT, self.max_len)  # out of range -> dropped
        row_BxT = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        # Indexing [row, :, :, slot] / [row, :, slot] puts the indexed [B, T] first: the values go
        # as [B, T, K, E].
        entries = lambda x, dtype: jnp.transpose(x, (0, 2, 1, 3)).astype(dtype)  # noqa: E731
        return KVCache(
            k=tuple(c.at[row_BxT, :, :, slot_BxT].set(entries(x, c.dtype), mode="drop")
                    for c, x in zip(self.k, k_BxKxTxE)),
            v=tuple(c.at[row_BxT, :, slot_BxT].set(entries(x, c.dtype), mode="drop")
                    for c, x in zip(self.v, v_BxKxTxE)),
            valid=self.valid.at[row_BxT, slot_BxT].set(True, mode="drop"),
            block_ids=self.block_ids.at[row_BxT, slot_BxT].set(block_ids_BxT, mode="drop"),
            rope_cos=self.rope_cos,
            rope_sin=self.rope_sin,
        )
