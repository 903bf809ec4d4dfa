"""A few SFT steps on a (data=2, fsdp=2, model=2) mesh, then a checkpoint: run as one process of a
multi-process group (`python distributed_worker.py <coordinator> <count> <id> <dir>`) or imported
by the test as the single-process reference on 8 devices. After training, each process restores
the group's checkpoint `RESTORES` times (a clean checkpoint must never be refused) and writes what
happened to `<dir>/restore-<id>.txt` ("restored", or the refusals). With a fifth argument
`restore`, a group process only restores `<dir>/checkpoints` once into that mesh."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

SHARDS = 2  # grain shards: one per process of the group, both read by the reference
STEPS = 3
RESTORES = 50


def _batches(shard: int | None):
    from bd_data import ByteTokenizer, CanvasConfig, get_task, iterate, sft_dataset

    canvas = CanvasConfig(prompt_len=8, max_new_tokens=8, block_size=4)
    source = get_task("sort", seed=0, length=4).dataset("train")
    shards = range(SHARDS) if shard is None else [shard]
    return [iterate(sft_dataset(source, ByteTokenizer(), canvas, seed=0, batch_size=4, shard_index=i,
                                shard_count=SHARDS), prefetch=0) for i in shards]


def _fresh_state():
    from bd_data import ByteTokenizer
    from bd_models import BlockDiffusionLM, ModelConfig, make_mesh, shard_model
    from bd_train import OptimizerConfig, Trainer, make_optimizer, sft_objective

    mesh = make_mesh(2, 2, 2)
    config = ModelConfig(vocab_size=ByteTokenizer().vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         d_ff=64, block_size=4, attention="shard_map", q_tile=16, k_tile=16)
    trainer = Trainer(sft_objective, make_optimizer(OptimizerConfig(learning_rate=1e-2)))
    return mesh, trainer, trainer.init(shard_model(BlockDiffusionLM(config, key=jax.random.key(0)), mesh),
                                       key=jax.random.key(1))


def restore(directory: Path, times: int = 1) -> str:
    """Restore the group's checkpoint `times` times into a fresh state on the mesh: "restored", or
    the refusal (with how many of the restores were refused, when more than one was made)."""
    from bd_train import Checkpointer, CheckpointError

    _, _, target = _fresh_state()
    refusals = []
    with Checkpointer(directory / "checkpoints", create=False) as checkpoints:
        for _ in range(times):
            try:
                checkpoints.restore(target)
            except CheckpointError as err:
                refusals.append(str(err))
    if not refusals:
        return "restored"
    return refusals[0] if times == 1 else f"{len(refusals)} of {times} restores refused, first: {refusals[0]}"


def train(directory: Path) -> tuple[list[float], object]:
    """Steps 1..2 on process-local grain shards, step 3 on a global batch every process reads whole."""
    from bd_models import shard_batch
    from bd_train import Checkpointer

    mesh, trainer, state = _fresh_state()
    local = jax.process_count() > 1
    streams = _batches(jax.process_index() if local else None)
    every_shard = _batches(None)
    losses = []
    with jax.set_mesh(mesh):
        for step in range(STEPS):
            if step < STEPS - 1:
                rows = [next(s) for s in streams]
                batch = shard_batch(jax.tree.map(lambda *x: np.concatenate(x), *rows), mesh, process_local=local)
            else:
                rows = [next(s) for s in every_shard]
                batch = shard_batch(jax.tree.map(lambda *x: np.concatenate(x), *rows), mesh)
            state, metrics = trainer.step(state, batch)
            losses.append(float(metrics["loss"]))
    with Checkpointer(directory / "checkpoints", max_to_keep=1) as checkpoints:
        checkpoints.save(state, force=True)
        checkpoints.wait()
    return losses, state


if __name__ == "__main__":
    from bd_train.distributed import ProcessGroup, initialize, shutdown

    coordinator, count, index, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    initialize(ProcessGroup(coordinator, count, index), cpu_devices=8 // count)
    assert jax.device_count() == 8 and jax.local_device_count() == 8 // count
    if sys.argv[5:] == ["restore"]:
        (out / f"restore-{index}.txt").write_text(restore(out))
    else:
        losses, _ = train(out)
        (out / f"losses-{index}.json").write_text(json.dumps(losses))
        # every process verifies the shards it reads, again and again: no restore of it may be refused
        (out / f"restore-{index}.txt").write_text(restore(out, RESTORES))
    shutdown()
