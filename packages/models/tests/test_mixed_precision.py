"""Mixed precision: float32 master weights with bfloat16 compute (`compute_dtype="bfloat16"`) give
the float32 model's logits, loss and gradients within stated tolerances.

What stays float32 by design: parameters and their gradients, RMSNorm statistics, RoPE angles,
attention scores and softmax (all three kernels accumulate in float32), the logits and the loss. What
runs in bfloat16: the activations and the matmul operands. bfloat16 keeps 8 bits of mantissa
(relative rounding 2^-9), and the errors below are what a 2-layer model accumulates from that.
Measured on these seeds: logit error ≤ 0.052 of a logit spread of ~1.0, loss within 6e-4
relative, each gradient within 2.2% (relative L2); the bounds are about twice that.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bd_models import BlockDiffusionLM, ModelConfig

BASE = dict(vocab_size=50, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, block_size=4)


def _mixed(model: BlockDiffusionLM) -> BlockDiffusionLM:
    """The same float32 arrays with bfloat16 compute (`with_attention` rebuilds around a new static
    config and shares the arrays)."""
    mixed = model.with_attention(model.config.attention)
    object.__setattr__(mixed, "config", model.config.replace(compute_dtype="bfloat16"))
    return mixed


@eqx.filter_jit  # compiled once per model config: the seeds change values, not shapes
def _logits_loss_grads(model, layout, targets, weights):
    def loss(model):
        logp = jax.nn.log_softmax(model(layout), axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0] * weights) / weights.sum()

    return model(layout), *jax.value_and_grad(loss)(model)


@pytest.mark.parametrize("attention,seed", [*((a, s) for a in ("dense", "blocked") for s in (0, 1, 2)), ("pallas", 0)])
def test_bf16_compute_matches_float32_within_tolerance(layouts, attention, seed):
    layout = layouts(seed).layout
    full = BlockDiffusionLM(ModelConfig(**BASE, attention=attention), key=jax.random.key(seed))
    mixed = _mixed(full)
    assert mixed.config.compute_dtype == "bfloat16" and mixed.config.param_dtype == "float32"
    targets = jnp.asarray(np.random.default_rng(seed).integers(0, BASE["vocab_size"], layout.tokens.shape))
    weights = layout.valid.astype(jnp.float32)

    logits32, loss32, grads32 = _logits_loss_grads(full, layout, targets, weights)
    logits16, loss16, grads16 = _logits_loss_grads(mixed, layout, targets, weights)

    valid = np.asarray(layout.valid)
    assert logits16.dtype == jnp.float32
    error = np.abs(np.asarray(logits16) - np.asarray(logits32))[valid]
    spread = np.asarray(logits32)[valid].std()
    assert 1e-4 < error.max() <= 0.1 * spread, (error.max(), spread)  # nonzero: the compute did run in bf16
    assert abs(float(loss16) - float(loss32)) <= 2e-3 * float(loss32)
    for (path, g32), g16 in zip(jax.tree_util.tree_leaves_with_path(grads32), jax.tree.leaves(grads16)):
        assert g16.dtype == jnp.float32, jax.tree_util.keystr(path)  # master weights get float32 gradients
        g32, g16 = np.asarray(g32).ravel(), np.asarray(g16).ravel()
        relative = np.linalg.norm(g16 - g32) / np.linalg.norm(g32)
        assert relative <= 0.05, (jax.tree_util.keystr(path), relative)
