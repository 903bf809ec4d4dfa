"""On 8 virtual devices, every mesh shape gives the single-device logits and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bd_models import BlockDiffusionLM, ModelConfig, make_mesh, param_partition_specs, shard_batch, shard_model

# Batch, heads, kv heads, d_model and d_ff divide every axis of every mesh below.
CONFIG = ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=128, block_size=4,
                     q_tile=16, k_tile=16)


def _rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def _loss(model, layout):
    return jnp.sum(jnp.tanh(model(layout)) * layout.valid[..., None])


# shard_map on every mesh shape; GSPMD-partitioned `blocked` on the mixed one (compiles dominate).
@pytest.mark.parametrize("shape,attention", [((8, 1, 1), "shard_map"), ((2, 2, 2), "shard_map"),
                                             ((1, 2, 4), "shard_map"), ((1, 1, 8), "shard_map"),
                                             ((2, 2, 2), "blocked")])
def test_sharded_equals_single_device(layouts, shape, attention):
    layout = layouts(0, batch=8, prompt_blocks=1, completion_blocks=2).layout
    model = BlockDiffusionLM(CONFIG.replace(attention=attention), key=jax.random.key(0))
    fn = jax.jit(lambda m, lay: (m(lay), jax.grad(_loss)(m, lay)))
    logits, grads = fn(model.with_attention("blocked"), layout)
    mesh = make_mesh(*shape)
    with jax.set_mesh(mesh):
        sharded_logits, sharded_grads = fn(shard_model(model, mesh), shard_batch(layout, mesh))
    assert _rel(sharded_logits, logits) <= 1e-5
    for got, want in zip(jax.tree.leaves(sharded_grads), jax.tree.leaves(grads)):
        assert _rel(got, want) <= 1e-5


def test_partition_specs_follow_the_plan():
    model = BlockDiffusionLM(CONFIG, key=jax.random.key(0))
    specs = param_partition_specs(model)
    assert specs.embedding == jax.sharding.PartitionSpec("fsdp", None)  # the vocabulary, where fsdp divides it
    assert param_partition_specs(model, make_mesh(1, 2, 4)).embedding == jax.sharding.PartitionSpec("fsdp", None)
    assert param_partition_specs(model, make_mesh(1, 4, 2)).embedding == jax.sharding.PartitionSpec(None, "fsdp")
    untied = BlockDiffusionLM(CONFIG.replace(tie_embeddings=False), key=jax.random.key(0))
    assert param_partition_specs(untied, make_mesh(1, 2, 4)).lm_head == jax.sharding.PartitionSpec(None, "fsdp")
    assert param_partition_specs(untied, make_mesh(1, 4, 2)).lm_head == jax.sharding.PartitionSpec("fsdp", None)
    assert specs.layers.wq == jax.sharding.PartitionSpec(None, "fsdp", "model")
    assert specs.layers.w_down == jax.sharding.PartitionSpec(None, "model", "fsdp")
    sharded = shard_model(model, make_mesh(1, 2, 4))
    assert sharded.layers.w_gate.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "model")
    with pytest.raises(ValueError, match="must equal the number of devices"):
        make_mesh(2, 2, 1)


def test_init_sharded_builds_the_model_in_its_shards():
    from bd_models import init_sharded

    mesh = make_mesh(2, 2, 2)
    config = ModelConfig(vocab_size=37, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, block_size=4)
    key = jax.random.key(3)
    want = shard_model(BlockDiffusionLM(config, key=key), mesh)
    got = init_sharded(lambda: BlockDiffusionLM(config, key=key), mesh)
    assert jax.tree.structure(got) == jax.tree.structure(want) and got.config == config
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding == w.sharding and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-6)


@pytest.mark.parametrize("vocab", [50, 96])  # 8 does not divide 50 (the vocabulary whole); it divides 96
def test_under_fsdp_the_weights_are_gathered_not_the_activations(layouts, vocab):
    """With weights split over `fsdp` on their input axis and rows over the same axis, every
    all-gather of the compiled forward and backward is of a weight: no chip gathers the batch's
    activations (rows x features) or logits, which the backward would then keep whole. Where
    `fsdp` divides the vocabulary, the head is the exception the other way round: it is never
    gathered, and the final hidden states (rows x d_model) are, for each chip's slice of it, with
    the per-position values the loss multiplies the logits by."""
    import re

    layout = layouts(0, batch=8, prompt_blocks=1, completion_blocks=2).layout
    b, t = layout.tokens.shape
    mesh = make_mesh(1, 8, 1)
    config = CONFIG.replace(vocab_size=vocab)
    model = shard_model(BlockDiffusionLM(config, key=jax.random.key(0)), mesh)
    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(_loss)).lower(model, shard_batch(layout, mesh)).compile().as_text()
    gathered = [tuple(int(n) for n in dims.split(",") if n) for dtype, dims in
                re.findall(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^=]*? all-gather(?:-start)?\(", hlo)
                if dtype.startswith(("f", "bf"))]  # token ids (integers) are not activations
    assert gathered, "expected the weights to be gathered"
    head = {(vocab, config.d_model), (config.d_model, vocab)}
    split = vocab % 8 == 0
    if split:
        assert (b * t, config.d_model) in gathered, f"expected the final hidden states gathered: {gathered}"
    else:
        assert head & set(gathered), f"expected the head gathered: {gathered}"
    for dims in gathered:
        if split:
            assert dims not in head, f"the head gathered: {dims}"
            if dims in ((b * t, config.d_model), (b, t, config.d_model), (b, t)):  # and the loss's mask
                continue
        assert b * t not in dims and dims[:2] != (b, t), f"activations gathered: {dims}"


def test_zeros_placed_like_keeps_the_placement_and_is_plus_zero():
    """An accumulator made inside a program comes out split like the array it accumulates for (a
    constant's would be the partitioner's choice), float32, and +0 everywhere, where the array holds a
    NaN or an infinity too."""
    from bd_models import zeros_placed_like

    mesh = make_mesh(1, 2, 4)
    x = jnp.arange(8 * 12, dtype=jnp.bfloat16).reshape(8, 12).at[0, 0].set(jnp.nan).at[1, 1].set(-jnp.inf)
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "model")))
    zeros = jax.jit(zeros_placed_like)(x)
    assert zeros.sharding.is_equivalent_to(x.sharding, 2) and zeros.dtype == jnp.float32
    assert not np.any(np.signbit(np.asarray(zeros))) and not np.any(np.asarray(zeros))
