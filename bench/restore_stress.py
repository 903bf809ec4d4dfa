"""Clean checkpoints are never refused: one clean checkpoint of a small sharded train state (Adam
moments beside the model), written by a 2-process group, restored thousands of times — by one
process on 8 devices in four layouts, and by the group itself (2 processes x 4 devices) — with the
digest check threaded as in production. Counts the refusals (there must be none) and times the
check on its own. Writes bench/results/restore_stress.json and its BENCHMARKS.md section.

    python bench/restore_stress.py [--restores 2000]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--worker" not in sys.argv:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def _state(mesh):
    import dataclasses

    import jax
    import jax.numpy as jnp

    from bd_models import BlockDiffusionLM, ModelConfig, init_sharded
    from bd_train import OptimizerConfig, TrainState, make_optimizer

    config = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, block_size=4,
                         attention="dense")
    make = lambda: BlockDiffusionLM(config, key=jax.random.key(0))  # noqa: E731
    model = make() if mesh is None else init_sharded(make, mesh)  # the stages' way: straight into its shards
    state = TrainState.init(model, make_optimizer(OptimizerConfig()), key=jax.random.key(1))
    # Adam moments that are not all zeros, so that shards' bytes differ as after training
    moments = jax.tree.map(lambda x: x + 1e-3 * jnp.cos(jnp.arange(x.size, dtype=x.dtype)).reshape(x.shape)
                           if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) else x,
                           state.opt_state)
    state = dataclasses.replace(state, opt_state=moments)
    if mesh is None:
        return state
    # counters and the key replicated over the mesh, as after a train step (a group saves only global arrays)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(replicated, jax.device_get(x))
                        if isinstance(x, jax.Array) and isinstance(x.sharding, jax.sharding.SingleDeviceSharding)
                        else x, state)


def _leaves(state) -> dict:
    """The arrays of `state` a checkpoint holds, by path."""
    import jax

    return {jax.tree_util.keystr(path): leaf for path, leaf in
            jax.tree_util.tree_leaves_with_path((state.model, state.opt_state)) if isinstance(leaf, jax.Array)}


def _loop(directory: Path, targets: list, restores: int) -> dict:
    """Restore `restores` times, cycling over `targets`: the refusals, the restore's time (its own
    check included) and a second check's alone."""
    from bd_train import CheckpointCorrupted, Checkpointer, damaged_shards, shard_digests

    saved = shard_digests(_leaves(targets[0]))
    refused, check_s, restore_s = [], [], []
    with Checkpointer(directory, create=False) as checkpoints:
        for i in range(restores):
            t = time.perf_counter()
            try:
                restored = checkpoints.restore(targets[i % len(targets)])
            except CheckpointCorrupted as err:
                refused.append(str(err))
                continue
            restore_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            damaged = damaged_shards(_leaves(restored), saved)
            check_s.append(time.perf_counter() - t)
            if damaged:
                refused.append(f"a second check named {damaged}")
    return {"restores": restores, "refused": len(refused), "first_refusal": refused[0] if refused else None,
            "restore_s": statistics.median(restore_s), "check_s": statistics.median(check_s)}


def worker(coordinator: str, index: int, directory: Path, restores: int) -> None:
    from bd_models import make_mesh
    from bd_train import Checkpointer
    from bd_train.distributed import ProcessGroup, initialize, shutdown

    initialize(ProcessGroup(coordinator, 2, index), cpu_devices=4)
    state = _state(make_mesh(2, 2, 2))
    with Checkpointer(directory / "checkpoints", max_to_keep=1) as checkpoints:  # every process saves its shards
        checkpoints.save(state, force=True)
        checkpoints.wait()
    results = _loop(directory / "checkpoints", [state], restores)
    (directory / f"group-{index}.json").write_text(json.dumps(results))
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--restores", type=int, default=2000, help="restores in one process (the group makes half)")
    args = parser.parse_args()
    from _report import machine, write_results, write_section

    from bd_models import make_mesh
    from bd_train.distributed import free_port

    directory = Path(tempfile.mkdtemp(prefix="restore-stress-"))
    env = {**os.environ, "XLA_FLAGS": " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                               if "device_count" not in f), "JAX_PLATFORMS": "cpu"}
    coordinator = f"127.0.0.1:{free_port()}"
    group = args.restores // 2
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", coordinator, str(i), str(directory), str(group)],
                              env=env) for i in range(2)]
    for proc in procs:
        if proc.wait(timeout=3600) != 0:
            raise SystemExit(f"a group process failed (exit {proc.returncode})")
    by_process = [json.loads((directory / f"group-{i}.json").read_text()) for i in range(2)]
    layouts = {"the saved mesh (2,2,2)": make_mesh(2, 2, 2), "mesh (1,4,2)": make_mesh(1, 4, 2),
               "mesh (4,1,2)": make_mesh(4, 1, 2), "one device": None}
    one = _loop(directory / "checkpoints", [_state(mesh) for mesh in layouts.values()], args.restores)
    results = {"one_process": one, "group": by_process, "machine": machine()}
    write_results("restore_stress", results)
    total = one["restores"] + sum(p["restores"] for p in by_process)
    refused = one["refused"] + sum(p["refused"] for p in by_process)
    body = f"""## Clean restores are never refused (`bench/restore_stress.py`)

One clean checkpoint of a small train state (model and Adam moments, {len(layouts)} layouts), written by a
2-process group, restored {total} times with the digest check threaded as in production
({machine()}):

| restored by | restores | refused | median restore (s) | median check alone (s) |
|---|---|---|---|---|
| one process, 8 devices, cycling {", ".join(layouts)} | {one["restores"]} | {one["refused"]} | \
{one["restore_s"]:.3f} | {one["check_s"]:.4f} |
""" + "".join(f"| the group, process {i} (4 devices each) | {p['restores']} | {p['refused']} | {p['restore_s']:.3f} | "
              f"{p['check_s']:.4f} |\n" for i, p in enumerate(by_process)) + f"""
{refused} of {total} refused. Each shard is read to the host on the calling thread and only hashed
on the thread pool: when the pool's threads read shards themselves, two reading one shard at once
could be handed its bytes before the copy had landed, and about one restore in 400 refused a clean
checkpoint."""
    write_section("restore_stress", body)
    print(body)
    if refused:
        raise SystemExit(f"{refused} clean restores refused")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _, _, coordinator, index, directory, restores = sys.argv
        worker(coordinator, int(index), Path(directory), int(restores))
    else:
        main()
