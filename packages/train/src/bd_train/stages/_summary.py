"""The pipeline's report: the held-out summary table of the four models, printed, kept as an
artifact and written as JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._driver import StageResult
    from ._run import RunDir

SUMMARY_ROWS = ("teacher_sft", "student_sft", "student_opd", "student_grpo")
SUMMARY_KEYS = ("accuracy", "mean_reward", "n", "nfe_per_token")


def summarize(results: Mapping[str, StageResult], where: RunDir) -> dict[str, dict[str, Any]]:
    """`{row: {accuracy, mean_reward, n, nfe_per_token}}` for the four models, printed as a table
    and written to `<output_dir>/latest/summary.json` and the run folder."""
    summary = {}
    for row in SUMMARY_ROWS:
        evaluation = results[row].evaluation
        metrics = {} if evaluation is None else evaluation.metrics()
        summary[row] = {key: metrics[key] for key in SUMMARY_KEYS if key in metrics}
    print(format_summary(summary))
    text = json.dumps(summary, indent=2)
    (Path(where.run_dir) / "summary.json").write_text(text)
    latest = where.outputs / "latest"
    latest.mkdir(parents=True, exist_ok=True)
    (latest / "summary.json").write_text(text)
    return summary


def format_summary(summary: Mapping[str, Mapping[str, Any]]) -> str:
    lines = [f"{'model':<14} {'accuracy':>9} {'reward':>8} {'n':>5} {'NFE/token':>10}"]
    for row, values in summary.items():
        if not values:
            lines.append(f"{row:<14} {'—':>9}")
            continue
        lines.append(f"{row:<14} {values['accuracy']:>9.3f} {values['mean_reward']:>8.3f} {values['n']:>5d} "
                     f"{values.get('nfe_per_token', float('nan')):>10.3f}")
    return "\n".join(lines)


def print_summary(path: str | Path) -> None:
    """Print a written `summary.json` as the table."""
    print(format_summary(json.loads(Path(path).read_text())))
