"""What an asynchronous checkpoint save spares the training loop: the train state of
`bench/checkpoint_digest.py` (a model over 1 GB, float32, Adam moments beside it, fsdp over 8
devices) saved by `bd_train.Checkpointer` with `async_save=False` and `True`. Timed: how long
`save` (+ `wait` when synchronous) keeps the caller, the time until the step is committed, and a
stand-in update (a fixed jitted matmul chain) while a save is in flight and while none is. Median
of 3 rounds. Writes bench/results/async_save.json and its BENCHMARKS.md section.

    python bench/async_save.py            # --small: a 20x smaller model, to try the script
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _report import write_results, write_section  # noqa: E402
from checkpoint_digest import CONFIG, _bytes  # noqa: E402

from bd_models import BlockDiffusionLM, init_sharded, make_mesh  # noqa: E402
from bd_train import Checkpointer, OptimizerConfig, Trainer, make_optimizer, sft_objective  # noqa: E402

ROUNDS = 3


@jax.jit
def _update(x):
    """The stand-in for a train step: a fixed amount of compute on every core."""
    for _ in range(4):
        x = jnp.tanh(x @ x) * 0.5
    return x


def _step_seconds(x) -> float:
    t = time.perf_counter()
    _update(x).block_until_ready()
    return time.perf_counter() - t


def main(small: bool) -> None:
    config = dataclasses.replace(CONFIG, d_model=512, d_ff=1408, n_heads=4, n_kv_heads=2) if small else CONFIG
    mesh = make_mesh(1, 8, 1)
    model = init_sharded(lambda: BlockDiffusionLM(config, key=jax.random.key(0)), mesh)
    state = Trainer(sft_objective, make_optimizer(OptimizerConfig())).init(model, key=jax.random.key(1))
    model_gb, state_gb = _bytes(state.model) / 1e9, _bytes((state.model, state.opt_state)) / 1e9
    x = jnp.full((768, 768), 0.01, jnp.float32)
    _update(x).block_until_ready()
    quiet = [_step_seconds(x) for _ in range(10)]
    times: dict[str, list[float]] = {"sync_blocking": [], "async_blocking": [], "async_commit": []}
    in_flight: list[float] = []
    for _ in range(ROUNDS):
        for mode in ("sync", "async"):
            folder = Path(tempfile.mkdtemp(prefix="async-bench-"))
            try:
                with Checkpointer(folder, async_save=mode == "async") as checkpoints:
                    t = time.perf_counter()
                    checkpoints.save(state)
                    if mode == "sync":
                        checkpoints.wait()
                    times[f"{mode}_blocking"].append(time.perf_counter() - t)
                    if mode == "async":
                        while not (folder / "0").is_dir():  # the loop goes on until the step is committed
                            in_flight.append(_step_seconds(x))
                        times["async_commit"].append(time.perf_counter() - t)
                        checkpoints.wait()
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        quiet += [_step_seconds(x) for _ in range(5)]
    median = {k: statistics.median(v) for k, v in times.items()}
    step_quiet, step_busy = statistics.median(quiet), statistics.median(in_flight or [float("nan")])
    results = {"model_gb": model_gb, "state_gb": state_gb, "small": small, **{f"{k}_s": v for k, v in median.items()},
               "blocking_ratio": median["async_blocking"] / median["sync_blocking"],
               "step_quiet_s": step_quiet, "step_in_flight_s": step_busy, "steps_in_flight": len(in_flight),
               "step_slowdown": step_busy / step_quiet}
    write_results("async_save", results)
    share = f"{median['async_blocking']:.2f} ({results['blocking_ratio']:.0%} of it)"
    busy = f"{step_busy:.3f} ({results['step_slowdown']:.2f}x, {len(in_flight)} updates)"
    slower = median["async_commit"] / median["sync_blocking"]
    body = f"""## Asynchronous checkpoint saves (`bench/async_save.py`)

The state of the digest benchmark: a {model_gb:.2f} GB model ({state_gb:.2f} GB with its Adam
moments), float32, fsdp over 8 CPU devices; `Checkpointer(async_save=...)`. Median of {ROUNDS}
rounds{" (--small)" if small else ""}.

| | seconds |
|---|---|
| synchronous save: training stopped (`save` + `wait`) | {median["sync_blocking"]:.2f} |
| asynchronous save: training stopped (`save` returns) | {share} |
| asynchronous save: until the step is committed | {median["async_commit"]:.2f} |
| a stand-in update (jitted matmuls), no save in flight | {step_quiet:.3f} |
| the same update while a save is written and digested | {busy} |

What still stops training: the wait for the previous save, a host view of every shard (a copy
on an accelerator; on CPU a reference that keeps the buffer), the metadata and Orbax's own
start. The rest (the writes, the SHA-256 digests, the rename that commits the step) runs on
background threads, which here share the host's cores with the update (so the commit takes
{slower:.1f}x the synchronous save, the loop running beside it); on an accelerator
the update does not compete for them."""
    write_section("async_save", body)
    print(body)


if __name__ == "__main__":
    main("--small" in sys.argv[1:])
