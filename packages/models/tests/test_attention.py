"""Key tiles cover the mask rule, the attention implementations agree (`blocked` equals `dense`),
and the mask holds through gradients (no gradient from a query to a token it may not see; non-zero
to those it may). The rule itself is proven in bd_core's tests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bd_core import TokenMeta, allowed, attention_allowed
from bd_models import BlockDiffusionLM, ModelConfig, tile_needed

CONFIG = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, block_size=4,
                     q_tile=8, k_tile=8)


def _rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


@pytest.mark.parametrize("seed", range(3))
def test_tiles_cover_the_rule(layouts, seed):
    layout = layouts(seed, views_per_block=2).layout
    meta = TokenMeta.from_layout(layout)
    mask = np.asarray(allowed(meta, meta))
    tile, t = 8, layout.shape[1]
    padded = meta.pad_to(-(-t // tile) * tile)
    need = np.asarray(tile_needed(padded, padded, tile, tile))
    full = np.zeros((padded.valid.shape[1],) * 2, bool)
    full[:t, :t] = mask.any(axis=0)
    covered = full.reshape(need.shape[0], tile, need.shape[1], tile).any(axis=(1, 3))
    assert np.all(need[covered]), "a tile with an allowed entry was skipped"
    assert need.sum() < need.size, "the plan should skip the tiles the block mask leaves empty"


@pytest.mark.parametrize("seed,views,tiles", [(0, 1, (8, 8)), (1, 2, (8, 16)), (2, 3, (16, 8))])
def test_blocked_equals_dense(layouts, seed, views, tiles):
    layout = layouts(seed, batch=3, views_per_block=views).layout
    config = CONFIG.replace(q_tile=tiles[0], k_tile=tiles[1])
    blocked = BlockDiffusionLM(config, key=jax.random.key(seed))
    dense = blocked.with_attention("dense")
    probe = jax.random.normal(jax.random.key(99), (*layout.shape, config.vocab_size))

    def value_and_grads(model):
        return jax.value_and_grad(lambda m: jnp.sum(probe * m(layout) * layout.valid[..., None]))(model)

    (vb, gb), (vd, gd) = jax.jit(value_and_grads)(blocked), jax.jit(value_and_grads)(dense)
    logits_b, logits_d = jax.jit(blocked.__call__)(layout), jax.jit(dense.__call__)(layout)
    valid = np.asarray(layout.valid)
    assert _rel(logits_b[valid], logits_d[valid]) <= 1e-5
    assert _rel(vb, vd) <= 1e-5
    for leaf_b, leaf_d in zip(jax.tree.leaves(gb), jax.tree.leaves(gd)):
        assert _rel(leaf_b, leaf_d) <= 1e-5


@pytest.mark.parametrize("attention", ["dense", "blocked"])
def test_mask_holds_through_gradients(layouts, attention):
    layout = layouts(3, batch=2, views_per_block=2).layout
    model = BlockDiffusionLM(CONFIG.replace(attention=attention), key=jax.random.key(0))
    x = model.embed(layout.tokens)
    b, t = layout.shape
    probe = jax.random.normal(jax.random.key(1), (CONFIG.vocab_size,))

    rows, queries = np.nonzero(np.asarray(layout.valid))
    # One cotangent per (row, query): a one-hot over tokens times a random vocab probe.
    cotangents = jnp.zeros((len(rows), b, t, CONFIG.vocab_size)).at[np.arange(len(rows)), rows, queries].set(probe)
    _, vjp = jax.vjp(lambda e: model.embed_forward(e, layout), x)
    # lax.map, not vmap: each cotangent is pulled back on its own.
    grads = jax.jit(lambda cts: jax.lax.map(lambda ct: vjp(ct)[0], cts))(cotangents)  # [n, B, T, D]
    reaches = np.asarray(jnp.any(grads != 0, axis=-1))  # [n, B, T]
    expected = np.zeros_like(reaches)
    mask = np.asarray(attention_allowed(layout))
    for i, (row, query) in enumerate(zip(rows, queries)):
        # Every allowed key of a packed layout sees only keys the query sees too, so over any
        # number of layers the reachable set is exactly the allowed set.
        expected[i, row] = mask[row, query]
    np.testing.assert_array_equal(reaches, expected)
