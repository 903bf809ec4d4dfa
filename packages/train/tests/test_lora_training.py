"""LoRA in training: the base stays bit-identical while adapters learn, the optimizer state covers
adapters only, microbatch accumulation gives the one-batch adapter gradients, GRPO's adapter-off
reference has KL exactly 0 at the first update, and checkpoints hold adapters only and refuse
another base by name."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bd_core import FingerprintMismatch, fingerprint
from bd_models import (
    BlockDiffusionLM,
    LoRAConfig,
    ModelConfig,
    SamplingDistribution,
    add_lora,
    base_model,
    token_logprobs,
    weights_digest,
)
from bd_train import (
    Checkpointer,
    GRPOBatch,
    GRPOConfig,
    Trainer,
    TrainerConfig,
    distribution_score,
    make_grpo_loss,
    sft_objective,
)

CONFIG = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=64, block_size=2,
                     attention="dense")
LORA = LoRAConfig(rank=4, alpha=8.0, targets=("wq", "wv", "wo", "w_gate", "w_down"))


def _adapted(seed: int = 0):
    base = BlockDiffusionLM(CONFIG, key=jax.random.key(seed))
    return base, add_lora(base, LORA, key=jax.random.key(seed + 1))


def _same(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_sft_trains_adapters_and_leaves_the_base_bit_identical(batch_factory):
    base, model = _adapted()
    trainer = Trainer(sft_objective, optax.adamw(1e-2))
    state = trainer.init(model, key=jax.random.key(0))
    # the optimizer state holds adapter-shaped moments only
    moments = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
    adapter_shapes = sorted(np.shape(x) for x in jax.tree.leaves(state.params))
    assert sorted(np.shape(x) for x in moments) == sorted(adapter_shapes * 2)
    losses = []
    for step in range(6):
        state, metrics = trainer.step(state, batch_factory(step % 2, rows=8))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]  # the adapters alone fit the two batches
    assert _same(base_model(state.model), base)
    assert not _same(state.params, trainer.init(model, key=jax.random.key(0)).params)


@pytest.mark.parametrize("streaming", [False, True])
def test_accumulated_adapter_gradients_equal_the_one_batch_gradients(batch_factory, streaming):
    """SGD with learning rate 1 moves each adapter by exactly minus its normalized gradient, so
    the parameter change compares gradients (Adam would hide a constant scale)."""
    _, model = _adapted()
    model = eqx.tree_at(lambda m: m.layers.wq.lora_b, model, 0.1 * jnp.ones_like(model.layers.wq.lora_b))
    batch = batch_factory(3, rows=8)
    one = Trainer(sft_objective, optax.sgd(1.0))
    whole, _ = one.step(one.init(model, key=jax.random.key(0)), batch)
    if streaming:
        split = Trainer(sft_objective, optax.sgd(1.0), TrainerConfig(streaming=True))
        halves = [jax.tree.map(lambda x, s=s: x[s], batch) for s in (slice(0, 4), slice(4, 8))]
        state = split.init(model, key=jax.random.key(0), microbatch=halves[0])
        state, _ = split.step(state, halves[0], is_update_step=False)
        state, _ = split.step(state, halves[1])
    else:
        split = Trainer(sft_objective, optax.sgd(1.0), TrainerConfig(microbatches=4))
        state, _ = split.step(split.init(model, key=jax.random.key(0)), batch)
    start = eqx.filter(model, lambda x: True)
    grads_whole = jax.tree.map(lambda a, b: a - b, whole.params, one.init(start, key=jax.random.key(0)).params)
    grads_split = jax.tree.map(lambda a, b: a - b, state.params, one.init(start, key=jax.random.key(0)).params)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads_whole))
    assert scale > 0
    for a, b in zip(jax.tree.leaves(grads_split), jax.tree.leaves(grads_whole), strict=True):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * scale
    assert _same(base_model(state.model), base_model(model))


def test_grpo_with_the_adapter_off_reference_has_kl_exactly_zero_at_the_first_update(batch_factory):
    base, model = _adapted(3)
    batch = batch_factory(5, rows=8, fractional=False)
    distribution = SamplingDistribution(temperature=1.0)
    reference = jax.jit(lambda m, b: token_logprobs(m, b, distribution)[0])(base, batch)
    old = jax.jit(lambda m, b: token_logprobs(m, b, distribution)[0])(model, batch)
    np.testing.assert_array_equal(np.asarray(old), np.asarray(reference))  # B = 0: the same policy, bit for bit
    loss_fn = make_grpo_loss(GRPOConfig(beta=0.1), distribution_score(distribution))
    trainer = Trainer(loss_fn, optax.adam(1e-2))
    grpo_batch = GRPOBatch(batch, old, jnp.linspace(-1.0, 1.0, 8), reference)
    state, first = trainer.step(trainer.init(model, key=jax.random.key(0)), grpo_batch)
    assert float(first["kl"]) == 0.0 and float(first["ratio_mean"]) == 1.0
    _, second = trainer.step(state, grpo_batch)
    assert float(second["kl"]) > 0.0  # the adapters moved the policy away from its base
    assert _same(base_model(state.model), base)


def _pins(model) -> dict:
    return {"adapters": fingerprint({"lora": LORA.to_dict(), "base_digest": weights_digest(model)})}


def test_checkpoints_hold_adapters_only_and_refuse_another_base_by_name(tmp_path, batch_factory):
    base, model = _adapted()
    trainer = Trainer(sft_objective, optax.adamw(1e-2))
    state, _ = trainer.step(trainer.init(model, key=jax.random.key(0)), batch_factory(0, rows=8))
    with Checkpointer(tmp_path / "ckpt") as checkpoints:
        checkpoints.save(state, fingerprints=_pins(state.model))
        saved = checkpoints._manager.item_metadata(1)["model"]
    leaves = {"/".join(str(getattr(k, "key", k)) for k in path)
              for path, _ in jax.tree_util.tree_flatten_with_path(dict(saved))[0]}
    assert leaves == {f"layers/{t}/{leaf}" for t in LORA.targets for leaf in ("lora_a", "lora_b")}

    # the same base: adapters, optimizer state and step come back exactly
    target = trainer.init(add_lora(base, LORA, key=jax.random.key(9)), key=jax.random.key(0))
    with Checkpointer(tmp_path / "ckpt", create=False) as checkpoints:
        restored = checkpoints.restore(target, fingerprints=_pins(target.model))
        model_only = checkpoints.restore_model(target.model, fingerprints=_pins(target.model))
    assert _same(restored.model, state.model) and _same(restored.opt_state, state.opt_state)
    assert _same(model_only, state.model)

    # another base (one element changed): refused before anything is read, naming the field
    other = eqx.tree_at(lambda m: m.layers.w_up, base, base.layers.w_up.at[0, 0, 0].add(1e-3))
    target = trainer.init(add_lora(other, LORA, key=jax.random.key(9)), key=jax.random.key(0))
    with Checkpointer(tmp_path / "ckpt", create=False) as checkpoints:
        with pytest.raises(FingerprintMismatch, match="adapters.base_digest"):
            checkpoints.restore(target, fingerprints=_pins(target.model))
