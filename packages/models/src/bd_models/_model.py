"""`BlockDiffusionLM`: embedding, scanned decoder layers, final norm, (tied) LM head.

`model(layout)` is the packed forward over any `ViewLayout`; `forward_cached` evaluates the same
attention rule incrementally against a `KVCache`. Logits are float32 whatever the compute dtype.
Shape letters: see bd_core (B, T, S cache slots, L, D, K, G, E, V); `BT` is the flattened B·T axis.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from bd_core import CLEAN_VIEW, TokenMeta, ViewLayout

from ._activations import embed_rows, vocab_logits
from ._attention import attend, cached_attention
from ._cache import KVCache
from ._config import ModelConfig
from ._layers import DecoderLayer, rms_norm, rope_angles, rope_table
from ._unroll import unrolled


def remat_layer(layer_step, policy: str):
    """`layer_step` under the config's rematerialization policy. The layer matmuls are 2-D (no
    batch dims), so `save_matmuls` keeps exactly them and recomputes norms, RoPE and attention.
    (`elementwise` checkpoints stretches inside the layer instead: `DecoderLayer`.)"""
    if policy in ("none", "elementwise"):
        return layer_step
    saveable = jax.checkpoint_policies.dots_with_no_batch_dims_saveable if policy == "save_matmuls" else None
    # Inside a scan the CSE barrier only costs: the scan body already stops XLA from merging.
    return jax.checkpoint(layer_step, policy=saveable, prevent_cse=False)


def _any_where_concrete(flags) -> bool:
    """Whether any flag is set, where the flags are concrete (an eager call); False under jit. A
    runtime check (`eqx.error_if`, a host callback) would keep every program that samples out of
    JAX's persistent compilation cache, so the checks of `forward_cached` are eager only."""
    try:
        return bool(jnp.any(flags))
    except jax.errors.ConcretizationTypeError:  # traced: no value to check
        return False


def _heads_first(q_BxTxKxGxE, k_BxTxKxE, v_BxTxKxE):
    return (jnp.transpose(q_BxTxKxGxE, (0, 2, 3, 1, 4)), jnp.transpose(k_BxTxKxE, (0, 2, 1, 3)),
            jnp.transpose(v_BxTxKxE, (0, 2, 1, 3)))


def head_logits(h_BxTxD: Float[Array, "B T D"], weight: Float[Array, "V D"] | Float[Array, "D V"], *, tied: bool,
                dtype) -> Float[Array, "B T V"]:
    """Float32 logits of final hidden states under the LM head `weight` (`[V, D]` when `tied` to the
    embedding, else `[D, V]`), multiplied in `dtype`: `BlockDiffusionLM.unembed` with the weight
    an argument (what `sum_logits` differentiates)."""
    b, t, d = h_BxTxD.shape
    head_DxV = weight.T if tied else weight
    logits_BTxV = vocab_logits(jnp.dot(h_BxTxD.reshape(b * t, d).astype(dtype), head_DxV.astype(dtype),
                                       preferred_element_type=jnp.float32))
    return logits_BTxV.reshape(b, t, -1)


def _input_ids(layout: ViewLayout) -> Int[Array, "B T"]:
    """The ids to embed: the layout's tokens, with 0 at invalid (padding) positions. A padding id
    outside the vocabulary (-100, or an id past `vocab_size`) would embed as NaN, and the masked
    attention's zero weights times NaN values would turn its row's real outputs to NaN."""
    return jnp.where(jnp.asarray(layout.valid), jnp.asarray(layout.tokens), 0)


class BlockDiffusionLM(eqx.Module):
    """The block-diffusion decoder: bidirectional inside a block, causal across blocks.

    Call it on a `bd_core.ViewLayout` (`model(layout)`) for logits `[B, T, V]`; `forward_cached`
    is the sampler's incremental path under the same attention rule.

    Example:
        ```python
        import jax
        from bd_models import BlockDiffusionLM, ModelConfig

        config = ModelConfig(vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=256,
                             block_size=4)
        model = BlockDiffusionLM(config, key=jax.random.key(0))
        ```

    Attributes:
        config: the architecture.
        embedding: the token embedding `[V, D]`.
        layers: the decoder layers, stacked along a leading `[L]` axis.
        final_norm: the RMSNorm scale before the head.
        lm_head: the output head `[D, V]`, or None when tied to the embedding.
    """

    config: ModelConfig = eqx.field(static=True)
    embedding: jax.Array
    layers: DecoderLayer
    final_norm: jax.Array
    lm_head: jax.Array | None

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        embed_key, layers_key, head_key = jax.random.split(key, 3)
        dtype = config.params_jnp_dtype
        self.config = config
        self.embedding = (jax.random.normal(embed_key, (config.vocab_size, config.d_model), jnp.float32)
                          * config.d_model ** -0.5).astype(dtype)
        layer_keys = jax.random.split(layers_key, config.n_layers)
        self.layers = eqx.filter_vmap(lambda k: DecoderLayer(config, key=k))(layer_keys)
        self.final_norm = jnp.ones((config.d_model,), dtype)
        self.lm_head = None if config.tie_embeddings else (
            jax.random.normal(head_key, (config.d_model, config.vocab_size), jnp.float32)
            * config.d_model ** -0.5).astype(dtype)

    def with_attention(self, attention: str, *, q_tile: int | None = None,
                       k_tile: int | None = None) -> BlockDiffusionLM:
        """The same parameters with another attention implementation (or tile sizes)."""
        return self._with_config(self.config.replace(attention=attention, q_tile=q_tile or self.config.q_tile,
                                                     k_tile=k_tile or self.config.k_tile))

    def with_logits_chunk(self, logits_chunk: int) -> BlockDiffusionLM:
        """The same parameters with the losses' logits computed `logits_chunk` positions at a time
        (0: all at once); see `ModelConfig.logits_chunk`."""
        return self._with_config(self.config.replace(logits_chunk=logits_chunk))

    def _with_config(self, config: ModelConfig) -> BlockDiffusionLM:
        model = object.__new__(BlockDiffusionLM)  # the config is static: rebuild, sharing the arrays
        for field in ("embedding", "layers", "final_norm", "lm_head"):
            object.__setattr__(model, field, getattr(self, field))
        object.__setattr__(model, "config", config)
        return model

    def embed(self, tokens: Int[ArrayLike, "B T"]) -> Float[Array, "B T D"]:
        """The input embeddings of `tokens`, in the compute dtype."""
        return embed_rows(self.embedding, jnp.asarray(tokens), self.config.compute_jnp_dtype)

    def __call__(self, layout: ViewLayout) -> Float[Array, "B T V"]:
        return self.embed_forward(self.embed(_input_ids(layout)), layout)

    def embed_forward(self, x: Float[Array, "B T D"], layout: ViewLayout) -> Float[Array, "B T V"]:
        """The forward from input embeddings (what gradient-through-the-mask tests differentiate)."""
        return self.unembed(self._decode(x, layout))

    def features(self, layout: ViewLayout) -> Float[Array, "B T D"]:
        """The final hidden states (after the final norm, in the compute dtype): `unembed` of them
        is `self(layout)`. Losses that never hold every logit at once read these (`map_logits`)."""
        return self._decode(self.embed(_input_ids(layout)), layout)

    def _decode(self, x: Float[Array, "B T D"], layout: ViewLayout) -> Float[Array, "B T D"]:
        config = self.config
        cos, sin = rope_angles(layout.positions, config)
        meta = TokenMeta.from_layout(layout)

        def layer_step(x_BxTxD, layer: DecoderLayer):
            q, k, v = layer.qkv(x_BxTxD, cos, sin, config)
            out_BxKxGxTxE = attend(config.attention, *_heads_first(q, k, v), meta, meta,
                                   q_tile=config.q_tile, k_tile=config.k_tile)
            return layer.finish(x_BxTxD, jnp.transpose(out_BxKxGxTxE, (0, 3, 1, 2, 4)), config), None

        x, _ = lax.scan(remat_layer(layer_step, config.remat), x.astype(config.compute_jnp_dtype), self.layers,
                        unroll=unrolled())
        return self._final_norm(x)

    def _final_norm(self, x_BxTxD) -> Float[Array, "B T D"]:
        config = self.config
        b, t, d = x_BxTxD.shape
        h_BTxD = rms_norm(x_BxTxD.reshape(b * t, d), self.final_norm, config.norm_eps, config.compute_jnp_dtype)
        return h_BTxD.reshape(b, t, d)

    def unembed(self, h_BxTxD: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        """Float32 logits of final hidden states (`features`): the (tied) LM head's matmul, row by row,
        so a slice of the tokens gives the same logits as the whole."""
        return head_logits(h_BxTxD, self.head_weight, tied=self.lm_head is None, dtype=self.config.compute_jnp_dtype)

    @property
    def head_weight(self) -> Float[Array, "V D"] | Float[Array, "D V"]:
        """The LM head's weight: the embedding `[V, D]` when tied, else `lm_head` `[D, V]`."""
        return self.embedding if self.lm_head is None else self.lm_head

    def init_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty cache (every slot invalid) for canvases of up to `max_len` positions."""
        config = self.config
        return KVCache.empty(config.n_layers, batch_size, config.n_kv_heads, config.compute_jnp_dtype,
                             rope_table(max_len, config))

    def layer_list(self) -> tuple[DecoderLayer, ...]:
        """The stacked layers as one module each, what `forward_cached` loops over. A sampler splits
        them once per call and passes them to every step (`layers=`): splitting copies the weights."""
        return tuple(jax.tree.map(lambda w: w[i], self.layers) for i in range(self.config.n_layers))  # noqa: B023

    def forward_cached(self, chunk: ViewLayout, cache: KVCache, *, commit: Bool[ArrayLike, "B T"] | None = None,
                       layers: tuple[DecoderLayer, ...] | None = None) -> tuple[Float[Array, "B T V"], KVCache]:
        """Logits of `chunk` against `cache`, then write the `commit`-flagged entries to the cache.

        Chunk queries see the cache's valid entries (clean, with their block ids) and the chunk's
        own entries under the same rule as the packed layout. Committed entries must be valid
        clean (view 0) tokens (an eager call that flags another raises; under jit it is not
        written); they land at slot = position. Valid chunk positions must lie in `[0,
        cache.max_len)`, whose RoPE angles the cache holds (an eager call raises otherwise; under
        jit the lookup clamps). `layers`: `self.layer_list()`, split once by a caller that runs
        many steps (by default split here).
        """
        config = self.config
        positions = jnp.asarray(chunk.positions)
        if _any_where_concrete(jnp.asarray(chunk.valid) & ((positions < 0) | (positions >= cache.max_len))):
            raise ValueError(f"forward_cached: a chunk position lies outside the cache's [0, {cache.max_len}); "
                             "make the cache with init_cache(batch_size, max_len) for every position the canvas uses")
        cos, sin = cache.rope_angles(chunk.positions)
        chunk_meta = TokenMeta.from_layout(chunk)
        cache_meta = cache.meta()

        # A Python loop, not a scan: scanning over a stacked cache would copy each layer's slice.
        x_BxTxD, new_k, new_v = self.embed(_input_ids(chunk)), [], []
        for i, layer in enumerate(self.layer_list() if layers is None else layers):
            q, k, v = layer.qkv(x_BxTxD, cos, sin, config)
            q_BxKxGxTxE, k_BxKxTxE, v_BxKxTxE = _heads_first(q, k.astype(cache.k[i].dtype), v.astype(cache.v[i].dtype))
            out_BxKxGxTxE = cached_attention(q_BxKxGxTxE, cache.k[i], cache.v[i], cache_meta, k_BxKxTxE, v_BxKxTxE,
                                             chunk_meta)
            x_BxTxD = layer.finish(x_BxTxD, jnp.transpose(out_BxKxGxTxE, (0, 3, 1, 2, 4)), config)
            new_k.append(k_BxKxTxE)
            new_v.append(v_BxKxTxE)
        logits = self.unembed(self._final_norm(x_BxTxD))
        if commit is None:
            return logits, cache
        commit = jnp.asarray(commit) & jnp.asarray(chunk.valid)
        noisy = commit & (jnp.asarray(chunk.view_ids) != CLEAN_VIEW)
        if _any_where_concrete(noisy):  # under jit a flagged noisy entry is simply not written
            raise ValueError("forward_cached: commit flags a noisy (view != 0) entry; only clean entries are cached")
        commit = commit & ~noisy
        return logits, cache.write(new_k, new_v, chunk.positions, chunk.block_ids, commit)
