"""LoRA adapters: a zero-initialized adapter is the base bit for bit (packed forward and KV cache),
gradients reach adapter leaves only, merging keeps the logits, adapters shard like their matrices
and give the single-device gradients on every mesh, and dropout acts only under a training key."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bd_core import ConfigError, ViewLayout
from bd_models import (
    BlockDiffusionLM,
    LoRAConfig,
    ModelConfig,
    PretrainedError,
    add_lora,
    base_model,
    count_params,
    make_mesh,
    merge,
    save_pretrained,
    shard_batch,
    shard_model,
    trainable,
    trainable_filter,
    weights_digest,
    with_dropout_keys,
)
from bd_models._lora import TARGETS, _add

CONFIG = ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=128, block_size=4,
                     q_tile=16, k_tile=16)
ALL = LoRAConfig(rank=4, alpha=8.0, targets=TARGETS)


def _model(config=CONFIG):
    return BlockDiffusionLM(config, key=jax.random.key(0))


def _trained(model, scale=0.05, seed=1):
    """Adapters moved away from zero (as after training), so that they change the logits."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    spec = trainable_filter(model)
    params, frozen = eqx.partition(model, spec)
    params = jax.tree.map(lambda x: x + scale * jax.random.normal(next(keys), x.shape, x.dtype), params)
    return eqx.combine(params, frozen)


@eqx.filter_jit
def _logits(model, layout):
    return model(layout)


def _loss(model, layout):
    return jnp.sum(jnp.tanh(model(layout)) * layout.valid[..., None])


def test_zero_initialized_adapters_give_the_base_logits_exactly(layouts):
    model = _model()
    adapted = add_lora(model, ALL, key=jax.random.key(1))
    layout = layouts(0).layout
    np.testing.assert_array_equal(np.asarray(_logits(adapted, layout)), np.asarray(_logits(model, layout)))
    # the KV-cache path too: prefill the clean canvas, then one noisy block against the cache
    packed = layouts(1, batch=2, prompt_blocks=2, completion_blocks=1)
    prompt, (_, _, start) = packed.prompt_len, packed.views[0]

    def take(columns):
        return ViewLayout.create(*(np.asarray(x)[:, columns] for x in (
            packed.layout.tokens, packed.layout.positions, packed.layout.block_ids, packed.layout.view_ids,
            packed.layout.valid)))

    clean, chunk = take(np.arange(prompt)), take(np.arange(start, start + packed.block_size))

    def cached(m):
        _, cache = m.forward_cached(clean, m.init_cache(2, packed.canvas_len), commit=clean.valid)
        return m.forward_cached(chunk, cache)[0]

    np.testing.assert_array_equal(np.asarray(jax.jit(cached)(adapted)), np.asarray(jax.jit(cached)(model)))
    assert base_model(adapted).layers.wq is model.layers.wq  # adapters off: the same arrays, no copy


def test_gradients_reach_the_adapters_only(layouts):
    adapted = _trained(add_lora(_model(), LoRAConfig(rank=2, targets=("wq", "w_up")), key=jax.random.key(1)))
    params, frozen = eqx.partition(adapted, trainable_filter(adapted))
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert names == {f".layers.{t}.{leaf}" for t in ("wq", "w_up") for leaf in ("lora_a", "lora_b")}
    layout = layouts(0).layout
    grads = jax.jit(jax.grad(lambda p: _loss(eqx.combine(p, frozen), layout)))(params)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    counts = count_params(adapted)
    base = count_params(_model())
    adapter_size = 2 * (64 * 2 + 2 * 64) + 2 * (64 * 2 + 2 * 128)  # L x (A [in, r] + B [r, out]) per target
    assert counts == {"trained": adapter_size, "total": base["total"] + adapter_size}
    assert base["trained"] == base["total"]
    assert trainable(adapted).embedding is None


def test_merge_keeps_the_logits(layouts):
    adapted = _trained(add_lora(_model(), ALL, key=jax.random.key(1)))
    layout = layouts(2).layout
    merged = merge(adapted)
    assert jax.tree.structure(merged) == jax.tree.structure(_model())
    got, want = _logits(merged, layout), _logits(adapted, layout)
    assert float(jnp.max(jnp.abs(got - _logits(_model(), layout)))) > 1e-2  # the adapters matter
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-5
    unchanged = merge(merged)  # no adapters: the very same arrays
    assert all(a is b for a, b in zip(jax.tree.leaves(unchanged), jax.tree.leaves(merged)))


def test_bfloat16_base_keeps_float32_adapters_and_merges_to_its_dtype(layouts):
    model = _model(CONFIG.replace(param_dtype="bfloat16", compute_dtype="bfloat16"))
    adapted = add_lora(model, ALL, key=jax.random.key(1))
    assert adapted.layers.wq.base.dtype == jnp.bfloat16 and adapted.layers.wq.lora_a.dtype == jnp.float32
    assert merge(adapted).layers.wq.dtype == jnp.bfloat16
    layout = layouts(0).layout
    np.testing.assert_array_equal(np.asarray(_logits(adapted, layout)), np.asarray(_logits(model, layout)))


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_merge_is_the_op_by_op_formula_bit_for_bit_one_matrix_at_a_time_keeping_its_shards(param_dtype):
    # alpha / rank = 0.3: a scale that rounds (a fused multiply-add of the same terms differs here)
    lora = LoRAConfig(rank=4, alpha=1.2, targets=TARGETS)
    adapted = _trained(add_lora(_model(CONFIG.replace(param_dtype=param_dtype)), lora, key=jax.random.key(1)))
    want = {}
    for t in TARGETS:  # the definition, op by op: float32 sum of the scaled product, rounded once
        w = getattr(adapted.layers, t)
        product = jnp.matmul(w.lora_a.astype(jnp.float32), w.lora_b.astype(jnp.float32))
        want[t] = (w.base.astype(jnp.float32) + w.scale * product).astype(w.base.dtype)
    merged = merge(adapted)
    for t in TARGETS:
        np.testing.assert_array_equal(np.asarray(getattr(merged.layers, t)), np.asarray(want[t]))
    # the sum and its rounding are one program: no float32 copy of the base beside the product
    w = adapted.layers.w_up
    analysis = _add.lower(w.base, w.delta(), sharding=None).compile().memory_analysis()
    assert analysis.temp_size_in_bytes < w.base.size * 4
    mesh = make_mesh(2, 2, 2)
    with jax.set_mesh(mesh):
        base = shard_model(adapted, mesh)
        placed = merge(base)
    for t in TARGETS:
        assert getattr(placed.layers, t).sharding == getattr(base.layers, t).base.sharding
        np.testing.assert_array_equal(np.asarray(getattr(placed.layers, t)), np.asarray(want[t]))


def test_weights_digest_sees_one_changed_element_of_the_base_only():
    adapted = add_lora(_model(), ALL, key=jax.random.key(1))
    digest = weights_digest(adapted)
    assert digest == weights_digest(_model()) == weights_digest(_trained(adapted))  # adapters excluded
    bumped = eqx.tree_at(lambda m: m.layers.w_down.base, adapted,
                         adapted.layers.w_down.base.at[1, 5, 7].add(1e-3))
    assert weights_digest(bumped) != digest
    swapped = eqx.tree_at(lambda m: m.embedding, adapted, adapted.embedding[::-1])  # same values, other order
    assert weights_digest(swapped) != digest


@pytest.mark.skipif(jax.device_count() != 8, reason="needs the 8 virtual CPU devices of conftest.py")
def test_sharded_adapters_give_the_single_device_gradients(layouts):
    model = _model(CONFIG.replace(attention="shard_map"))
    adapted = _trained(add_lora(model, ALL, key=jax.random.key(1)))
    layout = layouts(0, batch=8, prompt_blocks=1, completion_blocks=2).layout
    def loss_and_grads(m, lay):
        params, frozen = eqx.partition(m, trainable_filter(m))
        return jax.value_and_grad(lambda p: _loss(eqx.combine(p, frozen), lay))(params)

    loss, grads = jax.jit(loss_and_grads)(adapted.with_attention("blocked"), layout)
    mesh = make_mesh(2, 2, 2)  # batch, FSDP and tensor-parallel axes at once
    with jax.set_mesh(mesh):
        placed = shard_model(adapted, mesh)
        a_spec = placed.layers.w_up.lora_a.sharding.spec
        b_spec = placed.layers.w_up.lora_b.sharding.spec
        assert a_spec == jax.sharding.PartitionSpec(None, "fsdp", None)
        assert b_spec == jax.sharding.PartitionSpec(None, None, "model")
        sharded_loss, sharded_grads = jax.jit(loss_and_grads)(placed, shard_batch(layout, mesh))
    np.testing.assert_allclose(sharded_loss, loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(sharded_grads), jax.tree.leaves(grads), strict=True):
        assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) <= 1e-5
    # adapters added to an already sharded base are placed like it
    with jax.set_mesh(mesh):
        late = add_lora(shard_model(model, mesh), ALL, key=jax.random.key(1))
    assert late.layers.wo.lora_a.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)


def test_dropout_acts_only_under_a_training_key(layouts):
    layout = layouts(0).layout
    adapted = _trained(add_lora(_model(), LoRAConfig(rank=4, dropout=0.5), key=jax.random.key(1)))
    plain = _trained(add_lora(_model(), LoRAConfig(rank=4), key=jax.random.key(1)))
    np.testing.assert_array_equal(np.asarray(_logits(adapted, layout)), np.asarray(_logits(plain, layout)))  # off
    one = with_dropout_keys(adapted, jax.random.key(3))
    assert one.layers.wq.dropout_key.shape == (CONFIG.n_layers,)  # one key per layer
    dropped = _logits(one, layout)
    np.testing.assert_array_equal(np.asarray(dropped), np.asarray(_logits(one, layout)))  # a key fixes the masks
    assert float(jnp.max(jnp.abs(dropped - _logits(plain, layout)))) > 1e-3
    other = _logits(with_dropout_keys(adapted, jax.random.key(4)), layout)
    assert float(jnp.max(jnp.abs(dropped - other))) > 1e-3
    assert with_dropout_keys(plain, jax.random.key(3)) is plain  # no dropout configured: untouched


def test_config_round_trips_through_a_fingerprint():
    from bd_core import fingerprint

    pinned = fingerprint({"lora": ALL.to_dict()}).fields["lora"]  # canonical JSON: alpha 8.0 is stored as 8
    assert LoRAConfig.from_dict(pinned) == ALL


def test_config_errors_and_refusals_name_the_fix():
    with pytest.raises(ConfigError, match="LoRAConfig.rank"):
        LoRAConfig(rank=0)
    with pytest.raises(ConfigError, match="LoRAConfig.targets"):
        LoRAConfig(targets=("wq", "w_in"))
    with pytest.raises(ConfigError, match="LoRAConfig.dropout"):
        LoRAConfig(dropout=1.0)
    adapted = add_lora(_model(), ALL, key=jax.random.key(1))
    with pytest.raises(ValueError, match="already has adapters"):
        add_lora(adapted, ALL, key=jax.random.key(1))
    with pytest.raises(PretrainedError, match="merge"):
        save_pretrained(adapted, "/nonexistent")


@pytest.mark.parametrize("attention", ["dense", "blocked"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "sdar"])
def test_imported_checkpoints_with_adapters_on_every_projection_start_at_their_base_logits(arch, attention):
    """Released layouts (q/k norms and head_dim != d_model / n_heads in qwen3 and sdar, q/k/v biases
    in qwen2, scaled RoPE and one kv head in llama), read from their safetensors, with rank-4
    adapters on all seven projections: the packed forward equals the base's bit for bit."""
    from pathlib import Path

    from bd_models import from_pretrained

    folder = Path(__file__).parent / "fixtures" / "hf" / arch
    model = from_pretrained(folder, block_size=4, attention=attention)
    adapted = add_lora(model, LoRAConfig(rank=4, targets=TARGETS), key=jax.random.key(2))
    rows, length = 2, 16
    tokens = jax.random.randint(jax.random.key(3), (rows, length), 0, model.config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(length), (rows, length))
    layout = ViewLayout.create(tokens, positions, positions // 4, jnp.zeros((rows, length), jnp.int32),
                               jnp.ones((rows, length), bool))
    np.testing.assert_array_equal(np.asarray(_logits(adapted, layout)), np.asarray(_logits(model, layout)))
