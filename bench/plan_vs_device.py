"""A plan against a device that runs it: one program of a preset's stage, built by `bd_train.plan`'s
own program builder for the accelerator this host has (one device), compiled, and read as a plan
reads a TPU program (arguments + outputs - aliased + temporaries + code, from XLA's memory
analysis); then run on arrays of those shapes, its peak measured by the device's allocator and its
time by the wall clock, its MFU against the bfloat16 matmul peak measured in the same process.

    python bench/plan_vs_device.py sdar_1p7b --stage sft-student [--program "train step"]

The inputs have the program's shapes, dtypes and placement, not a real run's values: floats are
small positive random numbers (Adam's second moments must not be negative), integers 0, masks
true. Memory and time do not depend on the values (zeros would flatter the matmul units' power
draw, hence random). One program per process: the allocator's peak is the process's. Each run
merges its figures into `bench/results/plan_vs_device.json` under `<preset>/<stage>/<program>`;
`--table` writes BENCHMARKS.md's section from that file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, machine, results_path, write_results, write_section  # noqa: E402

GiB = 1 << 30


def _inputs(lowered, compiled):
    """Arrays for `compiled`'s positional inputs (a tuple), placed as it expects them."""
    import jax
    import jax.numpy as jnp

    infos, _ = lowered.args_info  # one entry per positional argument (a donating step has two)
    shardings, _ = compiled.input_shardings
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(infos))))

    def make(info, sharding):
        dtype = info.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            value = jax.random.split(next(keys), info.shape) if info.shape else next(keys)
        elif jnp.issubdtype(dtype, jnp.floating):
            value = (0.02 * jnp.abs(jax.random.normal(next(keys), info.shape, jnp.float32))).astype(dtype)
        elif dtype == jnp.bool_:
            value = jnp.ones(info.shape, dtype)
        else:
            value = jnp.zeros(info.shape, dtype)
        return jax.device_put(value, sharding)

    return jax.tree.map(make, infos, shardings)


def measure(preset: str, stage: str, program: str, runs: int, attention: str | None = None, *,
            peak_n: int = 8192) -> dict:
    import jax
    from accelerator import bf16_peak

    from bd_models import ModelConfig, make_mesh
    from bd_train.plan import stage_lowered

    data = tomllib.loads((ROOT / "flows" / "configs" / f"{preset}.toml").read_text())
    for role in ("teacher", "student") if attention else ():
        data.setdefault(role, {})["attention"] = attention
    role = "teacher" if stage == "sft-teacher" else "student"
    device = jax.devices()[0]
    mesh = make_mesh(1, 1, 1, devices=[device])
    with jax.set_mesh(mesh):
        found = [p for p in stage_lowered(data, stage, mesh) if p.program == program]
        if not found:
            raise SystemExit(f"{preset} {stage} has no program {program!r}")
        target = found[0]
        start = time.perf_counter()
        compiled = target.lowered.compile()
        compile_s = time.perf_counter() - start
        m = compiled.memory_analysis()
        planned = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
                   + m.generated_code_size_in_bytes)
        before = (device.memory_stats() or {}).get("bytes_in_use", 0)  # CPU keeps no statistics
        # fresh inputs for every run: a train step donates its state's buffers
        jax.block_until_ready(compiled(*_inputs(target.lowered, compiled)))  # the first run: allocations settle
        seconds = []
        for _ in range(runs):
            inputs = jax.block_until_ready(_inputs(target.lowered, compiled))
            start = time.perf_counter()
            jax.block_until_ready(compiled(*inputs))
            seconds.append(time.perf_counter() - start)
        stats = device.memory_stats() or {}
    step = statistics.median(seconds)
    peak = bf16_peak(peak_n)
    result = {
        "device": f"{device.platform}: {device.device_kind}", "jax": jax.__version__, "machine": machine(),
        "attention": data.get(role, {}).get("attention", ModelConfig.attention),
        "planned_bytes": int(planned), "argument_bytes": int(m.argument_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes),
        "measured_peak_bytes": stats["peak_bytes_in_use"] - before if stats else None,
        "bytes_limit": stats.get("bytes_limit"),
        "compile_s": compile_s, "step_s": step, "step_s_all": seconds, "model_flops": target.model_flops or 0.0,
        "bf16_peak_tflops": peak / 1e12, "peak_n": peak_n,
    }
    result["mfu"] = result["model_flops"] / step / peak if result["model_flops"] else 0.0
    return result


def table(results: dict) -> str:
    lines = ["| preset | stage | program | attention | planned peak | measured peak | measured - planned | step time | "
             "MFU (bf16) |", "|---|---|---|---|---|---|---|---|---|"]
    stages = ["sft-teacher", "sft-student", "opd", "grpo"]
    for key in sorted(results, key=lambda k: (k.split("/")[0], stages.index(k.split("/")[1]), k.split("/")[2:])):
        r, (preset, stage, program, attention) = results[key], key.split("/")
        mfu = f"{r['mfu']:.1%}" if r["mfu"] else ""
        measured = r["measured_peak_bytes"]
        seen = (f"{measured / GiB:.3f} GiB | {(measured - r['planned_bytes']) / 2**20:+.2f} MiB" if measured is not None
                else "not kept by this device | ")
        lines.append(f"| {preset} | {stage} | {program} | `{attention}` | {r['planned_bytes'] / GiB:.3f} GiB | "
                     f"{seen} | {r['step_s']:.3f} s | {mfu} |")
    return "\n".join(lines)


def _write_table(results: dict, markdown: Path | None = None) -> None:
    first = next(iter(results.values()))
    peaks = sorted(r["bf16_peak_tflops"] for r in results.values())
    write_section("plan_vs_device", "## The plan against a device (`bench/plan_vs_device.py`)\n\n"
                  f"Device: {first['device']}, jax {first['jax']}. Each program built by `bd_train.plan`'s program "
                  "builder for one device, compiled, and read as a TPU plan reads it (planned peak: arguments + "
                  "outputs - aliased + temporaries + code, XLA's memory analysis); then run on inputs of its shapes: "
                  "measured peak is the allocator's peak in use during the runs, less what was in use before the "
                  "inputs were made; step time the median of the runs after the first; MFU the model's matmul "
                  f"FLOPs (3 x forward) per second over the best bfloat16 {first['peak_n']}³ product in the same "
                  f"process ({peaks[0]:.0f} to {peaks[-1]:.0f} TFLOP/s).\n\n" + table(results),
                  **({} if markdown is None else {"markdown": markdown}), measured_on=first.get("machine"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("preset", nargs="?", default="sdar_1p7b", help="a flows/configs/<preset>.toml")
    parser.add_argument("--stage", default="sft-student", choices=["sft-teacher", "sft-student", "opd", "grpo"])
    parser.add_argument("--program", default="train step")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--attention", help="replace both models' attention (blocked, dense, pallas, ...)")
    parser.add_argument("--table", action="store_true", help="only write BENCHMARKS.md's section from the results")
    args = parser.parse_args(argv)
    path = results_path("plan_vs_device")
    if not args.table:
        result = measure(args.preset, args.stage, args.program, args.runs, args.attention)
        print(json.dumps(result, indent=1))
        results = json.loads(path.read_text()) if path.exists() else {}
        key = f"{args.preset}/{args.stage}/{args.program}/{result['attention']}"
        write_results("plan_vs_device", {**results, key: result})
    if path.exists():
        _write_table(json.loads(path.read_text()))


if __name__ == "__main__":
    main()
