"""`python -m bd_train.stages summary <preset.toml>`: print the tables of the latest pipeline run
of a preset (`<run.output_dir>/latest/summary.json`), as `make run` does after the flow."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._config import parse_pipeline_config, pipeline_config
from ._summary import print_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bd_train.stages")
    commands = parser.add_subparsers(dest="command", required=True)
    summary = commands.add_parser("summary", help="print the latest run's summary of a preset")
    summary.add_argument("preset", type=Path, help="the pipeline config (TOML) the run used")
    args = parser.parse_args(argv)
    if not args.preset.is_file():
        parser.error(f"{args.preset}: no such preset file")
    config = pipeline_config(parse_pipeline_config(args.preset.read_text()))
    path = Path(config.run.output_dir) / "latest" / "summary.json"
    if not path.is_file():
        print(f"{path}: no summary yet; run the pipeline on {args.preset} first (make run)", file=sys.stderr)
        return 1
    print_summary(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
