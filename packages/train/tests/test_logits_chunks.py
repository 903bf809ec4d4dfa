"""Chunked logits (`ModelConfig.logits_chunk`): SFT, OPD and replay scoring give the loss, the
metrics and the gradients of the whole logits to float32 tolerance, for chunk sizes that divide
the packed length and sizes that leave a shorter last chunk, a frozen head included; SFT's and
OPD's backward passes keep nothing of the logits' size."""

from __future__ import annotations

import contextlib
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bd_core import DiffusionTokenBatch, DistillationBatch, ViewLayout
from bd_models import BlockDiffusionLM, ModelConfig, SamplingDistribution, map_logits, token_logprobs, unroll_layers
from bd_train import GRPOBatch, GRPOConfig, OPDConfig, make_grpo_loss, make_opd_loss, sft_objective, teacher_head
from bd_train._grpo import distribution_score

V, ROWS, LENGTH, BLOCK, MASK = 61, 3, 16, 4, 60
CHUNKS = (4, 5)  # chunk sizes tested: 16 = 4 x 4; 16 = 3 x 5 + 1
TOL = dict(rtol=1e-5, atol=1e-6)


def _model(tie: bool = True) -> BlockDiffusionLM:
    config = ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32, block_size=BLOCK,
                         attention="dense", tie_embeddings=tie)
    return BlockDiffusionLM(config, key=jax.random.key(0))


def _batch(seed: int, rows: int = ROWS) -> DiffusionTokenBatch:
    """A clean stream of 2 blocks and 2 noisy views of its blocks, some positions masked."""
    rng = np.random.default_rng(seed)
    clean = rng.integers(0, MASK, (rows, 2 * BLOCK))
    noisy = np.where(rng.random((rows, 2 * BLOCK)) < 0.5, MASK, clean)
    tokens = np.concatenate([clean, noisy], axis=1)
    positions = np.tile(np.concatenate([np.arange(2 * BLOCK)] * 2), (rows, 1))
    view_ids = np.tile(np.repeat([0, 0, 1, 2], BLOCK), (rows, 1))
    valid = np.ones((rows, LENGTH), bool)
    valid[0, -1] = False
    layout = ViewLayout.create(tokens, positions, positions // BLOCK, view_ids, valid)
    active = (view_ids > 0) & valid & (tokens == MASK)
    weights = np.where(active, rng.uniform(0.5, 2.0, (rows, LENGTH)), 0.0).astype(np.float32)
    targets = np.where(active, np.concatenate([clean, clean], axis=1), 0)
    return DiffusionTokenBatch.create(layout, targets, weights, active.astype(np.float32))


def _loss_and_grads(loss_fn, model, batch):
    @eqx.filter_jit
    def run(model, batch):
        def total(m):
            out = loss_fn(m, batch)
            return out.loss.compute(), out

        (value, out), grads = eqx.filter_value_and_grad(total, has_aux=True)(model)
        return value, out, grads

    return run(model, batch)


def _value(metric):
    return metric.compute() if hasattr(metric, "compute") else metric.value


def _assert_same(whole, chunked):
    value, out, grads = whole
    value_c, out_c, grads_c = chunked
    np.testing.assert_allclose(value_c, value, **TOL)
    for key in out.aux:
        np.testing.assert_allclose(_value(out_c.aux[key]), _value(out.aux[key]), **TOL, err_msg=key)
    leaves, leaves_c = jax.tree.leaves(grads), jax.tree.leaves(grads_c)
    assert len(leaves) == len(leaves_c)
    for g, g_c in zip(leaves, leaves_c):
        scale = float(jnp.max(jnp.abs(g))) or 1.0
        np.testing.assert_allclose(g_c / scale, g / scale, rtol=0, atol=1e-5)
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)


def test_map_logits_is_the_whole_logits_chunk_by_chunk():
    model, batch = _model(), _batch(0)
    whole = model(batch.layout)
    chunked = jax.jit(lambda layout: [map_logits(model, layout, lambda logits: logits, chunk=chunk)
                                      for chunk in (1, *CHUNKS, LENGTH, 0)])
    for got in chunked(batch.layout):
        np.testing.assert_allclose(got, whole, **TOL)


@pytest.mark.parametrize(("chunk", "tie"), [(4, False), (5, True)])
def test_sft_loss_and_gradients_equal_the_whole_logits(chunk, tie):
    model, batch = _model(tie), _batch(1)
    loss_fn = lambda m, b: sft_objective(m, b)  # noqa: E731
    _assert_same(_loss_and_grads(loss_fn, model, batch),
                 _loss_and_grads(loss_fn, model.with_logits_chunk(chunk), batch))


@pytest.mark.parametrize(("chunk", "config"), [
    (5, OPDConfig()), (4, OPDConfig(temperature=2.0, hard_ce_weight=0.5)),
    (5, OPDConfig(positions="masked", mask_id=MASK))], ids=["kl", "soft+hard", "masked"])
def test_opd_loss_and_gradients_equal_the_whole_logits(chunk, config):
    model, batch = _model(), _batch(2)
    teacher = jnp.asarray(np.random.default_rng(3).normal(size=(ROWS, LENGTH, V)) * 3, jnp.float32)
    distill = DistillationBatch(batch, teacher)
    loss = make_opd_loss(config)
    loss_fn = lambda m, b: loss(m, b, None)  # noqa: E731
    _assert_same(_loss_and_grads(loss_fn, model, distill),
                 _loss_and_grads(loss_fn, model.with_logits_chunk(chunk), distill))


def _teacher(tie: bool, dtype: str = "float32") -> BlockDiffusionLM:
    config = ModelConfig(vocab_size=V, d_model=24, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32, block_size=BLOCK,
                         attention="dense", tie_embeddings=tie, compute_dtype=dtype)
    return BlockDiffusionLM(config, key=jax.random.key(9))


@pytest.mark.parametrize(("chunk", "tie"), [(0, True), (5, True), (4, False)])
def test_opd_from_the_teachers_features_and_head_equals_opd_from_its_logits(chunk, tie):
    """A batch with the teacher's final hidden states and its head (`teacher_head`) gives the loss,
    metrics and gradients of the batch with its logits: the loss computes them chunk by chunk."""
    model, batch, teacher = _model(), _batch(2), _teacher(tie)
    by_logits = DistillationBatch(batch, teacher(batch.layout))
    by_features = DistillationBatch.create(batch, teacher_features=teacher.features(batch.layout),
                                           teacher_head=teacher_head(teacher))
    loss = make_opd_loss(OPDConfig(temperature=2.0, hard_ce_weight=0.5))
    loss_fn = lambda m, b: loss(m, b, None)  # noqa: E731
    student = model.with_logits_chunk(chunk)
    _assert_same(_loss_and_grads(loss_fn, student, by_logits), _loss_and_grads(loss_fn, student, by_features))


def test_a_microbatched_opd_step_hands_every_microbatch_the_whole_teacher_head():
    """The head is `Unsplit`: a 3-microbatch step (interleaved, and split by hand) reads all of it in
    every microbatch and updates the student as the step from the teacher's logits does."""
    import optax

    from bd_train import Trainer, TrainerConfig, split_microbatches

    model, batch, teacher = _model().with_logits_chunk(5), _batch(3, rows=6), _teacher(False)
    by_logits = DistillationBatch(batch, teacher(batch.layout))
    by_features = DistillationBatch(batch, teacher_features=teacher.features(batch.layout),
                                    teacher_head=teacher_head(teacher))
    trainer = Trainer(make_opd_loss(OPDConfig()), optax.sgd(0.5), TrainerConfig(microbatches=3))
    want, metrics = trainer.step(trainer.init(model, key=jax.random.key(1)), by_logits)
    got, got_metrics = trainer.step(trainer.init(model, key=jax.random.key(1)), by_features)
    stacked = split_microbatches(by_features, 3)
    assert stacked.teacher_head.weight.shape == teacher.lm_head.shape  # whole, not split by rows
    presplit, _ = Trainer(make_opd_loss(OPDConfig()), optax.sgd(0.5)).step_microbatches(
        trainer.init(model, key=jax.random.key(1)), stacked)
    np.testing.assert_allclose(got_metrics["loss"], metrics["loss"], **TOL)
    for state in (got, presplit):
        for g, w in zip(jax.tree.leaves(eqx.filter(state.model, eqx.is_array)),
                        jax.tree.leaves(eqx.filter(want.model, eqx.is_array))):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-6)


def test_a_frozen_head_gets_no_gradient_and_the_adapters_the_whole_logits_one():
    """Under LoRA the head is frozen (not differentiated): the chunked SFT and OPD steps give the
    adapters the whole logits' gradients, and compute none for the head."""
    from bd_models import LoRAConfig, add_lora, trainable_filter

    model = add_lora(_model(), LoRAConfig(rank=2, alpha=4.0, targets=("wq", "wv")), key=jax.random.key(4))
    # B starts at zero, where the adapters' A gets no gradient: move B off zero.
    model = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.1 if "lora_b" in jax.tree_util.keystr(path) else x, model)
    batch = _batch(5)
    teacher = jnp.asarray(np.random.default_rng(6).normal(size=(ROWS, LENGTH, V)) * 3, jnp.float32)
    opd = make_opd_loss(OPDConfig(hard_ce_weight=0.5))
    for loss_fn, b in [(lambda m, b: sft_objective(m, b), batch), (lambda m, b: opd(m, b, None),
                                                                   DistillationBatch(batch, teacher))]:
        def run(m, b=b, loss_fn=loss_fn):
            params, static = eqx.partition(m, trainable_filter(m))
            assert params.embedding is None  # the head is frozen
            value, grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), b).loss.compute())(params)
            return value, grads

        (value, grads), (value_c, grads_c) = jax.jit(run)(model), jax.jit(run)(model.with_logits_chunk(5))
        np.testing.assert_allclose(value_c, value, **TOL)
        leaves, leaves_c = jax.tree.leaves(grads), jax.tree.leaves(grads_c)
        assert len(leaves) == len(leaves_c) == 4 and all(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)
        for g, g_c in zip(leaves, leaves_c):
            np.testing.assert_allclose(g_c, g, rtol=1e-5, atol=1e-7)


def test_the_chunked_backward_keeps_neither_logits_nor_teacher_logits():
    """`sum_logits` takes the head's gradient in the forward pass: what the backward pass of a
    chunked SFT or OPD loss keeps (its residuals) holds nothing over the vocabulary, neither logits
    nor OPD's teacher logits (which the whole logits' backward keeps, and `map_logits`' too)."""
    model, batch = _model(), _batch(2)
    teacher = jnp.asarray(np.random.default_rng(3).normal(size=(ROWS, LENGTH, V)) * 3, jnp.float32)
    opd = make_opd_loss(OPDConfig(temperature=2.0, hard_ce_weight=0.5))
    for loss_fn, b in [(lambda m, b: sft_objective(m, b), batch), (lambda m, b: opd(m, b, None),
                                                                   DistillationBatch(batch, teacher))]:
        def residual_shapes(m, b=b, loss_fn=loss_fn):
            params, static = eqx.partition(m, eqx.is_inexact_array)
            _, backward = jax.vjp(lambda p: loss_fn(eqx.combine(p, static), b).loss.numerator, params)
            return [x.shape for x in jax.tree.leaves(backward) if hasattr(x, "shape")]

        assert (ROWS, LENGTH, V) in residual_shapes(model)  # the whole logits' backward keeps them
        # chunked: nothing over the vocabulary (the tied head's [V, D] gradient ends in D)
        assert not [shape for shape in residual_shapes(model.with_logits_chunk(5)) if shape[-1:] == (V,)]


DISTRIBUTIONS = {
    "model": SamplingDistribution(),
    "filtered": SamplingDistribution(temperature=0.7, top_k=9, top_p=0.9, banned_ids=(MASK,)),
}


@pytest.mark.parametrize(("chunk", "name"), [(5, "model"), (4, "filtered")])
def test_replay_logprobs_and_grpo_gradients_equal_the_whole_logits(chunk, name):
    model, batch, distribution = _model(), _batch(4), DISTRIBUTIONS[name]
    # targets among each position's 3 likeliest ids: inside every filter, so each has a gradient
    rank = np.random.default_rng(6).integers(0, 3, (ROWS, LENGTH, 1))
    likely = jnp.take_along_axis(jnp.argsort(-distribution.logprobs(model(batch.layout)), axis=-1), rank, axis=-1)
    batch = dataclasses.replace(batch, targets=jnp.where(batch.weights > 0, likely[..., 0], 0))
    chunked = model.with_logits_chunk(chunk)
    score = eqx.filter_jit(lambda m: token_logprobs(m, batch, distribution, with_entropy=True))
    whole, got = score(model), score(chunked)
    for a, b in zip(whole, got):
        np.testing.assert_allclose(b, a, **TOL)
    old = jax.lax.stop_gradient(whole[0]) + 0.05 * jnp.asarray(np.random.default_rng(5).normal(size=(ROWS, LENGTH)))
    grpo = GRPOBatch(batch, old, jnp.asarray([1.0, -0.5, 0.25]), ref_logp=old - 0.1)
    loss = make_grpo_loss(GRPOConfig(beta=0.05), distribution_score(distribution))
    loss_fn = lambda m, b: loss(m, b, None)  # noqa: E731
    _assert_same(_loss_and_grads(loss_fn, model, grpo), _loss_and_grads(loss_fn, chunked, grpo))


def test_with_the_vocabulary_split_over_fsdp_losses_and_gradients_equal_one_device():
    """On a (data 2, fsdp 4) mesh of a 64-token vocabulary the head, the embedding and the logits
    are split over the vocabulary; SFT's, OPD's and GRPO's chunked losses, metrics and gradients
    are one device's to float32 tolerance."""
    import optax

    from bd_models import logits_sharding, make_mesh, shard_batch, shard_model
    from bd_train import Trainer, TrainerConfig

    vocab, rows, mesh = 64, 16, make_mesh(2, 4, 1)  # 8 rows per microbatch below: over (data, fsdp) evenly
    config = ModelConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32,
                         block_size=BLOCK, attention="dense", logits_chunk=5)
    model, batch = BlockDiffusionLM(config, key=jax.random.key(0)), _batch(7, rows)
    teacher = jnp.asarray(np.random.default_rng(8).normal(size=(rows, LENGTH, vocab)) * 3, jnp.float32)
    old = jnp.asarray(0.05 * np.random.default_rng(9).normal(size=(rows, LENGTH)) - np.log(vocab), jnp.float32)
    opd = make_opd_loss(OPDConfig(temperature=2.0, hard_ce_weight=0.5))
    grpo = make_grpo_loss(GRPOConfig(beta=0.05), distribution_score(DISTRIBUTIONS["model"]))
    cases = [(lambda m, b: sft_objective(m, b), batch),
             (lambda m, b: opd(m, b, None), DistillationBatch(batch, teacher)),
             (lambda m, b: grpo(m, b, None), GRPOBatch(batch, old, jnp.linspace(-1.0, 1.0, rows), ref_logp=old - 0.1))]
    sharded = shard_model(model, mesh)
    assert sharded.embedding.sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    for loss_fn, b in cases:
        whole = _loss_and_grads(loss_fn, model, b)
        with jax.set_mesh(mesh):
            _assert_same(whole, _loss_and_grads(loss_fn, sharded, shard_batch(b, mesh)))

    # OPD's stage: teacher logits where the model computes them (`logits_sharding`), a step of 2
    # interleaved microbatches: the updated student is one device's.
    trainer = Trainer(opd, optax.sgd(0.5), TrainerConfig(microbatches=2))
    want = trainer.step(trainer.init(model, key=jax.random.key(1)), cases[1][1])[0].model
    placed = jax.device_put(teacher, logits_sharding(mesh, vocab))
    assert placed.sharding.spec == jax.sharding.PartitionSpec("data", None, "fsdp")
    with jax.set_mesh(mesh):
        got = trainer.step(trainer.init(sharded, key=jax.random.key(1)),
                           DistillationBatch(shard_batch(batch, mesh), placed))[0].model
    for g, w in zip(jax.tree.leaves(eqx.filter(got, eqx.is_array)), jax.tree.leaves(eqx.filter(want, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-6)

    # As the stage runs it now: the teacher's features placed by rows and its head where the sharded
    # teacher holds it (split over the vocabulary); the step equals the step from its logits.
    teacher_model = BlockDiffusionLM(config.replace(d_model=24, logits_chunk=0), key=jax.random.key(2))
    features = teacher_model.features(batch.layout)
    want = trainer.step(trainer.init(model, key=jax.random.key(1)),
                        DistillationBatch(batch, teacher_model(batch.layout)))[0].model
    placed_teacher = shard_model(teacher_model, mesh)
    assert placed_teacher.head_weight.sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    with jax.set_mesh(mesh):
        by_features = DistillationBatch(shard_batch(batch, mesh), teacher_features=shard_batch(features, mesh),
                                        teacher_head=teacher_head(placed_teacher))
        got = trainer.step(trainer.init(sharded, key=jax.random.key(1)), by_features)[0].model
    for g, w in zip(jax.tree.leaves(eqx.filter(got, eqx.is_array)), jax.tree.leaves(eqx.filter(want, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-6)


def test_logits_chunk_is_validated():
    with pytest.raises(ValueError, match="logits_chunk"):
        _model().config.replace(logits_chunk=-1)


def test_unrolled_for_cost_the_chunked_logits_count_their_whole_work():
    """The plan reads costs from programs traced inside `unroll_layers`, where XLA's cost analysis,
    which counts a loop's body once, must see every chunk of the logits: the chunked SFT step then
    counts the whole-logits step's FLOPs (to the chunks' slicing), where the rolled loop counts one
    chunk's share of the head."""
    model, batch = _model(), _batch(1)

    def flops(m, *, unrolled: bool = True) -> float:
        params, static = eqx.partition(m, eqx.is_array)
        step = jax.jit(jax.grad(lambda p: sft_objective(eqx.combine(p, static), batch).loss.compute()))
        with unroll_layers() if unrolled else contextlib.nullcontext():
            cost = step.lower(params).compile().cost_analysis()
        return float((cost[0] if isinstance(cost, list) else cost)["flops"])

    whole, chunked = flops(model), flops(model.with_logits_chunk(4))
    # In chunks, elementwise work that the whole logits do not do: the target's logit picked by a
    # compare and sum (O(B·T·V)) and the head gradient's zero start and scaling (O(V·D)), beside the
    # head's O(B·T·V·D) products: 2.0% at this toy size (D = 16), under 0.1% at D = 2048.
    assert chunked == pytest.approx(whole, rel=0.03)
    # what the twin counted before the chunk loop was unrolled too: one chunk's share of the head
    assert flops(model.with_logits_chunk(4), unrolled=False) < 0.9 * chunked
