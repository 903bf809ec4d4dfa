"""Orbax checkpoints: bit-for-bit resume in a fresh process, fail-closed fingerprint and tree
checks, stray temp dirs, damaged files, a data pipeline built otherwise (asynchronous saves:
test_async_save.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from bd_core import FingerprintMismatch
from bd_models import BlockDiffusionLM, ModelConfig
from bd_train import (
    CheckpointCorrupted,
    Checkpointer,
    CheckpointError,
    CheckpointMismatch,
    OptimizerConfig,
    Trainer,
    make_optimizer,
    model_identity,
    rollout_semantics,
    sft_objective,
)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import resume_run  # noqa: E402

TINY = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, block_size=4,
                   attention="dense")


def _identity(config: ModelConfig, *, mask_id: int = 15, tokenizer: str = "bytes-v1"):
    return model_identity(config, tokenizer=tokenizer, vocab_size=config.vocab_size, mask_id=mask_id,
                          block_size=config.block_size)


def _real_state(config: ModelConfig):
    trainer = Trainer(sft_objective, make_optimizer(OptimizerConfig(mu_dtype="bfloat16")))
    return trainer.init(BlockDiffusionLM(config, key=jax.random.key(0)), key=jax.random.key(1))


def test_resume_in_fresh_process_is_bit_identical(tmp_path):
    n = 3
    full_params, full_losses = resume_run.run("full", str(tmp_path / "unused"), 2 * n)
    first_params, first_losses = resume_run.run("first", str(tmp_path / "ckpt"), n)
    out = tmp_path / "resumed.npz"
    subprocess.run([sys.executable, os.path.join(HERE, "resume_run.py"), "resume", str(tmp_path / "ckpt"), str(n),
                    str(out)], check=True, env=dict(os.environ), timeout=300)
    resumed = np.load(out)
    np.testing.assert_array_equal(np.asarray(first_losses + list(resumed["losses"]), np.float32),
                                  np.asarray(full_losses, np.float32))
    np.testing.assert_array_equal(resumed["params"], full_params)
    assert not np.array_equal(first_params, full_params)


def test_restore_round_trips_real_model_and_fingerprints(tmp_path):
    state = _real_state(TINY)
    fingerprints = {"model_identity": _identity(TINY)}
    with Checkpointer(tmp_path, async_save=True) as checkpointer:
        checkpointer.save(state, fingerprints=fingerprints, config={"model": TINY.to_dict(), "lr": 3e-4})
        checkpointer.wait()
        restored = checkpointer.restore(_real_state(TINY), fingerprints=fingerprints)
        meta = checkpointer.read_meta()
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), restored.model, state.model))
    leaves = jax.tree.leaves(restored.opt_state)
    assert [x.dtype for x in leaves] == [x.dtype for x in jax.tree.leaves(state.opt_state)]
    assert meta["config"]["model"]["d_ff"] == 32 and meta["versions"]["optax"] == "0.2.8"


def test_identity_mismatch_fails_closed_naming_fields(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(_real_state(TINY), fingerprints={"model_identity": _identity(TINY)})
        other = TINY.replace(block_size=8)
        with pytest.raises(FingerprintMismatch) as error:
            checkpointer.restore(_real_state(TINY), fingerprints={
                "model_identity": _identity(other, mask_id=14, tokenizer="hf:tokenizer.json")})
    message = str(error.value)
    for field in ("model_identity.block_size", "model_identity.mask_id", "model_identity.tokenizer",
                  "model_identity.architecture"):
        assert field in message
    assert "model_identity.vocab_size" not in message


def test_rollout_semantics_mismatch_names_the_field(tmp_path):
    sampler = dict(temperature=1.0, top_k=None, top_p=None, strategy="threshold", confidence="probability",
                   threshold=0.9, steps_per_block=None, max_steps_per_block=None, stop_ids=(3,), block_size=4,
                   max_new_tokens=8)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(_real_state(TINY), fingerprints={"rollout": rollout_semantics(sampler, prompt_len=8)})
        with pytest.raises(FingerprintMismatch, match="rollout.threshold"):
            checkpointer.check_fingerprints({"rollout": rollout_semantics({**sampler, "threshold": 0.8},
                                                                           prompt_len=8)})
    with pytest.raises(ValueError, match="lacks field"):
        rollout_semantics({"temperature": 1.0}, prompt_len=8)


def test_rollout_semantics_pin_bans_beyond_the_mask_and_pad_ids():
    from bd_models import SamplerConfig, SamplingDistribution

    plain = SamplerConfig(block_size=4, max_new_tokens=8, mask_id=14, pad_id=15)
    banned = plain.replace(distribution=SamplingDistribution(banned_ids=(7,)))
    assert plain.banned_ids == (14, 15)  # every sampler bans these: the fingerprint stays as it was
    assert rollout_semantics(plain, prompt_len=8).fields == rollout_semantics(plain.to_dict(), prompt_len=8).fields
    assert "banned_ids" not in rollout_semantics(plain, prompt_len=8).fields
    assert rollout_semantics(banned, prompt_len=8).fields["banned_ids"] == [7]
    mismatch = rollout_semantics(banned, prompt_len=8).diff(rollout_semantics(plain, prompt_len=8))
    assert "banned_ids" in str(mismatch)


def test_width_mismatch_fails_closed_naming_the_leaf(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(_real_state(TINY))
        with pytest.raises(CheckpointMismatch) as error:
            checkpointer.restore(_real_state(TINY.replace(d_ff=48)))
    paths = set(error.value.differences)
    assert paths and all("w_" in p for p in paths)
    assert any(p.startswith("model/layers/") for p in paths) and any(p.startswith("opt_state/") for p in paths)
    assert "model/embedding" not in paths
    assert "(1, 16, 32) float32" in str(error.value) and "(1, 16, 48) float32" in str(error.value)


def test_stray_temp_dir_is_ignored_and_missing_dirs_are_clear(tmp_path):
    state = _real_state(TINY)
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        checkpointer.save(state)
    os.makedirs(tmp_path / "ckpt" / "9.orbax-checkpoint-tmp-1234" / "model")
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        assert checkpointer.all_steps() == [0]
        restored = checkpointer.restore(_real_state(TINY))
        assert int(restored.step) == 0
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpointer(tmp_path / "nowhere", create=False)
    with Checkpointer(tmp_path / "empty") as checkpointer, pytest.raises(CheckpointError, match="no checkpoint"):
        checkpointer.restore(state)
    # the folder above a stage's checkpoint names the ones inside; a file is not a folder
    with Checkpointer(tmp_path, create=False) as checkpointer, pytest.raises(
            CheckpointError, match=r"no checkpoint in .*, but its folders \['ckpt'\] hold some; give one of them"):
        checkpointer.restore(state)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(CheckpointError, match="a_file is a file; a checkpoint is a folder of step folders"):
        Checkpointer(tmp_path / "a_file", create=False)


def _array_files(directory, item: str = "model") -> list:
    """The files that hold an item's array data, largest first: OCDBT data files, both those each
    process wrote (`ocdbt.process_<i>/d/`) and the merged B-tree at the item's root (`d/`), which
    holds arrays small enough to be stored inline; which of them a restore reads varies by run."""
    files = [p for p in (directory / item).rglob("*") if p.is_file() and p.parent.name == "d"]
    return sorted(files, key=lambda p: (-p.stat().st_size, p.name))


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_damaged_files_are_refused_by_name_with_how_to_recover(tmp_path, damage):
    """Three flipped bytes used to restore silently; a truncated file gave a long Orbax traceback."""
    state = _real_state(TINY)
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state)
    for path in _array_files(tmp_path / "0"):
        data = bytearray(path.read_bytes())
        if damage == "flip":
            for i in (len(data) // 3, len(data) // 2, 2 * len(data) // 3):
                data[i] ^= 0x5A
            path.write_bytes(bytes(data))
        elif damage == "truncate":
            path.write_bytes(bytes(data[: len(data) // 2]))
        else:
            path.unlink()
    with Checkpointer(tmp_path, create=False) as checkpoints:
        with pytest.raises(CheckpointCorrupted) as err:
            checkpoints.restore(state)
        with pytest.raises(CheckpointCorrupted):
            checkpoints.restore_model(state.model)
    message = str(err.value)
    assert f"checkpoint {tmp_path} step 0" in message and "No earlier step is kept: remove " in message
    assert "rerun the stage that wrote it" in message
    assert len(message.splitlines()) == 1 and "slice(" not in message
    # a damaged B-tree (the item's index) is named as such; damaged array data by array and shard
    assert "its array metadata could not be read" in message or (
        "the content of model/" in message and "(shard " in message), message


_RESTORE_DAMAGED = """
import sys, time, jax
from bd_models import BlockDiffusionLM, ModelConfig
from bd_train import Checkpointer, CheckpointCorrupted, OptimizerConfig, Trainer, make_optimizer, sft_objective
config = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, block_size=4)
state = Trainer(sft_objective, make_optimizer(OptimizerConfig())).init(BlockDiffusionLM(config, key=jax.random.key(0)),
                                                           key=jax.random.key(1))
try:
    with Checkpointer(sys.argv[1], create=False) as checkpoints:
        checkpoints.restore(state)
except CheckpointCorrupted as err:
    time.sleep(1)  # the reads a failed restore leaves in flight end meanwhile
    sys.exit(f"refused: {err}")
"""


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_a_damaged_checkpoint_is_the_last_thing_said(tmp_path, damage):
    """A failed restore leaves TensorStore reads in flight, whose ends Python used to print as
    screens of "Event loop is closed" tracebacks, under the message and up to the exit."""
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(_real_state(TINY))
    for path in _array_files(tmp_path / "0"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]) if damage == "truncate" else path.unlink()
    done = subprocess.run([sys.executable, "-c", _RESTORE_DAMAGED, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and "Event loop is closed" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"refused: checkpoint {tmp_path} step 0: "), done.stderr


@pytest.mark.parametrize("lost", ["model/_METADATA", "model"])
def test_an_item_whose_files_are_gone_is_damage_not_another_config(tmp_path, lost):
    """The model's metadata, or its whole folder, removed after the save: the checkpoint recorded those
    arrays, so it is damaged (not a model of another shape), and the message says how to go on."""
    import shutil

    state = _real_state(TINY)
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state)
    gone = tmp_path / "0" / lost
    shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
    with Checkpointer(tmp_path, create=False) as checkpoints:
        for restore in (checkpoints.restore, checkpoints.restore_model):
            with pytest.raises(CheckpointCorrupted, match=r"step 0: its 'model' arrays were saved but their files "
                                                          r"\(.*0/model\) are missing or damaged\. No earlier step"):
                restore(state if restore == checkpoints.restore else state.model)


def test_a_data_pipeline_built_otherwise_is_not_called_damage(tmp_path):
    """A saved pipeline position that does not fit the pipeline given (another pipeline) used to
    be reported as truncated or damaged files, with advice to remove the step: a whole
    checkpoint refused as corrupt. It is now a `CheckpointError` that says the arrays read fine
    and names the pipeline; the step is kept, and restores with the pipeline it was saved with."""
    import grain

    from bd_train import CheckpointError

    saved = iter(grain.MapDataset.range(10).to_iter_dataset())
    next(saved)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(_real_state(TINY), data_iterator=saved)
    mixed = iter(grain.IterDataset.mix([grain.MapDataset.range(10).to_iter_dataset(),
                                        grain.MapDataset.range(5).to_iter_dataset()], [0.5, 0.5]))
    with Checkpointer(tmp_path, create=False) as checkpointer:
        with pytest.raises(CheckpointError, match=r"its arrays read fine, but the data pipeline's saved position could "
                                                  r"not be set on the pipeline given") as error:
            checkpointer.restore(_real_state(TINY), data_iterator=mixed)
        assert not isinstance(error.value, CheckpointCorrupted) and "remove" not in str(error.value)
        same = iter(grain.MapDataset.range(10).to_iter_dataset())
        checkpointer.restore(_real_state(TINY), data_iterator=same)
        assert next(same) == 1
    for damaged in (tmp_path / "0" / "data").glob("process_*.json"):  # a damaged position is damage
        damaged.write_text('{"trunc')
    with Checkpointer(tmp_path, create=False) as checkpointer, pytest.raises(CheckpointCorrupted, match="remove"):
        checkpointer.restore(_real_state(TINY), data_iterator=iter(grain.MapDataset.range(10).to_iter_dataset()))


def test_content_that_differs_from_its_digest_is_named(tmp_path):
    """Bytes that still read as arrays but are not what was saved: the digest names the array."""
    state = _real_state(TINY)
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state)
    meta_file = tmp_path / "0" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["digests"]["model/embedding"] = "0" * 64  # as if the embedding's bytes had changed since the save
    meta_file.write_text(json.dumps(meta))
    with Checkpointer(tmp_path, create=False) as checkpoints:
        with pytest.raises(CheckpointCorrupted,
                           match=r"the content of model/embedding \(shard 0:16,0:16\) differs from what was saved"):
            checkpoints.restore(state)
        with pytest.raises(CheckpointCorrupted, match=r"model/embedding"):
            checkpoints.restore_model(state.model)


def test_an_earlier_step_is_offered_when_the_latest_is_damaged(tmp_path):
    state = _real_state(TINY)
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state)
        checkpoints.save(dataclasses.replace(state, step=state.step + 1))
    files = [p for p in (tmp_path / "1" / "model").rglob("*") if p.is_file() and p.parent.name == "d"]
    for path in files:
        path.write_bytes(path.read_bytes()[:8])
    with Checkpointer(tmp_path, create=False) as checkpoints:
        with pytest.raises(CheckpointCorrupted, match=r"Restore an earlier step \(\[0\]\)"):
            checkpoints.restore(state)
        assert int(checkpoints.restore(state, step=0).step) == 0  # the earlier step is intact


def test_undamaged_checkpoints_restore_their_digested_content(tmp_path):
    state = _real_state(TINY)
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state)
        assert set(checkpoints.read_meta()["digests"]) >= {"model/embedding", "counters/step", "rng/key"}
        restored = checkpoints.restore(state)
    for got, want in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
