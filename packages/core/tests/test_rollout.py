"""Traces and rollouts: validation and the atomic merge of shards."""

import dataclasses

import jax
import numpy as np
import pytest

from bd_core import (
    ContractError,
    DiffusionTrace,
    RolloutOutput,
    merge_rollouts,
)

P, N, R, BLOCK = 4, 4, 3, 2


def make_trace(rows, *, steps=R):
    committed = np.zeros((rows, steps, BLOCK), bool)
    committed[:, 0, 0] = committed[:, 1, 1] = True
    return DiffusionTrace(
        block_ids=np.tile(np.array([2, 2, 3][:steps]), (rows, 1)).astype(np.int32),
        committed=committed,
        tokens=np.where(committed, 7, 0).astype(np.int32),
        logprobs=np.where(committed, -0.5, 0.0).astype(np.float32),
        step_valid=np.tile(np.array([True, True, False][:steps]), (rows, 1)),
    )


def make_rollout(rows, *, trace=True, seed=0):
    rng = np.random.default_rng(seed)
    return RolloutOutput(
        prompt_tokens=rng.integers(0, 9, (rows, P)).astype(np.int32),
        prompt_valid=np.ones((rows, P), bool),
        completion_tokens=rng.integers(0, 9, (rows, N)).astype(np.int32),
        completion_valid=np.ones((rows, N), bool),
        nfe=np.full((rows,), 2, np.int32),
        trace=make_trace(rows) if trace else None,
    ).validate()


def test_merge_concatenates_every_field_on_the_batch_axis():
    parts = [make_rollout(2, seed=0), make_rollout(3, seed=1)]
    merged = merge_rollouts(parts).validate()
    assert merged.batch_size == 5
    np.testing.assert_array_equal(merged.completion_tokens[2:], parts[1].completion_tokens)
    np.testing.assert_array_equal(merged.trace.logprobs[:2], parts[0].trace.logprobs)


def test_merge_refuses_a_trace_in_some_shards_only():
    with pytest.raises(ContractError, match=r"field 'trace' is present in some shards but missing in shard\(s\) \[1\]"):
        merge_rollouts([make_rollout(2), make_rollout(2, trace=False)])


def test_merge_refuses_rows_that_disagree_with_the_batch_size():
    bad = dataclasses.replace(make_rollout(3), nfe=np.zeros((2,), np.int32))
    with pytest.raises(ContractError, match=r"shard 1 field .*nfe has shape \(2,\); expected 3 rows"):
        merge_rollouts([make_rollout(2), bad])


def test_merge_refuses_mismatched_per_row_shapes():
    other = dataclasses.replace(make_rollout(2), trace=make_trace(2, steps=2))
    with pytest.raises(ContractError, match=r"shard 1 field .*trace.*per-row shape \(2,\)"):
        merge_rollouts([make_rollout(2), other])


def test_merge_refuses_mismatched_tree_structure():
    other = dataclasses.replace(make_rollout(2), trace=dataclasses.replace(make_trace(2), version=0))
    with pytest.raises(ContractError, match=r"shard 1 has tree structure"):
        merge_rollouts([make_rollout(2), other])


def test_merge_refuses_empty_and_foreign_shards():
    with pytest.raises(ContractError, match="got no shards"):
        merge_rollouts([])
    with pytest.raises(ContractError, match=r"shard 1 is a dict"):
        merge_rollouts([make_rollout(2), {}])


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("committed", np.zeros((2, R, BLOCK), np.int32), r"DiffusionTrace\.committed: expected dtype bool"),
        ("tokens", np.zeros((2, R, BLOCK + 1), np.int32), r"DiffusionTrace\.tokens: expected shape"),
        ("logprobs", np.zeros((2, R, BLOCK), np.int32), r"DiffusionTrace\.logprobs: expected a floating dtype"),
        ("step_valid", np.zeros((2, R + 1), bool), r"DiffusionTrace\.step_valid: expected shape"),
        ("block_ids", np.zeros((2,), np.int32), r"DiffusionTrace\.block_ids: expected rank 2"),
        ("logprobs", np.full((2, R, BLOCK), 0.5, np.float32), r"committed log-probs must be finite and <= 0"),
        ("step_valid", np.zeros((2, R), bool), r"committed in a step that step_valid marks invalid"),
    ],
)
def test_trace_errors_name_the_field(field, value, message):
    trace = dataclasses.replace(make_trace(2), **{field: value})
    with pytest.raises(ContractError, match=message):
        trace.validate()


def test_rollout_errors_name_the_field():
    good = make_rollout(2)
    with pytest.raises(ContractError, match=r"RolloutOutput\.completion_tokens: expected 2 rows"):
        dataclasses.replace(good, completion_tokens=np.zeros((3, N), np.int32)).validate()
    with pytest.raises(ContractError, match=r"RolloutOutput\.trace: expected 2 rows, got 3"):
        dataclasses.replace(good, trace=make_trace(3)).validate()
    with pytest.raises(ContractError, match=r"RolloutOutput\.prompt_valid: expected dtype bool"):
        dataclasses.replace(good, prompt_valid=np.ones((2, P), np.int32)).validate()


def test_rollout_passes_through_jit_and_vmap():
    rollout = make_rollout(3)
    out = jax.jit(lambda r: r)(rollout)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(rollout)
    counts = jax.vmap(lambda r: r.trace.committed.sum())(rollout)
    np.testing.assert_array_equal(counts, [2, 2, 2])
