"""SCALING.md's compiled plans: the SDAR presets (full fine-tuning and LoRA) planned for TPU slices
with `bd_train.plan` — every stage's programs compiled for the slice from this host — into one
table of per-chip HBM by stage, the train steps' estimated time and MFU, and the change a stage
needs where it does not fit. Needs libtpu: `make bench` runs it with `.plan/bin/python`.

    .plan/bin/python bench/plan_presets.py [--only sdar_1p7b] [--topologies v5e:2x4 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, results_path, write_results, write_section  # noqa: E402

PRESETS = ("sdar_1p7b", "sdar_1p7b_lora", "sdar_8b", "sdar_8b_lora")
# (topology, mesh): one v5e-8 host, one v6e-8 host, and a v5p-16 slice of 4 hosts with data parallel
# over 2 groups of 8 chips.
TOPOLOGIES = {"v5e:2x4": "fsdp=8", "v6e:2x4": "fsdp=8", "v5p:2x2x4": "data=2,fsdp=8"}
GiB = 1 << 30
# The attention implementations compared on one TPU program: SDAR-1.7B's GRPO stage (its train step
# reads the packed replay, whose views' blocks differ per row), on a v5e-8 and on the v5p-16 (whose
# cost model, unlike v5e's, gives a time).
COMPARE = ("sdar_1p7b", "grpo")
COMPARE_ON = ("v5e:2x4", "v5p:2x2x4")
ATTENTIONS = ("blocked", "dense", "splash")


MEMO: dict[str, dict] = {}  # programs compiled for a slice, by their StableHLO: the presets share a teacher


def preset_data(preset: str) -> dict:
    return tomllib.loads((ROOT / "flows" / "configs" / f"{preset}.toml").read_text())


def run_one(preset: str, topology: str, mesh: str, **options) -> dict:
    from bd_train.plan import _mesh_arg, plan

    data = preset_data(preset)
    start = time.perf_counter()
    result = plan(data, topology, name=f"{preset}.toml", mesh=_mesh_arg(mesh), cost="train step",
                  log=lambda line: print(line, file=sys.stderr, flush=True), memo=MEMO, **options)
    return {**result.to_json(), "seconds": time.perf_counter() - start}


def largest(preset: str, topology: str, stage: str, doublings: int) -> dict:
    """One stage's largest batch that fits (`bd_train.plan.largest_batch`), with its train step
    costed there: the setting, its value, the microbatch count, the stage's peak and the step."""
    from bd_train.plan import _mesh_arg, largest_batch

    data = preset_data(preset)
    return largest_batch(data, stage, topology, mesh=_mesh_arg(TOPOLOGIES[topology]), memo=MEMO,
                         doublings=doublings, cost="train step",
                         log=lambda line: print(line, file=sys.stderr, flush=True)).to_json()


def step_cell(step: dict | None, peak_flops: float) -> str:
    """A train step's est. s and est. MFU (≥ / ≤ where the time is the roofline bound)."""
    from bd_train.plan import ProgramPlan

    if step is None or step["flops"] is None:
        return "not costed (no unrolled twin compiled)"
    if not step["seconds"]:
        return "no estimate: XLA's cost analysis of its unrolled twin is empty"
    seconds, mfu = ProgramPlan.from_json(step).estimates(peak_flops, less="≤ ", more="≥ ")
    return f"{seconds} s, {mfu}"


def largest_cell(found: dict | None, peak_flops: float) -> str:
    if found is None:
        return ""
    if found["batch"] is None:
        return "none: not even one row per data-parallel chip per microbatch"
    size = f"{found['setting']} = {found['batch']}{' or more' if found['capped'] else ''}"
    return (f"{size} ({found['microbatches']} microbatches): peak {found['peak'] / GiB:.1f} GiB, "
            f"{step_cell(found['train_step'], peak_flops)}")


def configured_attention(preset: str) -> str:
    from bd_models import ModelConfig

    data = preset_data(preset)
    return data.get("student", {}).get("attention", ModelConfig.attention)


def compared(results: dict[str, dict], topology: str, attention: str) -> dict | None:
    """The compared stage's plan on `topology` with `attention`: its own, or for the preset's
    configured attention the preset's plan on that slice (the same programs)."""
    preset, _ = COMPARE
    own = results.get(f"{preset}@{topology}@{attention}")
    if own is None and attention == configured_attention(preset):
        return results.get(f"{preset}@{topology}")
    return own


def attention_table(results: dict[str, dict]) -> str:
    _, stage = COMPARE
    lines = [f"| slice | attention | {stage} train step: peak GiB per chip | temporaries GiB | TFLOP per chip | est. s "
             "| est. MFU |", "|---|---|---|---|---|---|---|"]
    for topology, attention in ((t, a) for t in COMPARE_ON for a in ATTENTIONS):
        result = compared(results, topology, attention)
        if result is None:
            continue
        stage_plan = next(s for s in result["stages"] if s["stage"] == stage)
        step = next(p for p in stage_plan["programs"] if p["program"] == "train step")
        if step.get("refused"):
            lines.append(f"| {topology} | `{attention}` | does not compile: {step['refused'][:120]} | | | | |")
            continue
        mfu = step["model_flops"] / (step["seconds"] * result["peak_flops"]) if step["seconds"] else 0
        roofline = step["seconds_from"] == "roofline"
        lines.append(f"| {topology} | `{attention}` | {step['peak'] / GiB:.2f} | {step['temp'] / GiB:.2f} | "
                     f"{step['flops'] / 1e12:.1f} | {'≥ ' if roofline else ''}{step['seconds']:.2f} | "
                     f"{'≤ ' if roofline else ''}{100 * mfu:.0f}% |")
    return "\n".join(lines)


def table(results: dict[str, dict]) -> str:
    """One row per stage of each plan; the largest-batch column only once a plan has it (`--largest-batch`)."""
    with_largest = any("largest_batch" in stage for result in results.values() for stage in result["stages"])
    lines = ["| preset | slice | stage | peak GiB per chip | fits | train step: est. s, est. MFU | "
             + ("largest batch that fits: peak, train step est. s, est. MFU | " if with_largest else "") + "command |",
             "|---|---|---|---|---|---|" + ("---|" if with_largest else "") + "---|"]
    for key, result in results.items():
        preset, topology = key.split("@")
        for stage in result["stages"]:
            step = next((p for p in stage["programs"] if p["program"] == "train step"), None)
            timing = step_cell(step, result["peak_flops"]) if step else ""
            verdict = "yes" if stage["fits"] else f"no: {stage['remedy']}"
            if stage.get("planned_with"):
                verdict += f" (with {stage['planned_with'].split(' (as configured')[0]}: the preset's rows per " \
                           "microbatch do not split over this slice's data-parallel chips)"
            largest_fit = largest_cell(stage.get("largest_batch"), result["peak_flops"])
            command = f"`make plan PRESET={preset} TOPOLOGY={topology} PLAN_ARGS=\"--mesh {TOPOLOGIES[topology]}\"`"
            lines.append(f"| {preset} | {topology} ({result['chips']} chips, {result['hosts']} host"
                         f"{'s' if result['hosts'] > 1 else ''}) | {stage['stage']} | {stage['peak'] / GiB:.1f} | "
                         f"{verdict} | {timing} | " + (f"{largest_fit} | " if with_largest else "") + f"{command} |")
    return "\n".join(lines)


def compiler() -> str:
    """What made the figures: TPU programs compiled on a CPU host do not depend on the host."""
    from importlib.metadata import version

    return f"no TPU: compiled by libtpu {version('libtpu')} (jax {version('jax')}) on a CPU host"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--only", nargs="+", default=list(PRESETS))
    parser.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES))
    parser.add_argument("--attentions", nargs="*", default=list(ATTENTIONS),
                        help=f"compare these on {COMPARE[0]}'s {COMPARE[1]} stage")
    parser.add_argument("--compare-on", nargs="*", default=list(COMPARE_ON), metavar="TOPOLOGY",
                        help="the slices of the attention comparison")
    parser.add_argument("--resume", action="store_true", help="keep the plans already in the results file")
    parser.add_argument("--largest-batch", nargs="*", default=[], metavar="TOPOLOGY",
                        help="find each stage's largest batch that fits on these slices, for the plans in the "
                             "results file that lack it")
    parser.add_argument("--doublings", type=int, default=3,
                        help="the largest-batch search tries up to the configured batch times 2^DOUBLINGS")
    parser.add_argument("--table", action="store_true", help="only write SCALING.md's table from the results file")
    args = parser.parse_args()
    path = results_path("plan_presets")

    def saved() -> dict[str, dict]:
        return json.loads(path.read_text()) if path.exists() else {}

    results = saved()

    def keep(key: str, plan: dict) -> None:
        """Each plan kept as soon as it is made, merged into the file as it is now: several
        processes may plan disjoint presets or slices at once."""
        results[key] = plan
        write_results("plan_presets", {**saved(), key: plan})

    if args.table:
        args.attentions, args.only = [], []
    preset, stage = COMPARE
    # The configured attention last: the preset's own plan on that slice, if made meanwhile, stands for it.
    for topology, attention in ((t, a) for t in args.compare_on for a in sorted(
            args.attentions, key=lambda a: a == configured_attention(preset))):
        key = f"{preset}@{topology}@{attention}"
        if args.resume and compared(saved(), topology,
                                    attention) is not None:
            continue
        print(f"== {preset} on {topology}, {stage} with attention {attention}", file=sys.stderr, flush=True)
        keep(key, run_one(preset, topology, TOPOLOGIES[topology], stage=stage, attention=attention, remedies=False))
    for preset in args.only:
        for topology in args.topologies:
            if args.resume and f"{preset}@{topology}" in results:
                continue
            print(f"== {preset} on {topology}", file=sys.stderr, flush=True)
            keep(f"{preset}@{topology}", run_one(preset, topology, TOPOLOGIES[topology]))
    for preset in args.only:
        for topology in args.largest_batch:
            key = f"{preset}@{topology}"
            if key not in results or all(isinstance(stage.get("largest_batch"), dict)
                                         for stage in results[key]["stages"]):
                continue
            print(f"== {preset} on {topology}: largest batches", file=sys.stderr, flush=True)
            plan = results[key]
            for stage in (s for s in plan["stages"] if not isinstance(s.get("largest_batch"), dict)):
                stage["largest_batch"] = largest(preset, topology, stage["stage"], args.doublings)
                keep(key, plan)
    results = saved()
    comparison = attention_table(results)
    results = {k: v for k, v in results.items() if k.count("@") == 1}
    ordered = {k: results[k] for k in sorted(results, key=lambda k: (PRESETS.index(k.split("@")[0]),
                                                                    list(TOPOLOGIES).index(k.split("@")[1])))}
    body = table(ordered)
    print(body)
    write_section("plan_presets", "### Compiled plans for SDAR on TPU slices (`bench/plan_presets.py`)\n\n"
                  "Every program of every stage compiled for the slice by XLA's TPU compiler on this CPU host "
                  "(`bd_train.plan`), from shapes: nothing ran on a TPU. Peak = arguments + outputs + temporaries "
                  "+ code of the stage's largest program, per chip; est. s is the compiler's cost model or, marked "
                  "≥, the roofline bound from its FLOPs and bytes; MFU counts the model's matmul FLOPs. The "
                  "presets' stages use the canvas of `flows/configs/sdar_*.toml` (64 prompt + 128 new tokens, "
                  "block 4).\n\n" + body + "\n\n**Attention on TPU.** The same program with each attention "
                  f"implementation (`--attention`): {COMPARE[0]}'s {COMPARE[1]} stage, on the slices and meshes "
                  "above. `splash` is TPU's splash kernels with each row's block-diffusion mask; "
                  "XLA's cost analysis cannot see into its kernels, so their FLOPs are added as dense attention's "
                  "(every query-key pair: an upper bound) and its time at the chip's peak. v5e's times are roofline "
                  "bounds (≥; its cost model gives none), v5p's the cost model's.\n\n" + comparison,
                  markdown=ROOT / "SCALING.md", measured_on=compiler())


if __name__ == "__main__":
    main()
