"""Rematerialization changes what the backward pass keeps, never what it computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bd_models import BlockDiffusionLM, ConfigError, ModelConfig

CONFIG = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, block_size=4,
                     q_tile=16, k_tile=16)


def _loss(model, layout):
    return jnp.sum(jnp.tanh(model(layout)) * layout.valid[..., None])


@pytest.mark.parametrize("config", [CONFIG, CONFIG.replace(qk_norm=True, qkv_bias=True, activation="gelu_tanh")],
                         ids=["plain", "qk_norm_bias_gelu"])
def test_gradients_are_the_same_under_every_policy(layouts, config):
    """The loss is bit-identical. The gradients agree to the last bits of each leaf's largest entry
    (16 ulp of it): XLA:CPU may sum a reduction over tokens (a norm scale's gradient, the
    embedding's) in another order in the rematerialized program, and the order depends on the
    host's CPU. Measured: on an AMD EPYC host only `attn_norm` differed, by one ulp; on an Intel
    Xeon host several leaves differ by up to 3.8 ulp in one process and 5.3 ulp (`q_norm`'s, a sum
    over every token and head) in another; on the hosts of earlier runs every leaf was
    bit-identical. A wrong gradient differs by orders of magnitude more."""
    layout = layouts(0, batch=2, prompt_blocks=1, completion_blocks=2).layout
    grad = jax.jit(jax.value_and_grad(_loss))
    loss, grads = grad(BlockDiffusionLM(config.replace(remat="none"), key=jax.random.key(0)), layout)
    for policy in ("elementwise", "full", "save_matmuls"):
        remat_loss, remat_grads = grad(BlockDiffusionLM(config.replace(remat=policy), key=jax.random.key(0)), layout)
        assert remat_loss == loss, policy
        for got, want in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(grads)):
            ulp = np.finfo(np.float32).eps * float(jnp.max(jnp.abs(want)))
            np.testing.assert_allclose(got, want, rtol=0, atol=16 * ulp, err_msg=policy)


def test_remat_saves_less_for_the_backward_pass(layouts):
    layout = layouts(0, batch=2, prompt_blocks=1, completion_blocks=2).layout

    def residual_bytes(policy):
        model = BlockDiffusionLM(CONFIG.replace(remat=policy), key=jax.random.key(0))
        _, vjp = jax.vjp(lambda m: _loss(m, layout), model)
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(vjp) if isinstance(x, jax.Array))

    none, elementwise, matmuls, full = (residual_bytes(p) for p in ("none", "elementwise", "save_matmuls", "full"))
    assert full < matmuls < elementwise < none


def test_unknown_policy_names_the_field():
    expected = r"ModelConfig.remat: expected one of \('elementwise', 'none', 'full', 'save_matmuls'\)"
    with pytest.raises(ConfigError, match=expected):
        CONFIG.replace(remat="offload")
