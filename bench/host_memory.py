"""What `bd_core.reuse_host_memory()` buys: the headline train step with glibc's default malloc
against the same step with freed host memory reused, each in its own process (the setting applies
to threads that have not allocated yet, so it cannot be switched inside one process).

Each child times 10 steps after 2 warm-up steps and counts the minor page faults and kernel CPU time
they cost (`getrusage`). Each setting runs twice, interleaved; the table shows each setting's
faster run. Writes bench/results/host_memory.json and its BENCHMARKS.md section.

    python bench/host_memory.py            # the study (parent)
    python bench/host_memory.py --child    # one measurement, JSON on stdout
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import optax
from _report import write_results, write_section
from train_step import HEADLINE, make_step, sft_batch

from bd_core import reuse_host_memory
from bd_core._host_memory import ENV_SWITCH
from bd_models import BlockDiffusionLM

STEPS, WARMUP, REPEATS = 10, 2, 2


def child() -> dict[str, float]:
    """The headline step's median seconds, and page faults and kernel seconds per step."""
    layout, targets, weights = sft_batch(HEADLINE, 8, 256)
    model = BlockDiffusionLM(HEADLINE, key=jax.random.key(0))
    optimizer = optax.adamw(3e-4, weight_decay=0.01)
    step = make_step(optimizer)
    args = (model, optimizer.init(model), layout, targets, weights)  # pyright: ignore[reportArgumentType]
    for _ in range(WARMUP):
        args = jax.block_until_ready(step(*args))
    before, times = resource.getrusage(resource.RUSAGE_SELF), []
    for _ in range(STEPS):
        start = time.perf_counter()
        args = jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"step_s": statistics.median(times), "faults_per_step": (after.ru_minflt - before.ru_minflt) / STEPS,
            "kernel_s_per_step": (after.ru_stime - before.ru_stime) / STEPS,
            "user_s_per_step": (after.ru_utime - before.ru_utime) / STEPS,
            "max_rss_mib": after.ru_maxrss / 1024, "applied": float(reuse_host_memory())}


def measure(reuse: bool) -> dict[str, float]:
    env = {**os.environ, ENV_SWITCH: "1" if reuse else "0"}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child"], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(REPEATS):
        for reuse in (False, True):
            runs[reuse].append(measure(reuse))
    best = {reuse: min(r, key=lambda m: m["step_s"]) for reuse, r in runs.items()}
    default, reused = best[False], best[True]
    assert reused["applied"] and not default["applied"], "the host allocator setting was not applied as asked"
    results = {f"{name}_{key}": value for name, m in (("default", default), ("reuse", reused))
               for key, value in m.items()}
    results["speedup"] = default["step_s"] / reused["step_s"]
    print(f"default {default['step_s']:.3f} s/step, reused {reused['step_s']:.3f} s/step: {results['speedup']:.2f}x")
    rows = [
        "The headline train step (vocab 260, d 256, 4 layers, batch 8, T = 512, float32, AdamW) in a process "
        "with glibc's default malloc and in one that calls `bd_core.reuse_host_memory()` first (every pipeline "
        "step, `bd_train.evaluate` and every benchmark here do); median of "
        f"{STEPS} steps after {WARMUP} warm-up steps, each setting run {REPEATS} times in fresh processes "
        "(interleaved), the faster run shown. XLA:CPU allocates each step's temporaries as one block, which "
        "glibc maps fresh and unmaps after every step when left to its defaults.",
        "",
        "| host malloc | step time | minor page faults per step | kernel CPU per step | user CPU per step | "
        "peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in (("glibc defaults", default), ("`reuse_host_memory()`", reused)):
        rows.append(f"| {name} | {m['step_s']:.3f} s | {m['faults_per_step']:,.0f} | {m['kernel_s_per_step']:.3f} s | "
                    f"{m['user_s_per_step']:.3f} s | {m['max_rss_mib']:,.0f} MiB |")
    rows += ["", f"Reusing freed memory makes the step **{results['speedup']:.2f}x** as fast."]
    write_results("host_memory", results)
    write_section("host_memory", "## Host memory reuse (`bench/host_memory.py`)\n\n" + "\n".join(rows))


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(child()))
    else:
        main()
