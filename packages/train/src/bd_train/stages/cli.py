"""The stage chain without an orchestrator. `run_chain` calls teacher and student SFT, OPD and
GRPO in order, on every process of a group, with the same stage functions the Metaflow flow calls
(so the two cannot drift); a run id that does not change makes a rerun continue: each stage starts
from its latest complete checkpoint, and a finished stage is restored, not retrained.

`python -m bd_train.stages run <preset.toml> [--stage sft|opd|grpo]` runs it on this host: the
same command on every host of a group is the whole launch (the group comes from the `BDLM_*`
variables or JAX's cluster detection: a Cloud TPU VM's workers, SLURM, Kubernetes, Open MPI), over
the preset's global mesh. `python -m bd_train.stages summary <preset.toml>` prints the tables of
the latest run of a preset, as `make run` does after the flow.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import jax

from bd_core import ConfigError
from bd_data import CanvasOverflow

from ._compat import check_adopted, check_distillation_pair
from ._config import parse_pipeline_config, pipeline_config
from ._driver import StageResult
from ._run import RunDir, StageError
from ._summary import ROWS, print_summary, summarize
from .grpo import run_grpo
from .opd import run_opd
from .sft import run_sft

STAGES = ("sft", "opd", "grpo")


def run_chain(config: Any, where: RunDir, *, until: str = "grpo") -> dict[str, StageResult]:
    """Every stage up to `until` (`sft`, `opd` or `grpo`), each continuing from its latest complete
    checkpoint; `{stage: StageResult}`. The whole chain ends with the summary the flow's `end`
    writes (`<output_dir>/latest/summary.json`, printed)."""
    if until not in STAGES:
        raise ValueError(f"until: expected one of {STAGES}, got {until!r}")
    check_adopted(config)  # before anything trains, as the flow's `start`
    results = {f"sft-{role}": run_sft(config, where, role=role) for role in ("teacher", "student")}
    if until == "sft":
        return results
    check_distillation_pair(results["sft-teacher"], results["sft-student"])
    results["opd"] = run_opd(config, where, teacher=results["sft-teacher"], student=results["sft-student"])
    if until == "opd":
        return results
    results["grpo"] = run_grpo(config, where, start=results["opd"])
    if jax.process_index() == 0:  # one summary, as the flow's `end` step writes it
        summarize({ROWS[stage]: result for stage, result in results.items()}, where)
    return results


RUN_ID = "stages"  # one folder per preset's output_dir: a rerun finds the checkpoints it left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bd_train.stages")
    commands = parser.add_subparsers(dest="command", required=True)
    summary = commands.add_parser("summary", help="print the latest run's summary of a preset")
    summary.add_argument("preset", type=Path, help="the pipeline config (TOML) the run used")
    run = commands.add_parser("run", help="run the stage chain on this host (the same command on every host)")
    run.add_argument("preset", type=Path, help="the pipeline config (TOML)")
    run.add_argument("--stage", choices=("sft", "opd", "grpo"), default="grpo",
                     help="run the chain up to this stage (default: all of it); finished stages are restored")
    run.add_argument("--run-id", default=RUN_ID,
                     help=f"the run's folder under <output_dir>/pipeline/ (default {RUN_ID!r}); the same id resumes")
    args = parser.parse_args(argv)
    run_id = getattr(args, "run_id", RUN_ID)
    if not run_id.strip() or set("/\\") & set(run_id) or run_id in (".", ".."):
        parser.error(f"--run-id {run_id!r}: a run id names one folder under <output_dir>/pipeline/; give a name "
                     f"without slashes")
    if args.preset.is_dir():
        parser.error(f"{args.preset}: is a folder; give a preset's .toml file (e.g. flows/configs/default.toml)")
    if not args.preset.is_file():
        parser.error(f"{args.preset}: no such preset file")
    try:
        config = parse_pipeline_config(args.preset.read_text())
    except ConfigError as err:
        print(f"{args.preset}: {err}", file=sys.stderr)
        return 2
    if args.command == "run":
        return _run(config, args.stage, args.run_id)
    path = Path(pipeline_config(config).run.output_dir) / "latest" / "summary.json"
    if not path.is_file():
        print(f"{path}: no summary yet; run the pipeline on {args.preset} first (make run)", file=sys.stderr)
        return 1
    try:
        print_summary(path)
    except (ValueError, KeyError, TypeError) as err:  # JSONDecodeError is a ValueError
        print(f"{path}: not a summary this version can read ({type(err).__name__}: {err}); rerun the run's command "
              f"(finished stages are restored, not retrained) to write it again", file=sys.stderr)
        return 1
    return 0


def _run(config: dict, until: str, run_id: str) -> int:
    from .._distributed import check_shared_folder
    from ..distributed import DistributedError, ProcessGroup, initialize, shutdown

    mesh = pipeline_config(config).mesh
    try:
        group, source = ProcessGroup.detect()
        if group.num_processes != mesh.num_nodes:
            raise DistributedError(f"[mesh] num_nodes = {mesh.num_nodes} but {source} gives {group.num_processes} "
                                   f"process(es); set num_nodes to the number of hosts that run this command")
        print(f"bdlm: process {group.process_id} of {group.num_processes} ({source})", file=sys.stderr)
        # on CPU hosts the mesh's share of devices per process (as the flow's nodes); accelerators ignore it
        initialize(group, cpu_devices=mesh.devices // mesh.num_nodes)
    except DistributedError as err:
        print(f"bdlm: {err}", file=sys.stderr)
        return 2
    try:
        where = RunDir.create(config, run_id=run_id)
        check_shared_folder(where.run_dir, "run.output_dir")
        run_chain(config, where, until=until)
    except (StageError, ConfigError, DistributedError) as err:  # e.g. SIGTERM: the group stops at one saved step
        print(f"bdlm: {err}", file=sys.stderr)
        shutdown()  # leave the group together, before process 0's coordination service goes
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside a stage's updates
        print("bdlm: interrupted (Ctrl-C); the checkpoints saved so far are kept: rerun the same command to "
              "continue from the latest", file=sys.stderr)
        # at once, as asked: a computation or a data thread interrupted mid-way can crash the
        # interpreter's teardown (seen: a segfault after an interrupted evaluation); a save in
        # flight is left uncommitted, which a restore ignores
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    except CanvasOverflow as err:  # a problem past the ones checked at the start
        print(f"bdlm: a training problem does not fit the canvas: {err}; raise [canvas] prompt_len or "
              f"max_new_tokens (multiples of block_size) or choose smaller [task] params; the checkpoints saved "
              f"so far are kept", file=sys.stderr)
        shutdown()
        return 1
    shutdown()
    return 0

