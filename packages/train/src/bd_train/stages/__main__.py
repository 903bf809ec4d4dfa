"""`python -m bd_train.stages run <preset.toml> [--stage sft|opd|grpo]`: the pipeline's stage chain
(or the chain up to one stage) on this host, without Metaflow: the same command on every host of a
group is the whole launch (the group comes from the `BDLM_*` variables or JAX's cluster detection:
a Cloud TPU VM's workers, SLURM, Kubernetes, Open MPI), over the preset's global mesh; rerun, it
continues from each stage's latest complete checkpoint. `python -m bd_train.stages summary
<preset.toml>`: print the tables of the latest run of a preset, as `make run` does after the flow.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bd_core import ConfigError

from ._config import parse_pipeline_config, pipeline_config
from ._summary import print_summary

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
    print_summary(path)
    return 0


def _run(config: dict, until: str, run_id: str) -> int:
    from ..distributed import DistributedError, ProcessGroup, initialize, shutdown
    from ._chain import run_chain
    from ._run import RunDir, StageError

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
        run_chain(config, RunDir.create(config, run_id=run_id), until=until)
    except StageError as err:
        print(f"bdlm: {err}", file=sys.stderr)
        return 1
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
