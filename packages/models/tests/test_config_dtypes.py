"""Config validation names the field and the fix; a bf16 model trains and keeps its dtypes."""

import jax
import jax.numpy as jnp
import pytest

from bd_models import BlockDiffusionLM, ConfigError, ModelConfig, model_flops

BASE = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, block_size=4)


@pytest.mark.parametrize("change,field", [
    (dict(d_model=30), "d_model"), (dict(n_kv_heads=3), "n_kv_heads"), (dict(attention="flash"), "attention"),
    (dict(param_dtype="float64"), "param_dtype"), (dict(n_layers=0), "n_layers"), (dict(norm_eps=0.0), "norm_eps"),
    (dict(attention="pallas", q_tile=48), "q_tile"), (dict(attention="pallas", k_tile=24), "k_tile"),
])
def test_invalid_fields_are_named(change, field):
    with pytest.raises(ConfigError, match=f"ModelConfig.{field}"):
        ModelConfig(**{**BASE, **change})


def test_power_of_two_tiles_are_required_by_pallas_only():
    assert ModelConfig(**BASE, q_tile=48, k_tile=24).q_tile == 48  # the XLA kernels take any tile
    with pytest.raises(ConfigError, match="power of two.*Triton"):
        ModelConfig(**BASE, attention="pallas", q_tile=48)


def test_round_trip():
    config = ModelConfig(**BASE, tie_embeddings=False)
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="unknown field"):
        ModelConfig.from_dict({**config.to_dict(), "dropout": 0.1})


@pytest.mark.parametrize("tie", [True, False])
def test_bf16_forward_backward_keeps_dtypes(layouts, tie):
    layout = layouts(0).layout
    config = ModelConfig(**BASE, param_dtype="bfloat16", compute_dtype="bfloat16", tie_embeddings=tie)
    model = BlockDiffusionLM(config, key=jax.random.key(0))
    logits, grads = jax.jit(lambda m: (m(layout), jax.grad(lambda m: jnp.mean(m(layout) ** 2))(m)))(model)
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
    for param, grad in zip(jax.tree.leaves(model), jax.tree.leaves(grads)):
        assert param.dtype == jnp.bfloat16 and grad.dtype == jnp.bfloat16
        assert bool(jnp.all(jnp.isfinite(grad.astype(jnp.float32))))


def test_flops_count_matmuls_and_allowed_attention(layouts):
    config = ModelConfig(**BASE)
    packed = layouts(0)
    flops = model_flops(config, packed.layout)
    b, t = packed.layout.shape
    per_token = 2 * (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64) * 2 + 2 * 32 * 50
    assert flops["matmul_forward"] == b * t * per_token
    dense = model_flops(config, (b, t))
    assert flops["attention_entries"] < dense["attention_entries"] == b * t * t
    assert flops["train_step"] == 3 * flops["forward"]
