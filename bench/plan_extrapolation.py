"""A plan in minutes: `--cost extrapolated` (the unrolled cost twins of the models cut to 2 and 4
layers, extended linearly to their depth) against the exact twin (every layer unrolled) on one
stage of a preset, for the same slice: each train step's FLOPs, bytes accessed and the cost
model's time from both, and the minutes each plan took. Both plans share one memo, so the exact
one compiles only what the extrapolated one did not (its train step's full twin). Needs libtpu:
`make bench` runs it with `.plan/bin/python`.

    .plan/bin/python bench/plan_extrapolation.py [--preset sdar_1p7b] [--topology v5p:2x2x4]
        [--mesh data=2,fsdp=8] [--stage opd]
"""

from __future__ import annotations

import argparse
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, write_results  # noqa: E402


def main() -> None:
    from bd_train.plan import _mesh_arg, plan

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", default="sdar_1p7b")
    parser.add_argument("--topology", default="v5p:2x2x4")
    parser.add_argument("--mesh", default="data=2,fsdp=8")
    parser.add_argument("--stage", default="opd")
    args = parser.parse_args()
    data = tomllib.loads((ROOT / "flows" / "configs" / f"{args.preset}.toml").read_text())
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    memo: dict[str, dict] = {}
    figures, seconds = {}, {}
    for cost in ("extrapolated", "train step"):
        start = time.perf_counter()
        result = plan(data, args.topology, name=f"{args.preset}.toml", stage=args.stage, mesh=_mesh_arg(args.mesh),
                      remedies=False, cost=cost, log=log, memo=memo)
        seconds[cost] = time.perf_counter() - start
        figures[cost] = {f"{s.stage}: {p.program}": {"flops": p.flops, "bytes_accessed": p.bytes_accessed,
                                                      "seconds": p.seconds, "seconds_from": p.seconds_from,
                                                      "cost_from": p.cost_from}
                         for s in result.stages for p in s.programs}
    rows = {}
    for name, exact in figures["train step"].items():
        approx = figures["extrapolated"][name]
        if exact["cost_from"] != "unrolled" or approx["cost_from"] != "extrapolated":
            continue
        rows[name] = {key: {"exact": exact[key], "extrapolated": approx[key],
                            "ratio": approx[key] / exact[key] if exact[key] else None}
                      for key in ("flops", "bytes_accessed", "seconds")}
        print(name, {key: f"{value['ratio']:.4f}" for key, value in rows[name].items() if value["ratio"]})
    out = {"preset": args.preset, "topology": args.topology, "mesh": args.mesh, "stage": args.stage,
           "programs": rows, "plan_seconds": {"extrapolated": seconds["extrapolated"],
                                              "exact train step twin, after it": seconds["train step"]}}
    print(f"extrapolated plan: {seconds['extrapolated'] / 60:.1f} min; the exact train-step twin after it: "
          f"{seconds['train step'] / 60:.1f} min")
    write_results("plan_extrapolation", out)


if __name__ == "__main__":
    main()
