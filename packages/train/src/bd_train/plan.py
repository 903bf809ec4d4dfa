"""Ahead-of-time plans: every program a pipeline stage runs, built from shapes on a TPU slice's
devices and compiled for TPU from this host, which need not have one (libtpu's compiler only).

    python -m bd_train.plan flows/configs/sdar_8b.toml --topology v5p:2x2x2 [--stage all] [--num-slices 1]
        [--mesh data=1,fsdp=8,model=1] [--cost all|"train step"|none] [--approx-cost] [--streamed]
        [--largest-batch [N]] [--json plan.json]

Per stage (SFT of each role, OPD, GRPO) it compiles the train step, the sampler's programs
(rollouts, held-out decoding), the teacher's forward for OPD and the reference scoring for GRPO
(`beta` > 0); `--streamed` adds the streamed step's two programs (with `microbatches` > 1), which
no stage runs but a loop of one's own with `TrainerConfig(streaming=True)` does. Per chip it prints
parameter and optimizer-state bytes (logical), argument, output, temporary and generated-code
bytes (XLA's buffer assignment) against the HBM libtpu lets a program use; for the programs whose
unrolled twin `--cost` compiles, the compiler's FLOPs and estimated seconds (its cost model, not a
timing) and from them the estimated MFU (model matmul FLOPs over the chip's bf16 peak); with
`--approx-cost` from twins of 2 and 3 layers extrapolated to the model's (a faster plan: FLOPs
within 1%, times approximate and marked ~); a legend
under the table says what each column is. OPD's and GRPO's rollouts are costed from one step of
the sampler's denoising loop, compiled alone: its time, its bandwidth and compute bounds, tokens
per second per chip, and one rollout batch's share of the stage's step. Once the compiler refuses
one of a stage's programs, the stage's later programs are not compiled (it cannot fit), and it is
re-planned with single changes — more microbatches, remat `full`, half the held-out decoding's
rows, `fsdp` over the data axis, LoRA — and the first that fits is named; `--largest-batch [N]`
also finds each stage's largest batch per step that fits, among the configured one times 2^k,
k <= N (default 4), and costs the stage's train step at it (unless `--cost none`). No weights or
data are read: model shapes come from the preset or a pretrained checkpoint's config.json (a Hub
repo id fetches its config and tokenizer files only), data shapes from the canvas. A stage's
programs and cost twins compile two at a time on threads (`BDLM_PLAN_THREADS`; 1 halves the extra
memory, at about 1.3x the time).

Exit codes: 0 every stage planned fits; 1 a stage does not fit (or the compiler refuses one of its
programs); 2 an error (an unreadable preset, an invalid config, mesh or topology, libtpu missing).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from bd_core import ConfigError
from bd_models import MeshError

from ._output_path import output_path_error
from ._plan_compile import submit
from ._plan_programs import COSTS, ProgramPlan, compile_program, stage_programs
from ._plan_remedies import layout_remedy, microbatch_counts, planned_on, remedies_for, with_attention
from ._plan_report import (
    LargestBatch,
    Plan,
    StagePlan,
    format_largest,
    format_plan,
    rollout_cost,
)
from ._plan_run import shapes_run
from ._tpu import Chip, GiB, Topology, TopologyError, device_chip, topology

__all__ = ["Chip", "LargestBatch", "Plan", "ProgramPlan", "StagePlan", "compile_program", "device_chip",
           "format_largest", "format_plan", "largest_batch", "main", "plan", "rollout_cost", "stage_programs"]

STAGES = ("sft", "opd", "grpo")
EXIT_CODES = """exit codes:
  0  every stage planned fits the HBM libtpu lets a program use
  1  a stage does not fit, or the TPU compiler refuses one of its programs
  2  an error: an unreadable preset, an invalid config, mesh or topology, libtpu missing"""


# -- meshes, remedies and the plan -----------------------------------------------------------------

def make_plan_mesh(mesh: dict[str, int], topo: Topology) -> jax.sharding.Mesh:
    """The preset's (`data`, `fsdp`, `model`) mesh laid over the slice's chips; across slices the
    `data` axis spans them (the slow links carry only the gradient all-reduce)."""
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    shape = (mesh["data"], mesh["fsdp"], mesh["model"])
    if int(np.prod(shape)) != topo.chips:
        raise ConfigError(f"mesh: data*fsdp*model = {'*'.join(map(str, shape))} = {int(np.prod(shape))} but "
                          f"{topo.name}{' x ' + str(topo.num_slices) if topo.num_slices > 1 else ''} has "
                          f"{topo.chips} chips; give --mesh data=...,fsdp=...,model=... with that product")
    if topo.num_slices > 1:
        if shape[0] % topo.num_slices:
            raise ConfigError(f"mesh: data = {shape[0]} must be a multiple of the {topo.num_slices} slices (the "
                              "data axis spans them); raise data or give fewer slices")
        ici = (shape[0] // topo.num_slices, shape[1], shape[2])
        devices = mesh_utils.create_hybrid_device_mesh(ici, (topo.num_slices, 1, 1), devices=list(topo.devices))
    else:
        devices = mesh_utils.create_device_mesh(shape, devices=list(topo.devices))
    return Mesh(devices, ("data", "fsdp", "model"), axis_types=(AxisType.Auto,) * 3)


def _without_weights(fn: Callable) -> Callable:
    """`fn` with a Hub repo id's config and tokenizer fetched, never its weights: a plan reads shapes."""
    @functools.wraps(fn)
    def planned(*args: Any, **kwargs: Any) -> Any:
        from .stages._sections import shapes_only

        with shapes_only():
            return fn(*args, **kwargs)

    return planned


def _stage_names(config: Any, which: str) -> list[str]:
    names = []
    if which in ("sft", "all"):
        names += [f"sft-{role}" for role in ("teacher", "student") if not getattr(config, role).checkpoint]
    return names + [s for s in ("opd", "grpo") if which in (s, "all")]


def plan_stage(config: Any, stage: str, mesh_shape: dict[str, int], topo: Topology,
               log: Callable[[str], None] = lambda _: None, *, cost: str = "all",
               memo: dict | None = None, approx_cost: bool = False, streamed: bool = False) -> StagePlan:
    """Compile `stage`'s programs for `topo` (and the unrolled cost twins `cost` names, of every
    layer or with `approx_cost` of 2 and 3: `stage_programs`), two at a time on threads; `memo`
    (one per slice) carries programs compiled already, by their StableHLO, from stage to stage and
    remedy to remedy."""
    mesh = make_plan_mesh(mesh_shape, topo)
    run = shapes_run(config)
    programs = []
    with jax.set_mesh(mesh):  # as the stages run: `shard_map` and `splash` attention read it
        start = time.perf_counter()
        lowered = stage_programs(run, stage, mesh, cost=cost, approx_cost=approx_cost, streamed=streamed)
        log(f"  lowered {stage}'s {len(lowered)} programs in {time.perf_counter() - start:.0f} s")
        # Every program and cost twin starts compiling now, the twins (the longest) first, so that
        # the compiler threads stay busy; the figures are read in the stage's order.
        memo = {} if memo is None else memo
        known = {id(future) for future in memo.values()}
        started = [submit(twin, memo) for program in lowered if program.cost for twin in program.cost.lowered]
        ours = [submit(program.lowered, memo) for program in lowered]
        started += ours
        start = time.perf_counter()
        for index, program in enumerate(lowered):
            programs.append(compile_program(program, topo.chip, memo))
            if id(ours[index]) in known:
                log(f"  {stage}: {program.program}: compiled before (the same StableHLO)")
            else:
                log(f"  compiled {stage}: {program.program} ({time.perf_counter() - start:.0f} s into the stage's "
                    f"compiles)")
            if programs[-1].refused and lowered[index + 1:]:  # the stage cannot fit: on to its remedies
                for future in started:
                    future.cancel()  # those not started yet
                log(f"  {stage}: {', '.join(p.program for p in lowered[index + 1:])} not compiled: "
                    f"the {program.program} does not fit")
                break
    result = StagePlan(stage, programs, topo.chip.usable_hbm)
    result.rollout = rollout_cost(result, topo.chip, topo.chips)
    return result


@_without_weights
def plan(data: dict, topology_name: str, *, name: str = "preset", stage: str = "all", num_slices: int = 1,
         mesh: dict[str, int] | None = None, remedies: bool = True, attention: str | None = None,
         log: Callable[[str], None] = lambda _: None, memo: dict[str, dict] | None = None,
         cost: str = "all", approx_cost: bool = False, streamed: bool = False) -> Plan:
    """Compile every program of the preset `data` (its TOML as a dict) for `topology_name`;
    `attention` replaces both models' `[teacher]`/`[student] attention`; `cost` says which programs
    are costed (`COSTS`: "train step" skips the unrolled twins of every other program), from
    twins with every layer unrolled (each compiles for a minute or more), or with `approx_cost`
    from twins of 2 and 3 layers extrapolated to the model's layers: FLOPs within 1%, bytes accessed
    and time approximations (`ProgramPlan.extrapolated`). `streamed` adds the streamed step's two
    programs, which no stage runs, to stages with microbatches. `memo`, kept across
    calls, lets plans of several presets share what they compiled for the same slice (the same
    teacher, say).

    Example:
        ```py
        import tomllib
        from bd_train.plan import format_plan, plan

        preset = tomllib.loads(open("flows/configs/sdar_1p7b.toml").read())
        print(format_plan(plan(preset, "v5e:2x4", name="sdar_1p7b")))  # needs libtpu: `make plan-env`
        ```
    """
    from .stages._config import parse_pipeline_config, pipeline_config

    data = with_attention(data, attention)

    topo = topology(topology_name, num_slices=num_slices)
    try:
        config = pipeline_config(parse_pipeline_config(data))
    except ConfigError:
        if mesh is None:
            raise
        data = planned_on(data, mesh)  # a preset made for another mesh, whose rows the planned one splits
        config = pipeline_config(parse_pipeline_config(data))
    mesh_shape = mesh or {"data": config.mesh.data, "fsdp": config.mesh.fsdp, "model": config.mesh.model}
    log(f"{topo.describe()}; mesh {mesh_shape}")
    stages = []
    memo = ({} if memo is None else memo).setdefault(f"{topology_name} x {num_slices}", {})
    for stage_name in _stage_names(config, stage):
        stage_data = data
        try:
            result = plan_stage(config, stage_name, mesh_shape, topo, log, memo=memo, cost=cost,
                                approx_cost=approx_cost, streamed=streamed)
        except MeshError as err:  # e.g. a preset's microbatches made for fewer data-parallel chips
            layout = layout_remedy(data, stage_name, mesh_shape)
            if layout is None:
                raise
            description, stage_data = layout
            log(f"  {stage_name}: {err}; planning it with {description}")
            result = plan_stage(pipeline_config(parse_pipeline_config(planned_on(stage_data, mesh_shape))), stage_name,
                                mesh_shape, topo, log, memo=memo, cost=cost, approx_cost=approx_cost, streamed=streamed)
            result.planned_with = f"{description} (as configured: {err})"
        if not result.fits and remedies:
            result.remedy = "no single change tried makes it fit"
            over = result.peak / (0.9 * topo.chip.usable_hbm)
            for description, changed, changed_mesh in remedies_for(stage_data, stage_name, mesh_shape, over):
                log(f"  {stage_name} does not fit ({result.peak / GiB:.1f} GiB): trying {description}")
                try:
                    retry = plan_stage(pipeline_config(parse_pipeline_config(planned_on(changed, changed_mesh))),
                                       stage_name, changed_mesh, topo, log, cost="none", memo=memo,
                                       streamed=streamed)  # memory only
                except (ConfigError, MeshError) as err:
                    log(f"    not possible: {err}")
                    continue
                log(f"    peak {retry.peak / GiB:.1f} GiB per chip with {description}")
                if retry.fits:
                    result.remedy = f"fits with {description} (peak {retry.peak / GiB:.2f} GiB per chip)"
                    break
        stages.append(result)
    return Plan(name, topology_name + (f" x {num_slices}" if num_slices > 1 else ""),
                mesh_shape, topo.chips, topo.hosts * num_slices, topo.chip.hbm, topo.chip.peak_flops, stages,
                topo.chip.usable_hbm)


@_without_weights
def stage_lowered(data: dict, stage: str, mesh: jax.sharding.Mesh, *, cost: str = "none",
                  approx_cost: bool = False, streamed: bool = False) -> list[Any]:
    """The programs of `stage` ("sft-teacher", "sft-student", "opd" or "grpo") of the preset `data`
    lowered on `mesh` as a plan builds them, for whatever devices the mesh holds (a TPU topology's,
    or this host's own, to run them): each with `.program` (its name), `.lowered` (a
    `jax.stages.Lowered`) and `.model_flops` (train steps: the model's matmul FLOPs per device)."""
    from .stages._config import parse_pipeline_config, pipeline_config

    with jax.set_mesh(mesh):
        return stage_programs(shapes_run(pipeline_config(parse_pipeline_config(data))), stage, mesh, cost=cost,
                              approx_cost=approx_cost, streamed=streamed)


@_without_weights
def largest_batch(data: dict, stage: str, topology_name: str, *, mesh: dict[str, int] | None = None,
                  num_slices: int = 1, memo: dict[str, dict] | None = None, doublings: int = 4,
                  cost: str = "none", approx_cost: bool = False, streamed: bool = False,
                  log: Callable[[str], None] = lambda _: None) -> LargestBatch:
    """The largest batch per step of `stage` (`[sft] batch_size`, or `prompts_per_step` for OPD and
    GRPO) that fits the slice at the preset's microbatch count (or, where that count does not split
    the configured batch over the data-parallel chips, at the count the plan itself takes: the
    largest below it that does), among the configured batch times 2^k (k up to `doublings`, down to
    the batch whose microbatches hold one row per data-parallel chip): every program of the stage
    compiled for memory at each size tried, doubling while it fits, halving while it does not.
    The stage is then planned once more at that batch with `cost` (`COSTS`, and `approx_cost` as
    `plan` takes it): with the memo, only the unrolled twins compile again."""
    from .stages._config import parse_pipeline_config, pipeline_config

    topo = topology(topology_name, num_slices=num_slices)
    config = pipeline_config(parse_pipeline_config(data))
    mesh_shape = mesh or {"data": config.mesh.data, "fsdp": config.mesh.fsdp, "model": config.mesh.model}
    memo = ({} if memo is None else memo).setdefault(f"{topology_name} x {num_slices}", {})
    name, microbatches, counts = microbatch_counts(data, stage, mesh_shape)
    if microbatches not in counts and (layout := layout_remedy(data, stage, mesh_shape)) is not None:
        log(f"  {stage}: searched at {layout[0]}, as the plan takes it")
        data, microbatches = layout[1], layout[1][name]["microbatches"]
    key = "batch_size" if name == "sft" else "prompts_per_step"
    configured = getattr(getattr(config, name), key)
    per_row = microbatches * mesh_shape["data"] * mesh_shape["fsdp"]  # rows of a step per row of a chip
    group = config.grpo.group_size if name == "grpo" else 1

    def planned(batch: int, cost: str) -> StagePlan | None:
        if (batch * group) % per_row:
            return None
        changed = json.loads(json.dumps(data))
        changed.setdefault(name, {})[key] = batch
        try:
            return plan_stage(pipeline_config(parse_pipeline_config(planned_on(changed, mesh_shape))), stage,
                              mesh_shape, topo, log, cost=cost, memo=memo, approx_cost=approx_cost, streamed=streamed)
        except (ConfigError, MeshError):
            return None

    def fits(batch: int) -> bool:
        result = planned(batch, "none")
        if result is not None:
            log(f"  {stage} with [{name}] {key} = {batch}: peak {result.peak / GiB:.3f} GiB per chip")
        return result is not None and result.fits

    best, capped = None, False
    if fits(configured):
        best = configured
        for k in range(1, doublings + 1):
            if not fits(configured * 2**k):
                break
            best, capped = configured * 2**k, k == doublings
    else:
        batch = configured // 2
        while best is None and batch * group >= per_row:
            best = batch if fits(batch) else None
            batch //= 2
    at = planned(best, cost) if best is not None else None
    return LargestBatch(name, key, best, microbatches, capped, at)


def _mesh_arg(text: str) -> dict[str, int]:
    out = {"data": 1, "fsdp": 1, "model": 1}
    seen = set()
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in out or not value.strip().isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"--mesh {text!r}: expected data=N,fsdp=N,model=N (any of them, each "
                                             f"N >= 1)")
        if key in seen:
            raise argparse.ArgumentTypeError(f"--mesh {text!r}: {key} is given twice; give each axis once")
        seen.add(key)
        out[key] = int(value)
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line: `python -m bd_train.plan PRESET --topology ...`; returns the exit code."""
    # Programs compiled for a slice that is not here are never run here: no persistent cache.
    jax.config.update("jax_enable_compilation_cache", False)
    summary = " ".join((__doc__ or "").split("\n\n")[0].split())  # the docstring's first paragraph
    parser = argparse.ArgumentParser(prog="python -m bd_train.plan", description=summary,
                                     epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", help="a preset TOML (flows/configs/<name>.toml)")
    parser.add_argument("--topology", required=True, help="e.g. v5e:2x4, v5p:2x2x2, v6e:4x4")
    parser.add_argument("--num-slices", type=int, default=1)
    parser.add_argument("--stage", choices=[*STAGES, "all"], default="all")
    parser.add_argument("--mesh", type=_mesh_arg, default=None, help="data=N,fsdp=N,model=N (default: the preset's)")
    parser.add_argument("--no-remedies", action="store_true", help="do not re-plan a stage that does not fit")
    parser.add_argument("--attention", choices=["dense", "blocked", "shard_map", "splash"], default=None,
                        help="both models' attention (default: the preset's); splash is TPU's kernel")
    parser.add_argument("--cost", choices=COSTS, default="all",
                        help="which programs get XLA's cost estimate (each needs compiles with the layers "
                             "unrolled; the rollouts' denoising step, which has no loop, is costed always)")
    parser.add_argument("--approx-cost", action="store_true",
                        help="cost from twins of 2 and 3 layers extrapolated to the model's layers, not from "
                             "twins with every layer unrolled: a faster plan; FLOPs within 1%%, bytes accessed "
                             "and times approximate, marked ~")
    parser.add_argument("--streamed", action="store_true",
                        help="also the streamed step's two programs (stages with microbatches > 1), which no "
                             "stage runs but a loop of your own with TrainerConfig(streaming=True) does")
    parser.add_argument("--largest-batch", nargs="?", type=int, const=4, default=None, metavar="DOUBLINGS",
                        help="also find each stage's largest batch per step that fits, up to the configured one "
                             "times 2^DOUBLINGS (default 4; every size tried compiles the stage's programs), "
                             "and cost its train step there (unless --cost none)")
    parser.add_argument("--json", default=None, help="also write the plan as JSON here")
    args = parser.parse_args(argv)
    if args.num_slices < 1:
        parser.error(f"--num-slices {args.num_slices}: a plan is of one slice or more")
    if args.largest_batch is not None and args.largest_batch < 1:
        parser.error(f"--largest-batch {args.largest_batch}: the doublings to try must be at least 1")
    if args.json and (error := output_path_error("--json", args.json, "plan.json")):  # now: a plan takes minutes
        parser.error(error)
    path = Path(args.preset)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        print(f"plan: cannot read the preset {path}: {err}", file=sys.stderr)
        return 2
    try:
        memo: dict[str, dict] = {}
        result = plan(data, args.topology, name=path.name, stage=args.stage, num_slices=args.num_slices,
                      mesh=args.mesh, remedies=not args.no_remedies, attention=args.attention, cost=args.cost,
                      log=lambda line: print(line, file=sys.stderr, flush=True), memo=memo,
                      approx_cost=args.approx_cost, streamed=args.streamed)
    except (TopologyError, ConfigError, MeshError) as err:
        print(f"plan: {err}", file=sys.stderr)
        return 2
    print(format_plan(result))
    out = result.to_json()
    if args.largest_batch is not None:
        for stage in out["stages"]:
            found = largest_batch(with_attention(data, args.attention), stage["stage"], args.topology,
                                  mesh=args.mesh, num_slices=args.num_slices, memo=memo,
                                  doublings=args.largest_batch, cost="none" if args.cost == "none" else "train step",
                                  approx_cost=args.approx_cost, streamed=args.streamed,
                                  log=lambda line: print(line, file=sys.stderr, flush=True))
            stage["largest_batch"] = found.to_json()
            print(format_largest(stage["stage"], found, result.peak_flops))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(s.fits for s in result.stages) else 1


if __name__ == "__main__":
    sys.exit(main())
