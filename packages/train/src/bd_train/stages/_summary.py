"""The pipeline's report: the held-out summary of the four models (greedy accuracy, reward, NFE
per token, pass@k and the accuracy-vs-NFE curve), each stage's gain over the model it started from
with its paired 95% bootstrap interval over the problems, and what OPD's guard found; printed,
kept as an artifact and written as JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._driver import StageResult
    from ._run import RunDir

SUMMARY_ROWS = ("teacher_sft", "student_sft", "student_opd", "student_grpo")
SUMMARY_KEYS = ("accuracy", "mean_reward", "n", "nfe_per_token")
# The summary's row of each stage's model.
ROWS = {"sft-teacher": "teacher_sft", "sft-student": "student_sft", "opd": "student_opd", "grpo": "student_grpo"}
GAIN_KEYS = ("accuracy", "mean_reward")  # then pass@k


def summarize(results: Mapping[str, StageResult], where: RunDir) -> dict[str, dict[str, Any]]:
    """`{row: {accuracy, mean_reward, n, nfe_per_token, pass@k..., accuracy_vs_nfe, gain, guard}}`
    for the four models, printed as tables and written to `<output_dir>/latest/summary.json` and
    the run folder. `gain` (a stage that started from another's model): `{"over": that row,
    <metric>: {estimate, low, high, n, method, confidence, excludes_zero}}`, the change in greedy
    accuracy, mean reward and pass@k, paired over the held-out problems. `guard` (OPD): what its
    guard compared and kept (`kept`: "opd", or "start" when GRPO started from OPD's start)."""
    summary = {}
    for row in SUMMARY_ROWS:
        evaluation = results[row].evaluation
        if evaluation is None:
            summary[row] = {}
            continue
        metrics = evaluation.metrics()
        summary[row] = {key: metrics[key] for key in SUMMARY_KEYS if key in metrics} | dict(evaluation.pass_at_k)
        for chosen in evaluation.best_of:  # `[eval] best_of`: best_of@<n>_<rule> and nfe_per_problem@<n>
            summary[row] |= chosen.metrics()
        params = results[row].params
        if params:  # how many parameters the stage trained (LoRA: its adapters)
            summary[row] |= {f"params_{k}": v for k, v in params.items()}
        if evaluation.accuracy_vs_nfe:
            summary[row]["accuracy_vs_nfe"] = [dataclasses.asdict(p) for p in evaluation.accuracy_vs_nfe]
        gain = results[row].gain
        if gain:
            summary[row]["gain"] = {"over": ROWS.get(gain["over"], gain["over"]), **gain["metrics"]}
        if results[row].guard:
            summary[row]["guard"] = results[row].guard
    print(format_summary(summary))
    text = json.dumps(summary, indent=2)
    (Path(where.run_dir) / "summary.json").write_text(text)
    latest = where.outputs / "latest"
    latest.mkdir(parents=True, exist_ok=True)
    (latest / "summary.json").write_text(text)
    return summary


def trained_text(params: Mapping[str, Any]) -> str:
    """`"1.8k of 24k (7.5%)"` from `{"trained": ..., "total": ...}` or a summary row's `params_*`."""
    trained = params.get("trained", params.get("params_trained", 0))
    total = params.get("total", params.get("params_total", 0))
    return f"{_short(trained)} of {_short(total)} ({100 * trained / max(total, 1):.3g}%)"


def _short(n: int) -> str:
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def pass_keys(summary: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The pass@k columns present in any row, in order of k."""
    keys = {k for values in summary.values() for k in values if k.startswith("pass@")}
    return sorted(keys, key=lambda k: int(k.removeprefix("pass@")))


def curve_rows(summary: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The accuracy-vs-NFE table: one row per model, one `accuracy @ NFE/token` cell per decoding."""
    decodings: list[str] = []
    for values in summary.values():
        decodings += [p["decoding"] for p in values.get("accuracy_vs_nfe", ()) if p["decoding"] not in decodings]
    rows = []
    for row, values in summary.items():
        points = {p["decoding"]: p for p in values.get("accuracy_vs_nfe", ())}
        if points:
            rows.append([row, *(f"{points[d]['accuracy']:.3f} @ {points[d]['nfe_per_token']:.2f}" if d in points
                                else "—" for d in decodings)])
    return decodings, rows


def summary_curve_png(summary: Mapping[str, Mapping[str, Any]]) -> bytes | None:
    """Accuracy against NFE per token of every model in the summary, one line each (None without curves)."""
    from ._plots import accuracy_nfe_png

    series = {row: values["accuracy_vs_nfe"] for row, values in summary.items() if values.get("accuracy_vs_nfe")}
    return accuracy_nfe_png(series, title="held-out accuracy vs NFE per token") if series else None


def format_summary(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """The summary as the fixed-width table `make run` prints: accuracy, reward, n, NFE per token, pass@k and trained
    parameters per model."""
    passes = pass_keys(summary)
    lines = [f"{'model':<14} {'accuracy':>9} {'reward':>8} {'n':>5} {'NFE/token':>10}"
             + "".join(f" {k:>8}" for k in passes) + "  trained params"]
    for row, values in summary.items():
        if not values:
            lines.append(f"{row:<14} {'—':>9}")
            continue
        lines.append(f"{row:<14} {values['accuracy']:>9.3f} {values['mean_reward']:>8.3f} {values['n']:>5d} "
                     f"{values.get('nfe_per_token', float('nan')):>10.3f}"
                     + "".join(f" {values.get(k, float('nan')):>8.3f}" for k in passes)
                     + (f"  {trained_text(values)}" if "params_trained" in values else ""))
    decodings, rows = curve_rows(summary)
    if rows:
        lines += ["", "accuracy @ NFE/token by decoding", f"{'model':<14}" + "".join(f" {d:>14}" for d in decodings)]
        lines += [f"{cells[0]:<14}" + "".join(f" {c:>14}" for c in cells[1:]) for cells in rows]
    heading, gains = gain_rows(summary)
    if gains:
        lines += ["", heading, f"{'model':<14} {'over':<14}" + "".join(f" {k:>25}" for k in gain_keys(summary))]
        lines += [f"{cells[0]:<14} {cells[1]:<14}" + "".join(f" {c:>25}" for c in cells[2:]) for cells in gains]
    lines += guard_lines(summary)
    return "\n".join(lines)


def gain_keys(summary: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The metrics with a paired interval in any row: accuracy, mean reward, then pass@k by k."""
    present = {k for values in summary.values() for k in values.get("gain", {}) if k != "over"}
    return [k for k in GAIN_KEYS if k in present] + [k for k in pass_keys(summary) if k in present]


def gain_rows(summary: Mapping[str, Mapping[str, Any]]) -> tuple[str, list[list[str]]]:
    """The gains table's heading and rows: model, the model it started from, then one
    `+0.031 [-0.012, +0.074]` cell per metric (`*`: the interval excludes zero)."""
    keys = gain_keys(summary)
    rows, n = [], None
    for row, values in summary.items():
        gain = values.get("gain")
        if not gain:
            continue
        cells = [row, gain["over"]]
        for key in keys:
            interval = gain.get(key)
            cells.append("—" if interval is None else _interval_text(interval))
            n = n if interval is None else interval["n"]
        rows.append(cells)
    heading = (f"gain over the model each stage started from: paired 95% bootstrap interval over the {n} held-out "
               "problems (* excludes 0)")
    return heading, rows


def _interval_text(interval: Mapping[str, Any]) -> str:
    mark = "*" if interval["excludes_zero"] else ""
    return f"{interval['estimate']:+.3f} [{interval['low']:+.3f}, {interval['high']:+.3f}]{mark}"


def guard_lines(summary: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What OPD's guard said and kept, for the printout and the card."""
    lines = []
    for values in summary.values():
        guard = values.get("guard")
        if not guard:
            continue
        kept = ("OPD's start (OPD ended worse than it)" if guard["kept"] == "start" else "OPD's model")
        lines += ["", f"OPD guard ({guard['mode']}): {len(guard['points'])} comparison(s) with OPD's start; the next "
                  f"stage started from {kept}"]
        lines += [f"  {line}" for line in guard["said"]]
    return lines


def print_summary(path: str | Path) -> None:
    """Print a written `summary.json` as the tables."""
    print(format_summary(json.loads(Path(path).read_text())))
