"""What malloc on transparent huge pages buys (`bd_core.with_huge_page_malloc`): the headline train
step under glibc's default malloc against the same step with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`,
each in its own process (glibc reads tunables when a process starts).

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

from bd_core import huge_page_malloc_active, thp_mode, tunable_takes_effect, with_huge_page_malloc
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
            "max_rss_mib": after.ru_maxrss / 1024, "huge_pages": float(huge_page_malloc_active())}


def measure(huge: bool) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if huge:
        with_huge_page_malloc(env)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child"], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    if not tunable_takes_effect():
        raise SystemExit(f"host_memory: glibc.malloc.hugetlb=1 changes nothing here (glibc < 2.35, not glibc, or the "
                         f"kernel's THP mode is {thp_mode() or 'unknown'!r}, not 'madvise'); nothing to measure")
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(REPEATS):
        for huge in (False, True):
            runs[huge].append(measure(huge))
    best = {huge: min(r, key=lambda m: m["step_s"]) for huge, r in runs.items()}
    default, huge = best[False], best[True]
    assert huge["huge_pages"] and not default["huge_pages"], "a child did not start with the malloc asked for"
    results = {f"{name}_{key}": value for name, m in (("default", default), ("huge", huge)) for key, value in m.items()}
    results["speedup"] = default["step_s"] / huge["step_s"]
    print(f"default {default['step_s']:.3f} s/step, huge pages {huge['step_s']:.3f} s/step: {results['speedup']:.2f}x")
    rows = [
        "The headline train step (vocab 260, d 256, 4 layers, batch 8, T = 512, float32, AdamW) in a process "
        "with glibc's default malloc and in one started with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (as "
        "`make run`, `make test`, `make bench` and every local step of the pipeline's flow are); median of "
        f"{STEPS} steps after {WARMUP} warm-up steps, each setting run {REPEATS} times in fresh processes "
        "(interleaved), the faster run shown. XLA:CPU allocates each step's temporaries as one block, which "
        "glibc maps fresh and unmaps after every step; the kernel faults it in 4 KiB at a time, or 2 MiB at a "
        "time when malloc asks for transparent huge pages.",
        "",
        "| host malloc | step time | minor page faults per step | kernel CPU per step | user CPU per step | "
        "peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in (("glibc defaults", default), ("`glibc.malloc.hugetlb=1`", huge)):
        rows.append(f"| {name} | {m['step_s']:.3f} s | {m['faults_per_step']:,.0f} | {m['kernel_s_per_step']:.3f} s | "
                    f"{m['user_s_per_step']:.3f} s | {m['max_rss_mib']:,.0f} MiB |")
    rows += ["", f"Huge pages make the step **{results['speedup']:.2f}x** as fast, at "
             f"{huge['max_rss_mib'] / default['max_rss_mib']:.2f}x the default's peak RSS."]
    write_results("host_memory", results)
    write_section("host_memory", "## Malloc on huge pages (`bench/host_memory.py`)\n\n" + "\n".join(rows))


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(child()))
    else:
        main()
