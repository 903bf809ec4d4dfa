"""Streamed accumulation: equal to the scanned update, resumable, and split like the parameters."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bd_core import DiffusionTokenBatch, LossOutput, MaxMetric, MetricError, WeightedMetric
from bd_models import BlockDiffusionLM, ModelConfig, make_mesh, shard_batch, shard_model
from bd_train import (
    Checkpointer,
    CheckpointError,
    OptimizerConfig,
    Trainer,
    TrainerConfig,
    make_optimizer,
    sft_objective,
    split_microbatches,
)


def test_streaming_accumulation_matches_scan(toy_model, batch_factory, gradients):
    model = toy_model(key=jax.random.key(5))
    optimizer = gradients.probe()
    batches = [batch_factory(10 + i, rows=12) for i in range(2)]

    scan = Trainer(sft_objective, optimizer, TrainerConfig(microbatches=3))
    scan_state = scan.init(model, key=jax.random.key(0))
    streaming = Trainer(sft_objective, optimizer, TrainerConfig(streaming=True))
    stream_state = streaming.init(model, key=jax.random.key(0), microbatch=batches[0])
    for batch in batches:
        stacked = split_microbatches(batch, 3)
        scan_state, scan_metrics = scan.step_microbatches(scan_state, stacked)
        for i in range(3):
            part = jax.tree.map(lambda x, i=i: x[i : i + 1], stacked)
            stream_state, stream_metrics = streaming.step_microbatches(stream_state, part, is_update_step=i == 2)
        np.testing.assert_allclose(stream_metrics["loss"], scan_metrics["loss"], rtol=1e-6)
        assert int(stream_state.accumulator.count) == 0
        assert gradients.relative_error(stream_state.opt_state, scan_state.opt_state) <= 1e-6  # the gradients
        assert gradients.relative_error(scan_state.opt_state, gradients.reference(model, batch)) <= 1e-6
    assert int(stream_state.step) == int(scan_state.step) == 2


def _sft_with_max_and_plain(model, batch, key):
    """SFT plus a maximum (the microbatch's token count) and a plain per-microbatch mean (the
    share of its rows that hold tokens), so every kind of aux metric is reduced."""
    out = sft_objective(model, batch, key)
    tokens = jnp.asarray(batch.denom_weights, jnp.float32)
    rows = jnp.mean(jnp.any(tokens > 0, axis=1).astype(jnp.float32))
    return LossOutput(out.loss, {**out.aux, "max_tokens": MaxMetric(jnp.sum(tokens)), "rows": rows})


def test_streaming_metrics_cover_the_whole_update(toy_model, batch_factory, gradients):
    """At the call that applies an update, streaming reports the metrics of all the update's
    microbatches reduced once, as the scanned update does; not those of its last call."""
    model = toy_model(key=jax.random.key(11))
    # Unequal parts: per-call token accuracy, maximum and row share all differ from the update's.
    stacked = split_microbatches(batch_factory(60, rows=16), sizes=[9, 1, 4, 2])
    scan = Trainer(_sft_with_max_and_plain, gradients.probe())
    _, expected = scan.step_microbatches(scan.init(model, key=jax.random.key(0)), stacked)
    streaming = Trainer(_sft_with_max_and_plain, gradients.probe(), TrainerConfig(streaming=True))
    state = streaming.init(model, key=jax.random.key(0), microbatch=jax.tree.map(lambda x: x[0], stacked))
    for a, b in [(0, 2), (2, 3), (3, 4)]:
        part = jax.tree.map(lambda x, a=a, b=b: x[a:b], stacked)
        state, metrics = streaming.step_microbatches(state, part, is_update_step=b == 4)
    assert set(metrics) == set(expected)
    for name in expected:
        np.testing.assert_allclose(metrics[name], expected[name], rtol=1e-6, err_msg=name)
    # The last call alone would report other values: the comparison above can tell them apart.
    _, last_only = scan.step_microbatches(scan.init(model, key=jax.random.key(0)), part)
    for name in ("token_accuracy", "max_tokens", "rows"):
        assert abs(float(last_only[name]) - float(expected[name])) > 1e-3, name


def test_streaming_state_resumes_from_a_checkpoint(tmp_path, toy_model, batch_factory):
    """A streaming state saves between updates, never mid-update, and a restored one continues
    with the same update and metrics as the uninterrupted run."""
    model = toy_model(key=jax.random.key(13))
    trainer = Trainer(_sft_with_max_and_plain, make_optimizer(OptimizerConfig(schedule="constant")),
                      TrainerConfig(streaming=True))
    batches = [split_microbatches(batch_factory(80 + i, rows=8), sizes=[5, 1, 2]) for i in range(2)]

    def update(state, stacked):
        state, _ = trainer.step_microbatches(state, jax.tree.map(lambda x: x[:2], stacked), is_update_step=False)
        return trainer.step_microbatches(state, jax.tree.map(lambda x: x[2:], stacked))

    like = jax.tree.map(lambda x: x[0], batches[0])
    state, _ = update(trainer.init(model, key=jax.random.key(0), microbatch=like), batches[0])
    with Checkpointer(tmp_path) as checkpoints:
        partial, _ = trainer.step_microbatches(state, batches[1], is_update_step=False)
        with pytest.raises(CheckpointError, match="partly accumulated"):
            checkpoints.save(partial)
        checkpoints.save(state)
        checkpoints.wait()
        restored = checkpoints.restore(trainer.init(model, key=jax.random.key(0), microbatch=like))
    expected_state, expected = update(state, batches[1])
    resumed_state, metrics = update(restored, batches[1])
    assert jax.tree.map(float, metrics) == jax.tree.map(float, expected)
    assert eqx.tree_equal(resumed_state.params, expected_state.params)


class _Tagged(eqx.Module):
    """A batch plus the loss settings its loss function uses; static, so a call may change them."""

    batch: DiffusionTokenBatch
    eps: float | None = eqx.field(static=True, default=None)
    aux_key: str = eqx.field(static=True, default="token_accuracy")


def _tagged_loss(model, data, key):
    out = sft_objective(model, data.batch, key)
    loss = out.loss.total()
    return LossOutput(WeightedMetric(loss.numerator, loss.denominator, eps=data.eps),
                      {data.aux_key: out.aux["token_accuracy"]})


def test_streaming_refuses_loss_settings_that_change_within_an_update(toy_model, batch_factory, gradients):
    trainer = Trainer(_tagged_loss, gradients.probe(), TrainerConfig(streaming=True))
    first, second = (split_microbatches(batch_factory(70 + i, rows=4), 2) for i in range(2))
    like = _Tagged(jax.tree.map(lambda x: x[0], first), eps=1e-6)
    state = trainer.init(toy_model(key=jax.random.key(12)), key=jax.random.key(0), microbatch=like)
    state, _ = trainer.step_microbatches(state, _Tagged(first, eps=1e-6), is_update_step=False)
    with pytest.raises(MetricError, match=r"eps=0\.001, min_denom=None.*eps=1e-06, min_denom=None"):
        trainer.step_microbatches(state, _Tagged(second, eps=1e-3))
    with pytest.raises(MetricError, match=r"\['accuracy'\].*\['token_accuracy'\]"):
        trainer.step_microbatches(state, _Tagged(second, eps=1e-6, aux_key="accuracy"))
    state, metrics = trainer.step_microbatches(state, _Tagged(second, eps=1e-6))
    assert float(metrics["update_applied"]) == 1.0
    # The settings are the state's, fixed at init (they shape its accumulator): a later update
    # that changes them is refused too, before anything is added.
    with pytest.raises(MetricError, match=r"eps=0\.001, min_denom=None.*eps=1e-06, min_denom=None"):
        trainer.step_microbatches(state, _Tagged(first, eps=1e-3), is_update_step=False)
    state, metrics = trainer.step_microbatches(state, _Tagged(second, eps=1e-6))
    assert float(metrics["update_applied"]) == 1.0 and int(state.step) == 2


def test_a_streaming_trainer_needs_a_microbatch_to_shape_its_state(toy_model):
    trainer = Trainer(sft_objective, optax.sgd(0.1), TrainerConfig(streaming=True))
    with pytest.raises(ValueError, match="needs microbatch="):
        trainer.init(toy_model(key=jax.random.key(0)), key=jax.random.key(0))


def test_a_streamed_update_compiles_two_programs_and_keeps_the_init_structure(toy_model, batch_factory, gradients):
    """Accumulate and apply are the only programs of a streamed update, from the first call on,
    and the state has `init`'s pytree structure (and shapes) at every call: a restore target or an
    ahead-of-time plan made from `init` describes it."""
    traces = []

    class Counting(Trainer):
        def _train_impl(self, state, batch, is_update_step, presplit):
            traces.append(is_update_step)
            return super()._train_impl(state, batch, is_update_step, presplit)

    trainer = Counting(_sft_with_max_and_plain, gradients.probe(), TrainerConfig(streaming=True))
    parts = [split_microbatches(batch_factory(90 + i, rows=6), 2) for i in range(3)]
    state = trainer.init(toy_model(key=jax.random.key(3)), key=jax.random.key(0),
                         microbatch=jax.tree.map(lambda x: x[0], parts[0]))
    structure = jax.tree.structure(state)
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    for _ in range(2):
        for call, part in enumerate(parts):
            state, _ = trainer.step_microbatches(state, part, is_update_step=call == 2)
            assert jax.tree.structure(state) == structure
            assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == shapes
    assert sorted(traces) == [False, True] and int(state.step) == 2


def test_streaming_without_accumulator_is_refused(toy_model, batch_factory):
    trainer = Trainer(sft_objective, optax.sgd(0.1))
    state = trainer.init(toy_model(key=jax.random.key(0)), key=jax.random.key(0))
    with pytest.raises(ValueError, match="streaming=True"):
        trainer.step(state, batch_factory(0), is_update_step=False)


def test_a_streamed_accumulator_stays_split_like_the_parameters(batch_factory):
    """Under FSDP no device holds more of the streaming accumulator than of the parameters, at
    `init` and at every call (an accumulator emptied as a constant came back whole on every device
    after each update: the model's size in float32 per device)."""
    config = ModelConfig(vocab_size=16, d_model=64, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=128, block_size=2,
                         attention="dense")
    mesh = make_mesh(1, 8, 1)
    model = shard_model(BlockDiffusionLM(config, key=jax.random.key(9)), mesh)
    trainer = Trainer(sft_objective, make_optimizer(OptimizerConfig(learning_rate=1e-2)), TrainerConfig(streaming=True))
    batches = [shard_batch(batch_factory(60 + seed, rows=8), mesh) for seed in range(2)]
    state = trainer.init(model, key=jax.random.key(0), microbatch=batches[0])

    def split_like_params(state) -> bool:
        params = jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array))
        shard = lambda x: np.prod(x.sharding.shard_shape(x.shape))  # noqa: E731
        return all(shard(g) <= shard(p) for g, p in zip(jax.tree.leaves(state.accumulator.grads), params, strict=True))

    assert split_like_params(state)
    for _ in range(2):
        state, _ = trainer.step(state, batches[0], is_update_step=False)
        assert split_like_params(state)
        state, _ = trainer.step(state, batches[1])
        emptied = [np.asarray(g) for g in jax.tree.leaves(state.accumulator.grads)]
        assert split_like_params(state) and not any(g.any() or np.signbit(g).any() for g in emptied)  # +0 only
