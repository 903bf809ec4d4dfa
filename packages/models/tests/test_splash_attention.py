"""`attention="splash"` (TPU's splash kernels with each row's block-diffusion mask; on CPU in
Pallas' interpret mode) equals the dense reference in value and gradient, with padding to whole
tiles, invalid tokens, grouped-query heads, a head dim padded to the lane width and rows whose
replay views lie in different blocks; a whole model's logits and parameter gradients, on one
device and on a mesh. Tiles that are not multiples of 128 are refused by name. Its TPU program is
compiled ahead of time in `packages/train/tests/test_plan.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bd_core import ConfigError, TokenMeta
from bd_models import BlockDiffusionLM, ModelConfig, make_mesh
from bd_models._attention import dense_attention
from bd_models._splash_attention import splash_attention

CONFIG = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, block_size=4,
                     q_tile=128, k_tile=128, attention="splash")


def _rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


@pytest.mark.parametrize("seed,views", [(0, 2), (1, 3)])
def test_kernel_equals_dense_in_value_and_gradient(layouts, seed, views):
    packed = layouts(seed, views_per_block=views)
    layout = packed.layout
    b, t = layout.shape
    assert t % 128 and not np.all(layout.valid), "the layout should need padding and hold invalid tokens"
    # Row 1's noisy views in reverse order: its views' blocks differ from row 0's, as in a replay.
    start, end, size = packed.canvas_len, packed.views[-1][2] + packed.block_size, packed.block_size
    order = np.concatenate([np.arange(start, start + size) + size * i for i in reversed(range((end - start) // size))])
    fields = [np.array(a) for a in (layout.view_ids, layout.block_ids, layout.valid)]
    for a in fields:
        a[1, start:end] = a[1, order]
    meta = TokenMeta(*(jnp.asarray(a) for a in fields))
    assert not np.array_equal(fields[1][0], fields[1][1])
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, 2, 3, t, 8))  # 2 kv heads, 3 query heads each; head dim 8 padded to 128
    k, v = jax.random.normal(keys[1], (b, 2, t, 8)), jax.random.normal(keys[2], (b, 2, t, 8))
    probe = jax.random.normal(keys[3], q.shape)
    dense = lambda q, k, v: dense_attention(q, k, v, meta, meta)  # noqa: E731
    splash = lambda q, k, v: splash_attention(q, k, v, meta)  # noqa: E731

    def value_and_grads(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(probe * fn(q, k, v)), argnums=(0, 1, 2)))(q, k, v)

    out = jax.jit(splash)(q, k, v)
    assert _rel(out, dense(q, k, v)) <= 1e-5
    assert float(jnp.max(jnp.abs(out * ~meta.valid[:, None, None, :, None]))) == 0.0  # invalid rows: exactly 0
    (vs, gs), (vd, gd) = value_and_grads(splash), value_and_grads(dense)
    assert _rel(vs, vd) <= 1e-5
    for got, want in zip(gs, gd):
        assert _rel(got, want) <= 1e-5


def _logits_value_and_grads(model, layout, probe):
    def loss(m):
        logits = m(layout)
        return jnp.sum(probe * logits * layout.valid[..., None]), logits

    (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(model)
    return logits, value, grads


@pytest.mark.parametrize("on_mesh", [False, True])
def test_model_with_splash_attention_equals_dense(layouts, on_mesh):
    layout = layouts(2, batch=2, views_per_block=2).layout
    splash = BlockDiffusionLM(CONFIG, key=jax.random.key(2))
    dense = splash.with_attention("dense")
    probe = jax.random.normal(jax.random.key(99), (*layout.shape, CONFIG.vocab_size))
    dense_out = jax.jit(_logits_value_and_grads)(dense, layout, probe)
    if on_mesh:  # per shard under shard_map: batch over data, kv heads over model
        mesh = make_mesh(data=2, fsdp=1, model=2, devices=jax.devices()[:4])
        with jax.set_mesh(mesh):
            splash_out = jax.jit(_logits_value_and_grads)(splash, layout, probe)
    else:
        splash_out = jax.jit(_logits_value_and_grads)(splash, layout, probe)
    (ls, vs, gs), (ld, vd, gd) = splash_out, dense_out
    valid = np.asarray(layout.valid)
    assert _rel(ls[valid], ld[valid]) <= 1e-5 and _rel(vs, vd) <= 1e-5
    for got, want in zip(jax.tree.leaves(gs), jax.tree.leaves(gd)):
        assert _rel(got, want) <= 1e-5


def test_tiles_that_are_not_lane_multiples_are_refused():
    with pytest.raises(ConfigError, match=r"q_tile.*multiple of 128 with attention='splash'.*q_tile = k_tile = 128"):
        CONFIG.replace(q_tile=64)
