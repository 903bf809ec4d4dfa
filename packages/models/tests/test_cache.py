"""Cached incremental decoding gives the packed layout's logits (DESIGN.md invariant 2)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bd_core import ViewLayout
from bd_models import BlockDiffusionLM, ModelConfig, RopeScaling, rope_angles

CONFIG = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, block_size=4,
                     q_tile=8, k_tile=8)


def _chunk(layout: ViewLayout, columns, view_id=None) -> ViewLayout:
    take = lambda a: np.asarray(a)[:, columns]  # noqa: E731
    views = take(layout.view_ids) if view_id is None else np.full_like(take(layout.view_ids), view_id)
    return ViewLayout.create(take(layout.tokens), take(layout.positions), take(layout.block_ids), views,
                             take(layout.valid))


def _close(cached, packed, valid):
    valid = np.asarray(valid)
    np.testing.assert_array_less(np.abs(np.asarray(cached) - np.asarray(packed))[valid].max(initial=0.0), 1e-5)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("attention", ["dense", "blocked"])
def test_cached_logits_equal_packed(layouts, seed, attention):
    packed = layouts(seed, batch=3)
    layout, b = packed.layout, packed.block_size
    model = BlockDiffusionLM(CONFIG.replace(attention=attention), key=jax.random.key(seed))
    full = jax.jit(model.__call__)(layout)
    step = jax.jit(lambda chunk, cache, commit: model.forward_cached(chunk, cache, commit=commit))
    decode = jax.jit(lambda chunk, cache: model.forward_cached(chunk, cache))

    cache = model.init_cache(layout.shape[0], packed.canvas_len)
    prompt = np.arange(packed.prompt_len)
    logits, cache = step(_chunk(layout, prompt), cache, _chunk(layout, prompt).valid)
    _close(logits, full[:, prompt], layout.valid[:, prompt])

    previous = None
    for _view_id, block, start in packed.views:
        noisy = np.arange(start, start + b)
        if previous is None:  # the first block: decode alone against the prompt
            logits, _ = decode(_chunk(layout, noisy, view_id=1), cache)
            _close(logits, full[:, noisy], layout.valid[:, noisy])
        else:  # commit the previous block's clean tokens and decode this block in one pass
            clean = np.arange(previous * b, (previous + 1) * b)
            chunk = _chunk(layout, np.concatenate([clean, noisy]), view_id=None)
            chunk = ViewLayout.create(chunk.tokens, chunk.positions, chunk.block_ids,
                                      np.concatenate([np.zeros((layout.shape[0], b), int),
                                                      np.ones((layout.shape[0], b), int)], axis=1), chunk.valid)
            commit = np.concatenate([np.asarray(chunk.valid[:, :b]), np.zeros((layout.shape[0], b), bool)], axis=1)
            logits, cache = step(chunk, cache, commit)
            _close(logits[:, :b], full[:, clean], layout.valid[:, clean])
            _close(logits[:, b:], full[:, noisy], layout.valid[:, noisy])
        previous = block
    assert bool(jnp.all(cache.valid[:, : previous * b] == layout.valid[:, : previous * b]))


def test_empty_cache_and_commit_rules():
    model = BlockDiffusionLM(CONFIG, key=jax.random.key(0))
    cache = model.init_cache(2, 12)
    assert [k.shape for k in cache.k] == [(2, 2, 8, 12)] * 2 and not bool(cache.valid.any())
    noisy = ViewLayout.create(np.zeros((2, 4), int), np.tile(np.arange(4), (2, 1)), np.zeros((2, 4), int),
                              np.ones((2, 4), int), np.ones((2, 4), bool))
    with pytest.raises(ValueError, match="noisy"):
        model.forward_cached(noisy, cache, commit=jnp.ones((2, 4), bool))
    # under jit (no host callback, so the program can be cached on disk) it is not written
    _, after = jax.jit(lambda m, c: m.forward_cached(noisy, c, commit=jnp.ones((2, 4), bool)))(model, cache)
    assert not bool(after.valid.any())
    # a position past the cache has no RoPE angles in it: an eager call says so
    beyond = ViewLayout.create(np.zeros((2, 4), int), np.tile(np.arange(10, 14), (2, 1)), np.full((2, 4), 2),
                               np.zeros((2, 4), int), np.ones((2, 4), bool))
    with pytest.raises(ValueError, match=r"outside the cache's \[0, 12\)"):
        model.forward_cached(beyond, cache)


@pytest.mark.parametrize("scaled", [False, True])
def test_the_cache_rope_angles_are_the_computed_ones_bit_for_bit(scaled):
    """A cached step looks its RoPE angles up in the cache's table instead of computing them: the
    table must hold exactly what `rope_angles` computes, inside jit as the sampler runs it."""
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16) if scaled else None
    config = CONFIG.replace(rope_theta=5e5, rope_scaling=scaling)
    model = BlockDiffusionLM(config, key=jax.random.key(0))
    positions = jnp.asarray(np.random.default_rng(0).integers(0, 96, (3, 20)), jnp.int32)
    looked_up = jax.jit(lambda p: model.init_cache(3, 96).rope_angles(p))(positions)
    computed = jax.jit(lambda p: rope_angles(p, config))(positions)
    for a, b in zip(looked_up, computed, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("attention", ["dense", "blocked"])
def test_padding_ids_outside_the_vocabulary_change_no_valid_output(layouts, attention):
    """Padding (invalid positions) is never attended, whatever id it holds: -100 or an id past the
    vocabulary (which would embed as NaN, and 0 x NaN in the masked attention turned the row's
    real logits to NaN) give the valid positions' logits bit for bit, packed and cached."""
    packed = layouts(2, batch=3)
    layout = packed.layout
    model = BlockDiffusionLM(CONFIG.replace(attention=attention), key=jax.random.key(4))
    valid = np.asarray(layout.valid)
    reference = np.asarray(jax.jit(model.__call__)(layout))
    prompt = np.arange(packed.prompt_len)
    cache = model.init_cache(layout.shape[0], packed.canvas_len)
    step = jax.jit(lambda chunk, cache: model.forward_cached(chunk, cache, commit=chunk.valid))
    cached_reference, _ = step(_chunk(layout, prompt), cache)
    for pad in (-100, CONFIG.vocab_size + 5):
        padded = ViewLayout.create(np.where(valid, np.asarray(layout.tokens), pad), layout.positions, layout.block_ids,
                                   layout.view_ids, layout.valid)
        logits = np.asarray(jax.jit(model.__call__)(padded))
        np.testing.assert_array_equal(logits[valid], reference[valid])
        cached, _ = step(_chunk(padded, prompt), cache)
        keep = valid[:, prompt]
        np.testing.assert_array_equal(np.asarray(cached)[keep], np.asarray(cached_reference)[keep])
