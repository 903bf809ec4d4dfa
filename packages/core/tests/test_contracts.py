"""Contract validation: each malformed field is named; contracts pass through jit and vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bd_core import (
    ContractError,
    DiffusionTokenBatch,
    DistillationBatch,
    TeacherHead,
    Unsplit,
    ViewLayout,
    attention_allowed,
)

B, T, V = 2, 6, 11


def layout_arrays():
    return dict(
        tokens=np.arange(B * T).reshape(B, T) % V,
        positions=np.tile(np.arange(T), (B, 1)),
        block_ids=np.tile(np.arange(T) // 2, (B, 1)),
        view_ids=np.zeros((B, T), np.int32),
        valid=np.ones((B, T), bool),
    )


def make_batch(**overrides):
    layout = ViewLayout.create(**layout_arrays())
    fields = dict(targets=np.ones((B, T), np.int32), weights=np.full((B, T), 0.5, np.float32))
    fields.update(overrides)
    return DiffusionTokenBatch.create(layout, vocab_size=V, **fields)


@pytest.mark.parametrize(
    "field, bad, message",
    [
        ("tokens", np.zeros((B, T, 1), np.int32), r"ViewLayout\.tokens: expected rank 2"),
        ("positions", np.zeros((B, T + 1), np.int32), r"ViewLayout\.positions: expected shape \(2, 6\)"),
        ("block_ids", np.zeros((B, T), np.float32), r"ViewLayout\.block_ids: expected an integer dtype"),
        ("view_ids", np.zeros((B + 1, T), np.int32), r"ViewLayout\.view_ids: expected shape"),
        ("valid", np.zeros((B, T), np.int32), r"ViewLayout\.valid: expected dtype bool"),
        ("positions", -np.ones((B, T), np.int32), r"ViewLayout\.positions: expected values >= 0"),
    ],
)
def test_layout_errors_name_the_field(field, bad, message):
    arrays = layout_arrays()
    arrays[field] = bad
    with pytest.raises(ContractError, match=message):  # shapes and dtypes on construction, values in validate()
        ViewLayout(**{k: jnp.asarray(v) for k, v in arrays.items()}).validate()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(targets=np.ones((B, T + 1), np.int32)), r"DiffusionTokenBatch\.targets: expected shape"),
        (dict(targets=np.ones((B, T), np.float32)), r"DiffusionTokenBatch\.targets: expected an integer dtype"),
        (dict(weights=np.ones((B, T), np.int32)), r"DiffusionTokenBatch\.weights: expected a floating or bool"),
        (dict(weights=np.ones((B,), np.float32)), r"DiffusionTokenBatch\.weights: expected shape"),
        (dict(weights=np.full((B, T), np.nan, np.float32)), r"DiffusionTokenBatch\.weights: expected finite"),
        (dict(weights=-np.ones((B, T), np.float32)), r"DiffusionTokenBatch\.weights: expected values >= 0"),
        (dict(denom_weights=-np.ones((B, T), np.float32)), r"DiffusionTokenBatch\.denom_weights: expected values"),
        (dict(targets=np.full((B, T), V, np.int32)),
         r"DiffusionTokenBatch\.targets: active targets must be < vocab_size=11"),
        (dict(targets=-np.ones((B, T), np.int32)), r"DiffusionTokenBatch\.targets: active targets must be >= 0"),
    ],
)
def test_batch_errors_name_the_field(overrides, message):
    with pytest.raises(ContractError, match=message):
        make_batch(**overrides)


def test_inactive_targets_are_not_value_checked():
    targets = np.full((B, T), 10**6, np.int32)
    weights = np.zeros((B, T), np.float32)
    batch = make_batch(targets=targets, weights=weights)
    assert batch.denom_weights.sum() == 0


def test_weight_on_an_invalid_position_is_an_error():
    arrays = layout_arrays()
    arrays["valid"][0, 0] = False
    layout = ViewLayout.create(**arrays)
    with pytest.raises(ContractError, match=r"weights: positive weight on a position that layout\.valid marks invalid"):
        DiffusionTokenBatch.create(layout, np.ones((B, T), np.int32), np.ones((B, T), np.float32))


def test_bool_weights_become_real_and_default_denominator_counts_active_tokens():
    weights = np.zeros((B, T), bool)
    weights[:, 1] = True
    batch = make_batch(weights=weights)
    assert batch.weights.dtype == jnp.float32 and float(batch.denom_weights.sum()) == B


def test_batch_passes_through_jit_and_vmap_with_static_checks():
    batch = make_batch()

    @jax.jit
    def f(b):
        b.validate(vocab_size=V)  # static checks only under tracing
        return jax.tree_util.tree_map(lambda x: x, b)

    out = f(batch)
    assert isinstance(out, DiffusionTokenBatch)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(batch)
    sums = jax.vmap(lambda b: jnp.sum(b.weights * b.layout.valid))(batch)
    np.testing.assert_allclose(sums, [3.0, 3.0])

    with pytest.raises(ContractError, match=r"targets: expected an integer dtype"):
        jax.jit(lambda b: DiffusionTokenBatch(b.layout, b.targets.astype(jnp.float32), b.weights,
                                              b.denom_weights).validate())(batch)


def test_distillation_batch_requires_target_aligned_logits():
    batch = make_batch()
    DistillationBatch.create(batch, np.zeros((B, T, V), np.float32))
    with pytest.raises(ContractError,
                       match=r"DistillationBatch\.teacher_logits: expected target-aligned shape \(2, 6, V\)"):
        DistillationBatch.create(batch, np.zeros((B, T - 1, V), np.float32))
    with pytest.raises(ContractError, match=r"DistillationBatch\.teacher_logits: expected rank 3"):
        DistillationBatch.create(batch, np.zeros((B, T), np.float32))
    with pytest.raises(ContractError, match=r"DistillationBatch\.teacher_logits: expected a floating dtype"):
        DistillationBatch.create(batch, np.zeros((B, T, V), np.int32))
    with pytest.raises(ContractError, match=r"DistillationBatch\.teacher_logits: expected finite"):
        DistillationBatch.create(batch, np.full((B, T, V), np.inf, np.float32))
    with pytest.raises(ContractError, match=r"DistillationBatch\.student: expected a DiffusionTokenBatch"):
        DistillationBatch.create(batch.layout, np.zeros((B, T, V), np.float32))


def test_distillation_batch_takes_teacher_features_with_the_head_that_reads_them():
    batch, width = make_batch(), 4
    features, head = np.zeros((B, T, width), np.float32), TeacherHead(jnp.zeros((V, width)), True, "float32")
    made = DistillationBatch.create(batch, teacher_features=features, teacher_head=head)
    assert made.teacher_logits is None and head.vocab_size == V and head.d_model == width
    untied = TeacherHead(jnp.zeros((width, V)), False, "float32")
    assert (untied.vocab_size, untied.d_model) == (V, width)
    DistillationBatch.create(batch, teacher_features=features, teacher_head=untied)
    # the head is a pytree whose static fields stay put, and microbatching leaves it whole
    assert jax.tree.leaves(head) == [head.weight] and isinstance(head, Unsplit)
    with pytest.raises(ContractError, match=r"either teacher_logits or teacher_features"):
        DistillationBatch.create(batch, np.zeros((B, T, V), np.float32), teacher_features=features, teacher_head=head)
    with pytest.raises(ContractError, match=r"either teacher_logits or teacher_features"):
        DistillationBatch.create(batch)
    with pytest.raises(ContractError, match=r"teacher_head: expected with teacher_features"):
        DistillationBatch.create(batch, teacher_features=features)
    with pytest.raises(ContractError, match=r"teacher_features: expected target-aligned shape \(2, 6, D\)"):
        DistillationBatch.create(batch, teacher_features=features[:, :-1], teacher_head=head)
    with pytest.raises(ContractError, match=r"teacher_head: its weight \(4, 11\) \(tied=False\) does not take "
                                            r"features of width 3"):
        DistillationBatch.create(batch, teacher_features=features[..., :3], teacher_head=untied)
    with pytest.raises(ContractError, match=r"teacher_features: expected finite"):
        DistillationBatch.create(batch, teacher_features=np.full((B, T, width), np.nan, np.float32), teacher_head=head)


def test_attention_rule_on_a_two_view_layout():
    # One row: clean blocks 0,1 (2 tokens each), then a noisy view (v=1) of block 1.
    layout = ViewLayout.create(
        tokens=[[1, 2, 3, 4, 9, 9]],
        positions=[[0, 1, 2, 3, 2, 3]],
        block_ids=[[0, 0, 1, 1, 1, 1]],
        view_ids=[[0, 0, 0, 0, 1, 1]],
        valid=[[True, True, True, True, True, False]],
    )
    allowed = np.asarray(attention_allowed(layout))[0].astype(int)
    expected = np.array([
        [1, 1, 0, 0, 0, 0],  # clean block 0: itself only
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],  # clean block 1: clean block 0 and itself
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # noisy view of block 1: earlier clean blocks, its own view, not padding
        [0, 0, 0, 0, 0, 0],  # an invalid query sees nothing
    ])
    np.testing.assert_array_equal(allowed, expected)


def test_direct_construction_from_arrays_checks_shapes_and_dtypes():
    """`DiffusionTokenBatch(...)` / `ViewLayout(...)` built directly used to skip every check."""
    batch = make_batch()
    with pytest.raises(ContractError, match=r"DiffusionTokenBatch\.targets: expected an integer dtype"):
        DiffusionTokenBatch(batch.layout, np.asarray(batch.targets, np.float32), batch.weights, batch.denom_weights)
    with pytest.raises(ContractError, match=r"DiffusionTokenBatch\.weights"):
        DiffusionTokenBatch(batch.layout, batch.targets, np.asarray(batch.weights)[:, :-1], batch.denom_weights)
    layout = batch.layout
    with pytest.raises(ContractError, match=r"ViewLayout\.valid"):
        type(layout)(layout.tokens, layout.positions, layout.block_ids, layout.view_ids, np.asarray(layout.tokens))
    # Pytree code still rebuilds contracts from other leaves: vmapped rows, specs, sentinels.
    rows = jax.vmap(lambda b: b)(batch)
    assert isinstance(rows, DiffusionTokenBatch)
    specs = jax.tree.map(lambda _: jax.sharding.PartitionSpec("data"), batch)
    assert isinstance(specs, DiffusionTokenBatch)
