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


def run_one(preset: str, topology: str, mesh: str) -> dict:
    from bd_train.plan import _mesh_arg, plan

    data = tomllib.loads((ROOT / "flows" / "configs" / f"{preset}.toml").read_text())
    start = time.perf_counter()
    result = plan(data, topology, name=f"{preset}.toml", mesh=_mesh_arg(mesh),
                  log=lambda line: print(line, file=sys.stderr, flush=True))
    return {**result.to_json(), "seconds": time.perf_counter() - start}


def table(results: dict[str, dict]) -> str:
    lines = ["| preset | slice | stage | peak GiB per chip | fits | train step: est. s, est. MFU | command |",
             "|---|---|---|---|---|---|---|"]
    for key, result in results.items():
        preset, topology = key.split("@")
        for stage in result["stages"]:
            step = next((p for p in stage["programs"] if p["program"] == "train step"), None)
            timing = ""
            if step and step["seconds"]:
                mfu = step["model_flops"] / (step["seconds"] * result["peak_flops"]) if step["model_flops"] else 0
                bound = "≥ " if step["seconds_from"] == "roofline" else ""
                timing = f"{bound}{step['seconds']:.2f} s, {100 * mfu:.0f}%"
            verdict = "yes" if stage["fits"] else f"no: {stage['remedy']}"
            command = f"`make plan PRESET={preset} TOPOLOGY={topology} PLAN_ARGS=\"--mesh {TOPOLOGIES[topology]}\"`"
            lines.append(f"| {preset} | {topology} ({result['chips']} chips, {result['hosts']} host"
                         f"{'s' if result['hosts'] > 1 else ''}) | {stage['stage']} | {stage['peak'] / GiB:.1f} | "
                         f"{verdict} | {timing} | {command} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--only", nargs="+", default=list(PRESETS))
    parser.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES))
    args = parser.parse_args()
    path = results_path("plan_presets")
    results = json.loads(path.read_text()) if path.exists() else {}
    for preset in args.only:
        for topology in args.topologies:
            print(f"== {preset} on {topology}", file=sys.stderr, flush=True)
            results[f"{preset}@{topology}"] = run_one(preset, topology, TOPOLOGIES[topology])
            write_results("plan_presets", results)  # each plan kept as soon as it is made
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
                  "block 4).\n\n" + body, markdown=ROOT / "SCALING.md")


if __name__ == "__main__":
    main()
