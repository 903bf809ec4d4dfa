"""Per-shard content digests: a sharded state's checkpoint records one digest per shard, verifies
when restored into another layout (another mesh, one device), and a shard that differs from its
digest is named. The two-process cases are in `test_distributed.py`."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from bd_models import BlockDiffusionLM, ModelConfig, make_mesh, shard_model
from bd_train import CheckpointCorrupted, Checkpointer, OptimizerConfig, Trainer, make_optimizer, sft_objective
from bd_train._shard_digests import _gathered, _holders, _regions_by_process, digest, parse_region, region_key

CONFIG = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, block_size=4,
                     attention="dense")
EMBEDDING = "model/embedding"


def _state(mesh=None):
    model = BlockDiffusionLM(CONFIG, key=jax.random.key(0))
    if mesh is not None:
        model = shard_model(model, mesh)
    return Trainer(sft_objective, make_optimizer(OptimizerConfig())).init(model, key=jax.random.key(1))


def _leaf(state):
    return state.model.embedding


def test_region_keys_round_trip():
    for region in [(), ((0, 4),), ((0, 16), (8, 32))]:
        assert parse_region(region_key(region)) == region


def test_a_sharded_state_records_one_digest_per_shard_computed_from_its_own_bytes(tmp_path):
    state = _state(make_mesh(1, 4, 2))
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state)
        digests = checkpoints.read_meta()["digests"]
    embedding = _leaf(state)
    shards = {region_key(tuple(s.indices(n)[:2] for s, n in zip(shard.index, embedding.shape))): shard
              for shard in embedding.addressable_shards if shard.replica_id == 0}
    assert len(shards) > 1 and set(digests[EMBEDDING]) == set(shards)
    for key, shard in shards.items():
        assert digests[EMBEDDING][key] == digest(np.asarray(shard.data))


@pytest.mark.parametrize("layout", ["same mesh", "another mesh", "one device"])
def test_a_sharded_checkpoint_verifies_in_any_layout(tmp_path, layout):
    saved = _state(make_mesh(1, 4, 2))
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(saved)
    mesh = {"same mesh": make_mesh(1, 4, 2), "another mesh": make_mesh(4, 1, 2), "one device": None}[layout]
    target = _state(mesh)
    with Checkpointer(tmp_path, create=False) as checkpoints:
        restored = checkpoints.restore(target)
        model = checkpoints.restore_model(target.model)
    for got, want in zip(jax.tree.leaves((restored.model, restored.opt_state, model)),
                         jax.tree.leaves((saved.model, saved.opt_state, saved.model))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert _leaf(restored).sharding == _leaf(target).sharding


@pytest.mark.parametrize("layout", ["same mesh", "one device"])
def test_a_shard_that_differs_from_its_digest_is_named(tmp_path, layout):
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(_state(make_mesh(1, 4, 2)))
    meta_file = tmp_path / "0" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    key = sorted(meta["digests"][EMBEDDING])[1]  # as if the bytes of that one shard had changed
    meta["digests"][EMBEDDING][key] = "0" * 64
    meta_file.write_text(json.dumps(meta))
    target = _state(make_mesh(1, 4, 2) if layout == "same mesh" else None)
    with Checkpointer(tmp_path, create=False) as checkpoints:
        with pytest.raises(CheckpointCorrupted) as err:
            checkpoints.restore(target)
    message = str(err.value)
    assert f"the content of {EMBEDDING} (shard {key}) differs from what was saved" in message
    assert message.count("(shard ") == 1 and len(message.splitlines()) == 1


def test_a_region_no_single_process_holds_is_gathered_at_its_own_size():
    """The fallback for a restored layout that splits a saved shard across processes: one
    process here, so the region is checked against a direct slice."""
    x = jax.device_put(np.arange(64.0).reshape(8, 8),
                       jax.sharding.NamedSharding(make_mesh(1, 4, 2), jax.sharding.PartitionSpec("fsdp", "model")))
    region = ((2, 6), (0, 8))
    np.testing.assert_array_equal(_gathered(x, region), np.arange(64.0).reshape(8, 8)[2:6])
    assert _holders(_regions_by_process(x), region) == [0]
