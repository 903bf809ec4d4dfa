"""grain pipelines: determinism, save/restore to the identical next batch (also through Orbax),
process sharding, prompt batches and worker processes."""

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from bd_core import DiffusionTokenBatch
from bd_data import (
    ByteTokenizer,
    CanvasConfig,
    CorruptionConfig,
    PromptBatch,
    get_task,
    iterate,
    prompt_canvas,
    prompt_dataset,
    sft_dataset,
)

TOK = ByteTokenizer()
CANVAS = CanvasConfig(prompt_len=16, max_new_tokens=8, block_size=4)
SOURCE = get_task("sort", seed=1).dataset("train", size=50)
SHARD = dict(shard_index=0, shard_count=1)


def _sft(seed=0, **kw):
    kw = {**SHARD, **kw}
    return sft_dataset(SOURCE, TOK, CANVAS, CorruptionConfig(stratified=True), seed=seed, batch_size=8, **kw)


def _same(a, b):
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(leaves_a) == len(leaves_b) and all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b))


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_batches_are_numpy_diffusion_batches_and_deterministic():
    first = _take(iterate(_sft()), 8)  # 8 batches of 8 > 50 examples: crosses an epoch boundary
    assert all(isinstance(b, DiffusionTokenBatch) and isinstance(b.layout.tokens, np.ndarray) for b in first)
    assert first[0].layout.shape == (8, 16 + 2 * 8)
    assert all(_same(x, y) for x, y in zip(first, _take(iterate(_sft()), 8)))
    assert all(_same(x, _sft()[i]) for i, x in enumerate(first))  # iteration == random access
    assert not _same(first[0], _sft(seed=1)[0])


def test_each_epoch_is_a_fresh_permutation():
    ds = prompt_dataset(SOURCE, TOK, CANVAS, seed=0, batch_size=10, **SHARD)
    epochs = [np.concatenate([ds[e * 5 + i].index for i in range(5)]) for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(50))
    assert not np.array_equal(epochs[0], epochs[1])


def test_get_state_set_state_gives_the_identical_next_batch():
    it = iterate(_sft())
    _take(it, 9)
    state = it.get_state()
    expected = _take(it, 3)
    fresh = iterate(_sft())
    fresh.set_state(state)
    assert all(_same(x, y) for x, y in zip(expected, _take(fresh, 3)))


def test_orbax_composite_checkpoint_restores_the_iterator(tmp_path):
    it = iterate(_sft())
    _take(it, 4)
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as manager:
        manager.save(4, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it),
                                                meta=ocp.args.JsonSave({"step": 4})))
    expected = _take(it, 2)
    fresh = iterate(_sft())
    with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as manager:
        manager.restore(4, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh),
                                                   meta=ocp.args.JsonRestore()))
    assert all(_same(x, y) for x, y in zip(expected, _take(fresh, 2)))


def test_shards_partition_the_source():
    def indices(shard):
        ds = prompt_dataset(SOURCE, TOK, CANVAS, seed=0, batch_size=4, shard_index=shard, shard_count=3,
                            shuffle=False, num_epochs=1, drop_remainder=False)
        return np.concatenate([b.index for b in iterate(ds)])

    parts = [indices(s) for s in range(3)]
    assert sorted(np.concatenate(parts)) == list(range(50))
    assert all(len(set(a) & set(b)) == 0 for i, a in enumerate(parts) for b in parts[i + 1:])
    default = prompt_dataset(SOURCE, TOK, CANVAS, seed=0, batch_size=4, shuffle=False)  # JAX process 0 of 1
    sharded = prompt_dataset(SOURCE, TOK, CANVAS, seed=0, batch_size=4, shuffle=False, **SHARD)
    assert _same(default[0].tokens, sharded[0].tokens)
    with pytest.raises(ValueError, match="shard_index < shard_count"):
        prompt_dataset(SOURCE, TOK, CANVAS, seed=0, batch_size=4, shard_index=3, shard_count=3)


def test_prompt_batches_carry_what_rewards_need():
    ds = prompt_dataset(SOURCE, TOK, CANVAS, seed=5, batch_size=6, **SHARD)
    batch = ds[0]
    assert isinstance(batch, PromptBatch)
    assert batch.tokens.shape == batch.valid.shape == (6, 16) and batch.tokens.dtype == np.int32
    assert batch.positions.shape == (6, 24) and batch.valid.dtype == bool
    for row, index in enumerate(batch.index):
        example = SOURCE[int(index)]
        tokens, valid, _ = prompt_canvas(TOK.encode(example.prompt), CANVAS, TOK)
        assert np.array_equal(batch.tokens[row], tokens) and np.array_equal(batch.valid[row], valid)
        assert batch.answers[row] == example.answer and batch.examples[row] == example


def test_worker_processes_match_in_process():
    from absl import flags

    flags.FLAGS.mark_as_parsed()
    expected = _take(iterate(_sft()), 3)
    it = iterate(_sft(), worker_count=1)
    assert all(_same(x, y) for x, y in zip(expected, _take(it, 3)))
    state = it.get_state()
    following = _take(it, 1)[0]
    fresh = iterate(_sft(), worker_count=1)  # a state restores into an iterator of the same worker_count
    fresh.set_state(state)
    assert _same(following, next(fresh))
