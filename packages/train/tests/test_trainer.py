"""Accumulation exactness, dtype-stable skips, non-finite handling, sharding and donation."""

from __future__ import annotations

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bd_core import DiffusionTokenBatch, WeightedMetric
from bd_models import BlockDiffusionLM, ModelConfig, make_mesh, shard_batch, shard_model
from bd_train import (
    Checkpointer,
    NonFiniteError,
    OptimizerConfig,
    Trainer,
    TrainerConfig,
    accumulate,
    make_optimizer,
    normalize,
    sft_objective,
    split_microbatches,
)


def _params(model):
    return eqx.partition(model, eqx.is_inexact_array)


def _accumulated_grads(model, stacked, loss_fn=sft_objective):
    params, static = _params(model)
    out, _ = accumulate(loss_fn, params, static, stacked, key=jax.random.key(0), update_step=jnp.int32(0))
    return normalize(out.grads, out.loss), out


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_accumulated_gradients_equal_full_batch(toy_model, batch_factory, k, gradients):
    model, batch = toy_model(key=jax.random.key(1)), batch_factory(0, rows=24)
    grads, out = _accumulated_grads(model, split_microbatches(batch, k))
    assert gradients.relative_error(grads, gradients.reference(model, batch)) <= 1e-6
    np.testing.assert_allclose(out.loss.compute(), sft_objective(model, batch).loss.compute(), rtol=1e-6)


@pytest.mark.parametrize("sizes", [[5, 1, 11, 7], [0, 13, 2, 9], [24]])
def test_unequal_microbatches_with_fractional_weights(toy_model, batch_factory, sizes, gradients):
    model, batch = toy_model(key=jax.random.key(2)), batch_factory(1, rows=24, fractional=True)
    grads, _ = _accumulated_grads(model, split_microbatches(batch, sizes=sizes))
    assert gradients.relative_error(grads, gradients.reference(model, batch)) <= 1e-6


def test_scalar_losses_average_over_microbatches(toy_model, batch_factory, gradients):
    model, batch = toy_model(key=jax.random.key(3)), batch_factory(2, rows=12)

    def scalar_loss(m, b, key):
        return sft_objective(m, b).loss.compute()

    stacked = split_microbatches(batch, 3)
    grads, out = _accumulated_grads(model, stacked, scalar_loss)
    params, static = _params(model)
    parts = [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(3)]
    per_part = [jax.grad(lambda p, b=b: scalar_loss(eqx.combine(p, static), b, None))(params) for b in parts]
    expected = jax.tree.map(lambda *gs: sum(gs) / 3, *per_part)
    assert gradients.relative_error(grads, expected) <= 1e-6
    assert float(out.loss.denominator) == 3.0


def test_zero_weights_give_zero_gradients_and_no_update(toy_model, batch_factory):
    model, batch = toy_model(key=jax.random.key(4)), batch_factory(3, rows=8)
    empty = DiffusionTokenBatch.create(batch.layout, batch.targets, jnp.zeros_like(batch.weights),
                                       jnp.zeros_like(batch.denom_weights))
    grads, _ = _accumulated_grads(model, split_microbatches(empty, 2))
    for g in jax.tree.leaves(grads):
        assert bool(jnp.all(jnp.isfinite(g))) and not bool(jnp.any(g != 0))
    trainer = Trainer(sft_objective, make_optimizer(OptimizerConfig(learning_rate=1e-2, weight_decay=0.1)),
                      TrainerConfig(microbatches=2))
    state = trainer.init(model, key=jax.random.key(0))
    new_state, metrics = trainer.step(state, empty)
    assert float(metrics["update_applied"]) == 0.0 and float(metrics["nonfinite"]) == 0.0
    assert int(new_state.step) == 1
    assert eqx.tree_equal((new_state.params, new_state.opt_state), (state.params, state.opt_state))


@pytest.mark.parametrize("settings", [{"eps": 1e-6}, {"min_denom": 1.0}])
def test_an_update_without_tokens_is_skipped_whatever_the_losss_eps(toy_model, batch_factory, settings):
    """A loss with eps (or min_denom) has a positive effective denominator even with no tokens;
    the update must still be skipped (it used to move AdamW's parameters by weight decay)."""
    model, batch = toy_model(key=jax.random.key(4)), batch_factory(3, rows=8)
    empty = DiffusionTokenBatch.create(batch.layout, batch.targets, jnp.zeros_like(batch.weights),
                                       jnp.zeros_like(batch.denom_weights))

    def loss_fn(model, batch, key):
        loss = sft_objective(model, batch, key).loss.total()
        return WeightedMetric(loss.numerator, loss.denominator, **settings)

    trainer = Trainer(loss_fn, make_optimizer(OptimizerConfig(learning_rate=1e-2, weight_decay=0.1)))
    state = trainer.init(model, key=jax.random.key(0))
    new_state, metrics = trainer.step(state, empty)
    assert float(metrics["update_applied"]) == 0.0
    assert eqx.tree_equal((new_state.params, new_state.opt_state), (state.params, state.opt_state))


@pytest.mark.parametrize("inject", [False, True])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_bf16_adamw_keeps_optimizer_dtypes(toy_model, batch_factory, inject, microbatches):
    model = toy_model(key=jax.random.key(6), dtype=jnp.bfloat16)
    config = OptimizerConfig(learning_rate=1e-2, warmup_steps=1, total_steps=10, weight_decay=0.1,
                             mu_dtype="bfloat16", inject_hyperparams=inject)
    trainer = Trainer(sft_objective, make_optimizer(config), TrainerConfig(microbatches=microbatches))
    state = trainer.init(model, key=jax.random.key(0))
    dtypes = jax.tree.map(lambda x: x.dtype, (state.params, state.opt_state))
    mus = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
           if "mu" in jax.tree_util.keystr(path)]
    assert mus and all(m.dtype == jnp.bfloat16 for m in mus)
    start = state.params
    for seed in range(3):
        state, metrics = trainer.step(state, batch_factory(20 + seed, rows=8))
        assert float(metrics["update_applied"]) == 1.0
        assert jax.tree.map(lambda x: x.dtype, (state.params, state.opt_state)) == dtypes
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), state.params, start)
    assert all(jax.tree.leaves(changed))


def _nan_batch(batch):
    weights = jnp.asarray(batch.weights).at[0, :].set(jnp.nan)
    return DiffusionTokenBatch.create(batch.layout, batch.targets, weights, batch.denom_weights, validate=False)


def test_nonfinite_batch_is_skipped_and_counted(toy_model, batch_factory):
    trainer = Trainer(sft_objective, make_optimizer(OptimizerConfig(schedule="constant")),
                      TrainerConfig(microbatches=2, max_consecutive_nonfinite=3))
    state = trainer.init(toy_model(key=jax.random.key(7)), key=jax.random.key(0))
    good = batch_factory(30, rows=8)
    state, _ = trainer.step(state, good)
    before = state
    state, metrics = trainer.step(state, _nan_batch(good))
    assert float(metrics["update_applied"]) == 0.0 and float(metrics["nonfinite"]) == 1.0
    assert int(state.nonfinite_total) == 1 and int(state.step) == 2
    assert eqx.tree_equal((state.params, state.opt_state), (before.params, before.opt_state))
    state, metrics = trainer.step(state, good)
    assert float(metrics["update_applied"]) == 1.0 and int(state.nonfinite_streak) == 0
    assert int(state.nonfinite_total) == 1

    state, _ = trainer.step(state, _nan_batch(good))
    state, _ = trainer.step(state, _nan_batch(good))
    with pytest.raises(NonFiniteError, match="3 update steps in a row"):
        trainer.step(state, _nan_batch(good))


def test_eval_step_reduces_like_the_train_loss(toy_model, batch_factory):
    model, batch = toy_model(key=jax.random.key(8)), batch_factory(40, rows=12)
    trainer = Trainer(sft_objective, optax.sgd(0.1), TrainerConfig(microbatches=4))
    metrics = trainer.eval_step(model, batch, key=jax.random.key(0))
    np.testing.assert_allclose(metrics["loss"], sft_objective(model, batch).loss.compute(), rtol=1e-6)
    halves = [jax.tree.map(lambda x, s=s: x[s], batch) for s in (slice(0, 4), slice(4, 12))]
    both = Trainer(sft_objective, optax.sgd(0.1)).evaluate(model, halves, key=jax.random.key(0))
    np.testing.assert_allclose(both["loss"], metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(both["token_accuracy"], metrics["token_accuracy"], rtol=1e-6)


@pytest.mark.parametrize("mesh_shape", [(4, 2, 1), (2, 2, 2)])
def test_sharded_step_equals_single_device(batch_factory, mesh_shape, gradients):
    assert jax.device_count() == 8
    config = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32, block_size=2,
                         attention="dense")
    model = BlockDiffusionLM(config, key=jax.random.key(9))
    trainer = Trainer(sft_objective, gradients.probe(), TrainerConfig(microbatches=2))
    batch = batch_factory(50, rows=16)
    single, single_metrics = trainer.step(trainer.init(model, key=jax.random.key(0)), batch)

    mesh = make_mesh(*mesh_shape)
    state = trainer.init(shard_model(model, mesh), key=jax.random.key(0))
    state, metrics = trainer.step(state, shard_batch(batch, mesh))
    assert len(state.model.embedding.sharding.device_set) == 8
    np.testing.assert_allclose(metrics["loss"], single_metrics["loss"], rtol=1e-6)
    assert gradients.relative_error(state.opt_state, single.opt_state) <= 1e-6  # the gradients
    assert gradients.relative_error(single.opt_state, gradients.reference(model, batch)) <= 1e-6


def test_lower_gives_the_step_program_for_its_memory_and_cost(toy_model, batch_factory):
    """`Trainer.lower` is the program `step` runs: it takes the state as arguments (parameters and
    AdamW moments at least) and does the step's arithmetic."""
    model, batch = toy_model(key=jax.random.key(4)), batch_factory(3, rows=8)
    trainer = Trainer(sft_objective, make_optimizer(OptimizerConfig(learning_rate=1e-2)))
    state = trainer.init(model, key=jax.random.key(0))
    compiled = trainer.lower(state, batch).compile()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(state.params, eqx.is_array)))
    assert compiled.memory_analysis().argument_size_in_bytes >= 3 * param_bytes
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] > 0


# -- donation ----------------------------------------------------------------------------------------

def _copy(tree):
    return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree)


def _aliases(text: str) -> int:
    """How many parameters of a compiled program its outputs alias (`input_output_alias`)."""
    header = text.splitlines()[0]
    if "input_output_alias={" not in header:
        return 0
    return len(re.findall(r"\(\d+, \{\}, may-alias\)", header.split("entry_computation_layout", 1)[0]))


@pytest.mark.parametrize("streaming", [False, True])
def test_a_donating_step_updates_the_state_in_place_with_the_same_result(toy_model, batch_factory, streaming):
    model, batch = toy_model(key=jax.random.key(4)), batch_factory(3, rows=8)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2, max_grad_norm=1.0))
    kept, donating = (Trainer(sft_objective, optimizer, TrainerConfig(microbatches=2, streaming=streaming,
                                                                       donate=donate)) for donate in (False, True))
    micro = jax.tree.map(lambda x: jnp.asarray(x)[:4], batch)
    state = kept.init(model, key=jax.random.key(0), microbatch=micro if streaming else None)
    donated = jax.tree.leaves((eqx.filter(state.model, eqx.is_inexact_array), state.opt_state, state.accumulator))
    arrays = [x for x in donated if x.ndim > 0]  # parameters, moments, accumulated gradients
    # the compiled update aliases every donated array to an output (XLA updates them in place; a
    # scalar may be left out); without donation nothing is aliased
    for update in (True, False) if streaming else (True,):
        compiled = donating.lower(state, batch, is_update_step=update).compile()
        assert len(arrays) <= _aliases(compiled.as_text()) <= len(donated)
        assert compiled.memory_analysis().alias_size_in_bytes >= sum(x.nbytes for x in arrays)
    compiled = kept.lower(state, batch).compile()
    assert _aliases(compiled.as_text()) == 0 and compiled.memory_analysis().alias_size_in_bytes == 0

    a, b = state, _copy(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "donated buffers were not usable" would fail here
        for call in range(4):
            update = not streaming or call % 2 == 1
            a, metrics_a = kept.step(a, batch, is_update_step=update)
            spent = b
            b, metrics_b = donating.step(b, batch, is_update_step=update)
            assert all(x.is_deleted() for x in jax.tree.leaves(eqx.filter(spent.model, eqx.is_inexact_array)))
            assert not spent.key.is_deleted()  # what a step passes through is not donated
    assert eqx.tree_equal(eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array))
    assert eqx.tree_equal(metrics_a, metrics_b)


@pytest.mark.parametrize("donate", [True, False])
def test_a_lora_step_keeps_the_frozen_base_its_reference_shares(batch_factory, donate):
    """The step neither donates the frozen base nor writes a copy of it: the new state holds the
    very arrays the old one did, and the program's outputs are what it updates (in place when it
    donates; a step that returned its base wrote all of it again, a second copy on the chip, every
    step)."""
    from bd_models import LoRAConfig, add_lora, base_model

    config = ModelConfig(vocab_size=13, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32, block_size=2,
                         attention="dense")
    model = add_lora(BlockDiffusionLM(config, key=jax.random.key(0)), LoRAConfig(rank=2), key=jax.random.key(1))
    reference = base_model(model)  # GRPO's KL reference: the same base arrays
    batch = batch_factory(2, rows=4, length=6)
    trainer = Trainer(sft_objective, make_optimizer(OptimizerConfig(learning_rate=1e-2)), TrainerConfig(donate=donate))
    state = trainer.init(model, key=jax.random.key(2))
    new, _ = trainer.step(state, batch)
    assert all(not x.is_deleted() for x in jax.tree.leaves(eqx.filter(reference, eqx.is_array)))
    assert eqx.tree_equal(eqx.filter(base_model(new.model), eqx.is_array), eqx.filter(reference, eqx.is_array))
    assert all(x.is_deleted() == donate for x in jax.tree.leaves(state.params))  # the adapters, when donated
    base = [x for x in jax.tree.leaves(eqx.filter(base_model(new.model), eqx.is_array))]
    assert all(x is y for x, y in zip(base, jax.tree.leaves(eqx.filter(reference, eqx.is_array)), strict=True))
    memory = trainer.lower(new, batch).compile().memory_analysis()
    written = memory.output_size_in_bytes - memory.alias_size_in_bytes  # counters, key, metrics
    updated = sum(x.nbytes for x in jax.tree.leaves((new.params, new.opt_state)) if isinstance(x, jax.Array))
    assert written - (0 if donate else updated) < sum(x.nbytes for x in base) / 4  # updated: written anew


def test_an_async_save_keeps_its_values_when_the_next_step_donates_them(tmp_path, toy_model, batch_factory):
    model, batch = toy_model(key=jax.random.key(4)), batch_factory(3, rows=8)
    trainer = Trainer(sft_objective, make_optimizer(OptimizerConfig(learning_rate=1e-2)), TrainerConfig(donate=True))
    state, _ = trainer.step(trainer.init(model, key=jax.random.key(0)), batch)
    want = [np.array(x) for x in jax.tree.leaves((state.step, state.model, state.opt_state))]
    with Checkpointer(tmp_path, async_save=True) as checkpoints:
        checkpoints.save(state)
        for _ in range(3):  # the saved buffers are donated to and overwritten by the next updates
            state, _ = trainer.step(state, batch)
        jax.block_until_ready(state)
        checkpoints.wait()
        restored = checkpoints.restore(trainer.init(toy_model(key=jax.random.key(5)), key=jax.random.key(0)), step=1)
    got = [np.array(x) for x in jax.tree.leaves((restored.step, restored.model, restored.opt_state))]
    assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want, strict=True))


def test_shard_map_attention_names_the_microbatch_that_does_not_divide(batch_factory):
    """16 rows in 4 microbatches on 8 data-parallel devices: `shard_map` attention sees 4 rows. Its
    refusal named the kv heads too, which divide, and not the microbatch the rows are."""
    config = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32, block_size=2,
                         attention="shard_map", q_tile=8, k_tile=8)
    model = BlockDiffusionLM(config, key=jax.random.key(9))
    trainer = Trainer(sft_objective, make_optimizer(OptimizerConfig(learning_rate=1e-2)), TrainerConfig(microbatches=4))
    mesh = make_mesh(1, 8, 1)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"the 4 rows it is called with \(a microbatch's, when a "
                                                             r"step is split into microbatches\) are split over "
                                                             r"data\*fsdp = 8 devices") as err:
        trainer.step(trainer.init(shard_model(model, mesh), key=jax.random.key(0)),
                     shard_batch(batch_factory(50, rows=16, length=8), mesh))
    assert "n_kv_heads" not in str(err.value)
