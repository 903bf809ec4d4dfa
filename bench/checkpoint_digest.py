"""What the checkpoints' content digests cost: a train state whose model alone is over 1 GB
(float32, 5 layers of width 2048, Adam moments beside it), sharded over 8 devices (fsdp), saved
and restored by `bd_train.Checkpointer`; the digests (one per shard, at save) and their check (at
restore) are timed on their own and given as a fraction of the save and the restore that include
them. Median of 3 rounds. Writes bench/results/checkpoint_digest.json and its BENCHMARKS.md section.

    python bench/checkpoint_digest.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from _report import write_results, write_section  # noqa: E402

from bd_models import BlockDiffusionLM, ModelConfig, init_sharded, make_mesh  # noqa: E402
from bd_train import (  # noqa: E402
    Checkpointer,
    OptimizerConfig,
    Trainer,
    damaged_shards,
    make_optimizer,
    sft_objective,
    shard_digests,
)

CONFIG = ModelConfig(vocab_size=32768, d_model=2048, n_layers=5, n_heads=16, n_kv_heads=8, d_ff=5632, block_size=4,
                     attention="dense")
ROUNDS = 3


def _leaves(state) -> dict:
    """The arrays a checkpoint of `state` holds (model and optimizer state), by path."""
    return {jax.tree_util.keystr(path): leaf for path, leaf in
            jax.tree_util.tree_leaves_with_path((state.model, state.opt_state)) if isinstance(leaf, jax.Array)}


def _bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def main() -> None:
    mesh = make_mesh(1, 8, 1)
    model = init_sharded(lambda: BlockDiffusionLM(CONFIG, key=jax.random.key(0)), mesh)
    state = Trainer(sft_objective, make_optimizer(OptimizerConfig())).init(model, key=jax.random.key(1))
    model_gb, state_gb = _bytes(state.model) / 1e9, _bytes((state.model, state.opt_state)) / 1e9
    times: dict[str, list[float]] = {"save": [], "digest": [], "restore": [], "verify": []}
    for _ in range(ROUNDS):
        folder = Path(tempfile.mkdtemp(prefix="digest-bench-"))
        try:
            t = time.perf_counter()
            saved = shard_digests(_leaves(state))
            times["digest"].append(time.perf_counter() - t)
            with Checkpointer(folder) as checkpoints:
                t = time.perf_counter()
                checkpoints.save(state)
                checkpoints.wait()
                times["save"].append(time.perf_counter() - t)
                t = time.perf_counter()
                restored = checkpoints.restore(state)
                jax.block_until_ready(restored.model)
                times["restore"].append(time.perf_counter() - t)
            t = time.perf_counter()
            assert damaged_shards(_leaves(restored), saved) == []
            times["verify"].append(time.perf_counter() - t)
            del restored
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    probe = {"probe": jax.numpy.zeros(256 * 2**20, jax.numpy.uint8)}
    t = time.perf_counter()
    shard_digests(probe)
    sha256_gb_per_s = probe["probe"].nbytes / 1e9 / (time.perf_counter() - t)
    results = {"model_gb": model_gb, "state_gb": state_gb, **{f"{k}_s": v for k, v in median.items()},
               "digest_fraction_of_save": median["digest"] / median["save"],
               "verify_fraction_of_restore": median["verify"] / median["restore"], "sha256_gb_per_s": sha256_gb_per_s}
    write_results("checkpoint_digest", results)
    body = f"""## Checkpoint content digests (`bench/checkpoint_digest.py`)

A train state with a {model_gb:.2f} GB model ({state_gb:.2f} GB with its Adam moments: what a
checkpoint holds), float32, sharded fsdp over 8 devices: one SHA-256 per shard. Median of {ROUNDS} rounds.

| | seconds | share |
|---|---|---|
| save (`Checkpointer.save`, digests included) | {median["save"]:.2f} | |
| the digests alone | {median["digest"]:.2f} | {results["digest_fraction_of_save"]:.1%} of the save |
| restore (`Checkpointer.restore`, check included) | {median["restore"]:.2f} | |
| the check alone | {median["verify"]:.2f} | {results["verify_fraction_of_restore"]:.1%} of the restore |

The digests are computed on the host that holds each shard, a thread per core (hashlib releases
the GIL, and reads the arrays' bytes in place); in a group only 32 bytes per shard travel, to the
process that writes the metadata. SHA-256 runs at {results["sha256_gb_per_s"]:.1f} GB/s on one core
here, so the share falls with the cores a host gives it."""
    write_section("checkpoint_digest", body)
    print(body)


if __name__ == "__main__":
    main()
