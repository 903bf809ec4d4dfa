"""`attention="pallas"` (forward and backward as Pallas kernels; on CPU in Pallas' interpret mode)
equals the dense reference: the forward kernel's output and the backward kernels' gradients, with
tiles that the plan skips, padding, grouped-query heads and a head dim padded for Triton; and a
whole model's logits and parameter gradients. The same model's GPU program lowers, on this CPU
host, to three Triton kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bd_core import TokenMeta
from bd_models import BlockDiffusionLM, ModelConfig, tile_needed
from bd_models._attention import dense_attention
from bd_models._pallas_attention import pallas_attention

CONFIG = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, block_size=4,
                     q_tile=8, k_tile=8, attention="pallas")


def _rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


@pytest.mark.parametrize("seed,views,tiles", [(0, 2, (8, 8)), (1, 3, (16, 8))])
def test_kernel_equals_dense_in_value_and_gradient(layouts, seed, views, tiles):
    layout = layouts(seed, views_per_block=views).layout
    meta = TokenMeta.from_layout(layout)
    b, t = layout.shape
    assert t % tiles[0] or t % tiles[1], "the layout should need padding to whole tiles"
    padded_q, padded_k = meta.pad_to(-(-t // tiles[0]) * tiles[0]), meta.pad_to(-(-t // tiles[1]) * tiles[1])
    need = np.asarray(tile_needed(padded_q, padded_k, *tiles))
    assert need.sum() < need.size, "the plan should skip tiles, so the kernel's skipping is exercised"
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, 2, 3, t, 8))  # 2 kv heads, 3 query heads each
    k, v = jax.random.normal(keys[1], (b, 2, t, 8)), jax.random.normal(keys[2], (b, 2, t, 8))
    probe = jax.random.normal(keys[3], q.shape)
    dense = lambda q, k, v: dense_attention(q, k, v, meta, meta)  # noqa: E731
    pallas = lambda q, k, v: pallas_attention(q, k, v, meta, meta, q_tile=tiles[0], k_tile=tiles[1])  # noqa: E731

    def value_and_grads(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(probe * fn(q, k, v)), argnums=(0, 1, 2)))(q, k, v)

    assert _rel(jax.jit(pallas)(q, k, v), dense(q, k, v)) <= 1e-5
    (vp, gp), (vd, gd) = value_and_grads(pallas), value_and_grads(dense)
    assert _rel(vp, vd) <= 1e-5
    for got, want in zip(gp, gd):
        assert _rel(got, want) <= 1e-5


def test_model_with_pallas_attention_equals_dense(layouts):
    layout = layouts(2, batch=1, views_per_block=2).layout
    pallas = BlockDiffusionLM(CONFIG, key=jax.random.key(2))
    dense = pallas.with_attention("dense")
    probe = jax.random.normal(jax.random.key(99), (*layout.shape, CONFIG.vocab_size))

    def logits_value_and_grads(model):
        def loss(m):
            logits = m(layout)
            return jnp.sum(probe * logits * layout.valid[..., None]), logits

        (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(model)
        return logits, value, grads

    (lp, vp, gp), (ld, vd, gd) = (jax.jit(logits_value_and_grads)(m) for m in (pallas, dense))
    valid = np.asarray(layout.valid)
    assert _rel(lp[valid], ld[valid]) <= 1e-5 and _rel(vp, vd) <= 1e-5
    for got, want in zip(jax.tree.leaves(gp), jax.tree.leaves(gd)):
        assert _rel(got, want) <= 1e-5


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_gpu_program_lowers_every_kernel_through_triton(layouts, compute_dtype):
    """Lowering for CUDA runs Pallas' Triton lowering of the forward, dq and dk/dv kernels (it
    refuses shapes that are not powers of two, such as this config's head dim 48 unpadded); JAX's
    default GPU backend for `pallas_call`, Mosaic GPU, fails on these kernels at lowering."""
    config = CONFIG.replace(head_dim=48, q_tile=16, k_tile=16, compute_dtype=compute_dtype)
    assert config.head_dim == 48
    layout = layouts(3, batch=1, views_per_block=2).layout
    model = BlockDiffusionLM(config, key=jax.random.key(3))
    loss = lambda m: jnp.sum(m(layout) * layout.valid[..., None])  # noqa: E731
    text = jax.jit(jax.value_and_grad(loss)).trace(model).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3  # one layer body: forward, dq, dk/dv
