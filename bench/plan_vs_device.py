"""A plan against a device that runs it: one program of a preset's stage, built by `bd_train.plan`'s
own program builder for the accelerator this host has (one device), compiled, and read as a plan
reads a TPU program (arguments + outputs - aliased + temporaries + code, from XLA's memory
analysis); then run on arrays of those shapes, its peak measured by the device's allocator and its
time by the wall clock, its MFU against the bfloat16 matmul peak measured in the same process.

    python bench/plan_vs_device.py sdar_1p7b --stage sft-student [--program "train step"]
    python bench/plan_vs_device.py bench/configs/sdar_1p7b_lora_1chip.toml --stage grpo \
        --program "rollouts: one denoising step" [--inputs compiled]

The inputs have the program's shapes, dtypes and placement, not a real run's values: floats are
small positive random numbers (Adam's second moments must not be negative), integers 0, masks true;
each float input is made op by op, or with `--inputs compiled` by one compiled program (no float32
intermediates beside it: a row of its own). Memory and time do not depend on the values (zeros would
flatter the matmul units' power draw, hence random), except a sampler's number of steps: such
weights are never confident, so a threshold rule commits one token per step, the most steps a
rollout can take (the plan's bound). Sampler programs also report what they decoded: tokens
committed and steps taken, so tokens per second. On a TPU the rollouts' denoising step (its own cost
twin: no loop) is also read as the plan reads it, XLA's FLOPs and bytes accessed on this chip
against its published peak and HBM bandwidth: the roofline time and tokens per second beside the
measured ones. One program per process: the allocator's peak is the process's. Each run merges its
figures into `bench/results/plan_vs_device.json` under `<preset>/<stage>/<program>/<attention>`; `--table`
writes BENCHMARKS.md's section from that file.
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
from _report import ROOT, device_machine, reserved_bytes, results_path, write_results, write_section  # noqa: E402

GiB = 1 << 30


def _small_positive(key, shape, dtype):
    import jax
    import jax.numpy as jnp

    return (0.02 * jnp.abs(jax.random.normal(key, shape, jnp.float32))).astype(dtype)


def _inputs(lowered, compiled, made: str = "ops"):
    """Arrays for `compiled`'s positional inputs (a tuple), placed as it expects them. `made`:
    "ops", op by op (each float leaf's float32 intermediates in flight under asynchronous
    dispatch), or "compiled", each leaf by one compiled program (no intermediates beside it)."""
    import jax
    import jax.numpy as jnp

    infos, _ = lowered.args_info  # one entry per positional argument (a donating step has two)
    shardings, _ = compiled.input_shardings
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(infos))))

    def make(info, sharding):
        dtype = info.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            value = jax.random.split(next(keys), info.shape) if info.shape else next(keys)
        elif jnp.issubdtype(dtype, jnp.floating) and made == "compiled":
            return jax.jit(_small_positive, static_argnums=(1, 2), out_shardings=sharding)(
                next(keys), info.shape, dtype)
        elif jnp.issubdtype(dtype, jnp.floating):
            value = _small_positive(next(keys), info.shape, dtype)
        elif dtype == jnp.bool_:
            value = jnp.ones(info.shape, dtype)
        else:
            value = jnp.zeros(info.shape, dtype)
        return jax.device_put(value, sharding)

    return jax.tree.map(make, infos, shardings)


def _preset_path(preset: str) -> Path:
    """A preset's name (flows/configs/<name>.toml) or a TOML file's path."""
    return Path(preset) if preset.endswith(".toml") else ROOT / "flows" / "configs" / f"{preset}.toml"


def _decoded(output) -> dict:
    """Tokens committed and denoising steps taken (the loop runs while any row is active: the most
    any row took) by a sampler program's output, read from its trace."""
    from bd_core import DiffusionTrace

    traces = [x for x in _leaves(output) if isinstance(x, DiffusionTrace)]
    if not traces:
        return {}
    trace = traces[0]
    return {"tokens_committed": int(trace.committed.sum()), "steps_taken": int(trace.step_valid.sum(axis=1).max()),
            "rows": int(trace.step_valid.shape[0])}


def _leaves(tree):
    import jax

    from bd_core import DiffusionTrace

    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, DiffusionTrace))


def _roofline(compiled, rollout: dict, chip) -> dict:
    """XLA's count of the compiled denoising step on this chip against the chip's published peak
    and bandwidth (`bd_train.plan.device_chip`), as a plan reads it."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    bandwidth, compute = accessed / chip.hbm_bandwidth, flops / chip.peak_flops
    return {"xla_flops": flops, "xla_bytes_accessed": accessed, "roofline_s": max(bandwidth, compute),
            "bound": "bandwidth" if bandwidth >= compute else "compute", "chip_peak_tflops": chip.peak_flops / 1e12,
            "chip_hbm_gbps": chip.hbm_bandwidth / 1e9, "tokens_per_step": rollout["tokens_per_step"],
            "rollout_steps": rollout["steps"]}


def measure(preset: str, stage: str, program: str, runs: int, attention: str | None = None, *,
            peak_n: int = 8192, inputs: str = "ops") -> dict:
    import jax
    from accelerator import bf16_peak

    from bd_models import ModelConfig, make_mesh
    from bd_train.plan import device_chip, stage_lowered

    data = tomllib.loads(_preset_path(preset).read_text())
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
        earlier = device.memory_stats() or {}  # CPU keeps no statistics
        before, earlier_peak = earlier.get("bytes_in_use", 0), earlier.get("peak_bytes_in_use", 0)
        # fresh inputs for every run: a train step donates its state's buffers
        output = jax.block_until_ready(compiled(*_inputs(target.lowered, compiled, inputs)))  # allocations settle
        decoded = _decoded(output)
        del output
        seconds = []
        for _ in range(runs):
            args = jax.block_until_ready(_inputs(target.lowered, compiled, inputs))
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            seconds.append(time.perf_counter() - start)
            del args  # before the next run's are made: one set live at a time, as in a run
        stats = device.memory_stats() or {}
    step = statistics.median(seconds)
    peak = bf16_peak(peak_n)
    result = {
        "device": f"{device.platform}: {device.device_kind}", "jax": jax.__version__,
        "machine": device_machine(device),
        "attention": data.get(role, {}).get("attention", ModelConfig.attention), "inputs": inputs,
        "planned_bytes": int(planned), "argument_bytes": int(m.argument_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes),
        "measured_peak_bytes": stats["peak_bytes_in_use"] - before if stats else None,
        # the process's peak before the runs (building and compiling the program): where the runs
        # never rose above it, the program's own peak is only bounded by it
        "earlier_peak_bytes": earlier_peak - before if stats else None,
        "bytes_limit": stats.get("bytes_limit"),
        "memory_stats": dict(stats),  # every key the runtime keeps (a TPU's reserved bytes, say), for later reading
        "compile_s": compile_s, "step_s": step, "step_s_all": seconds, "model_flops": target.model_flops or 0.0,
        "bf16_peak_tflops": peak / 1e12, "peak_n": peak_n,
    }
    result["mfu"] = result["model_flops"] / step / peak if result["model_flops"] else 0.0
    if decoded and not getattr(target, "rollout", None):  # a whole sampler call, not one step of its loop
        result.update(decoded, tokens_per_s=decoded["tokens_committed"] / step,
                      s_per_denoising_step=step / decoded["steps_taken"])
    if getattr(target, "rollout", None) and (chip := device_chip(device)) is not None:
        result.update(_roofline(compiled, target.rollout, chip))
        result["tokens_per_s"] = result["tokens_per_step"] / step
        result["roofline_tokens_per_s"] = result["tokens_per_step"] / result["roofline_s"]
    return result


def table(results: dict) -> str:
    lines = ["| preset | stage | program | attention | planned peak | measured peak | measured - planned | "
             "reserved peak | time | MFU (bf16) |", "|---|---|---|---|---|---|---|---|---|---|"]
    stages = ["sft-teacher", "sft-student", "opd", "grpo"]
    for key in sorted(results, key=lambda k: (k.split("/")[0], stages.index(k.split("/")[1]), k.split("/")[2:])):
        r, (preset, stage, program, attention) = results[key], key.split("/")
        mfu = f"{r['mfu']:.1%}" if r["mfu"] else ""
        measured = r["measured_peak_bytes"]
        over = "≤ " if r.get("peak_two_input_sets") else ""
        seen = (f"{over}{measured / GiB:.3f} GiB | {over}{(measured - r['planned_bytes']) / 2**20:+.0f} MiB"
                if measured is not None else "not kept by this device | ")
        reserved = reserved_bytes(r)
        time_ = f"{r['step_s'] * 1e3:.1f} ms" if r["step_s"] < 0.1 else f"{r['step_s']:.3f} s"
        lines.append(f"| {preset} | {stage} | {program} | `{attention}` | {r['planned_bytes'] / GiB:.3f} GiB | "
                     f"{seen} | {'' if reserved is None else f'{reserved / GiB:.3f} GiB'} | {time_} | {mfu} |")
    return "\n".join(lines)


STAGE_NAMES = {"sft-teacher": "the teacher's SFT", "sft-student": "the student's SFT", "opd": "OPD", "grpo": "GRPO"}


def tpu_note(rows: dict) -> str:
    """What the TPU's allocator statistics count, from the rows whose inputs one program made."""
    made = {k: (r, v) for k, r in rows.items() if r.get("inputs") == "compiled" and (v := reserved_bytes(r))}
    if not made:
        return ""
    gib = lambda values: ", ".join(f"{v / GiB:.2f}" for v in values)  # noqa: E731
    in_use = [r["measured_peak_bytes"] for r, _ in made.values()]
    reserved = [v for _, v in made.values()]
    below_temp = [(r["temp_bytes"] - v) / GiB for r, v in made.values()]
    below_plan = [(r["planned_bytes"] - i - v) / GiB for (r, v), i in zip(made.values(), in_use)]
    names = ", ".join(str(STAGE_NAMES.get(key.split("/")[1], key.split("/")[1])) for key in made)
    return ("\n\nOn this TPU runtime a program's temporaries are not in the allocator's bytes in use: the runtime "
            f"reserves them apart (`peak_bytes_reserved`, the reserved peak column). With each input made by one "
            f"compiled program (`--inputs compiled`), the train steps' measured peak ({names}) held their arguments "
            f"({gib(in_use)} GiB against XLA's {gib(r['argument_bytes'] for r, _ in made.values())}), and the reserved "
            f"peak ({gib(reserved)} GiB) was {min(below_temp):.2f}-{max(below_temp):.2f} GiB below XLA's "
            f"temporaries ({gib(r['temp_bytes'] for r, _ in made.values())}): in use plus reserved came "
            f"{min(below_plan):.2f}-{max(below_plan):.2f} GiB below the plan. The rows whose inputs were made op by "
            "op measure the making of the inputs (float32 intermediates that asynchronous dispatch piles up) more "
            "than the program; `earlier_peak_bytes` in the results says whether the runs rose above the process's "
            "peak before them. Rows without a reserved peak were measured before the statistics were kept. On the "
            "H200 measured and planned agree within 1 MB.")


def rollout_lines(results: dict) -> list[str]:
    """The denoising steps measured against the plan's roofline reading of them."""
    out = []
    for key, r in sorted(results.items()):
        if "roofline_s" not in r:
            continue
        out.append(f"- `{key.split('/')[0]}` {key.split('/')[1]}, {key.split('/')[2]} ({r['tokens_per_step']:.0f} "
                   f"tokens committed per step, {r['rollout_steps']} steps per rollout batch): measured "
                   f"{r['step_s'] * 1e3:.1f} ms per step, {r['tokens_per_s']:,.0f} tokens/s on the chip; the plan's "
                   f"roofline reading, from XLA's count on this chip ({r['xla_flops'] / 1e12:.2f} TFLOP, "
                   f"{r['xla_bytes_accessed'] / 1e9:.1f} GB accessed against {r['chip_hbm_gbps']:.0f} GB/s and "
                   f"{r['chip_peak_tflops']:.0f} TFLOP/s: {r['bound']}-bound), {r['roofline_s'] * 1e3:.1f} ms and "
                   f"{r['roofline_tokens_per_s']:,.0f} tokens/s: {r['roofline_s'] / r['step_s']:.2f}x slower than "
                   f"measured. The program's arguments (weights and the KV cache) are "
                   f"{r['argument_bytes'] / 1e9:.2f} GB, read once per step at the chip's bandwidth in "
                   f"{r['argument_bytes'] / r['chip_hbm_gbps'] / 1e6:.1f} ms.")
    return out


SECTIONS = {"gpu": "plan_vs_device", "tpu": "plan_vs_device_tpu", "cpu": "plan_vs_device_cpu"}
def _write_table(results: dict, markdown: Path | None = None) -> None:
    by_platform: dict[str, dict] = {}
    for key, r in results.items():
        by_platform.setdefault(r["device"].split(":")[0], {})[key] = r
    for platform, rows in by_platform.items():
        first = next(iter(rows.values()))
        peaks = sorted(r["bf16_peak_tflops"] for r in rows.values())
        notes = rollout_lines(rows)
        caveat = ("\n\n≤: measured while the next run's inputs were made before the last run's were freed: the "
                  "program's inputs that it does not donate were live twice, so the peak is an upper bound (the "
                  "script now frees them first)." if any(r.get("peak_two_input_sets") for r in rows.values()) else "")
        write_section(SECTIONS[platform],
                      f"## The plan against a device: {first['device']} (`bench/plan_vs_device.py`)\n\n"
                      f"Device: {first['device']}, jax {first['jax']}. Each program built by `bd_train.plan`'s program "
                      "builder for one device, compiled, and read as a TPU plan reads it (planned peak: arguments + "
                      "outputs - aliased + temporaries + code, XLA's memory analysis); then run on inputs of its "
                      "shapes: measured peak is the allocator's peak in use during the runs, less what was in use "
                      "before the inputs were made; reserved peak a TPU runtime's peak of the bytes it reserves "
                      "for programs (the process's, blank where not kept); time the median of the runs after the "
                      "first; MFU the model's matmul FLOPs (3 x forward, 2 x under LoRA: the frozen weights get no "
                      "gradient) per second over "
                      f"the best bfloat16 {first['peak_n']}³ product in the same process ({peaks[0]:.0f} to "
                      f"{peaks[-1]:.0f} TFLOP/s).\n\n" + table(rows) + caveat
                      + (tpu_note(rows) if platform == "tpu" else "")
                      + ("\n\nRollouts:\n\n" + "\n".join(notes) if notes else ""),
                      **({} if markdown is None else {"markdown": markdown}), measured_on=first.get("machine"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("preset", nargs="?", default="sdar_1p7b",
                        help="a flows/configs/<preset>.toml by name, or a TOML file's path")
    parser.add_argument("--stage", default="sft-student", choices=["sft-teacher", "sft-student", "opd", "grpo"])
    parser.add_argument("--program", default="train step")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--attention", help="replace both models' attention (blocked, dense, pallas, ...)")
    parser.add_argument("--inputs", choices=("ops", "compiled"), default="ops",
                        help="make each float input op by op (the table's rows) or by one compiled program")
    parser.add_argument("--table", action="store_true", help="only write BENCHMARKS.md's section from the results")
    args = parser.parse_args(argv)
    path = results_path("plan_vs_device")
    if not args.table:
        result = measure(args.preset, args.stage, args.program, args.runs, args.attention, inputs=args.inputs)
        print(json.dumps(result, indent=1))
        if result["device"].startswith("cpu"):  # a CPU's run checks the script: no result to keep
            return
        results = json.loads(path.read_text()) if path.exists() else {}
        made = "" if args.inputs == "ops" else f", {args.inputs} inputs"  # a row of its own
        key = f"{Path(args.preset).stem}/{args.stage}/{args.program}/{result['attention']}{made}"
        write_results("plan_vs_device", {**results, key: result})
    if path.exists():
        _write_table(json.loads(path.read_text()))


if __name__ == "__main__":
    main()
