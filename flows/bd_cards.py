"""Metaflow card contents for the pipeline: each stage's curves, held-out eval (greedy, pass@k,
accuracy vs NFE), its gain over the model it started from (paired 95% intervals), what OPD's guard
found, sample completions and one denoising trace; the end step's summary tables, the gains and the
four models' accuracy-vs-NFE curves in one plot."""

from collections.abc import Mapping
from typing import Any

from metaflow.cards import Image, Markdown, Table

from bd_train.stages import (
    StageResult,
    curve_rows,
    gain_keys,
    gain_rows,
    guard_lines,
    pass_keys,
    summary_curve_png,
    trained_text,
)


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def stage_card(card: Any, result: StageResult) -> None:
    """Fill a Metaflow card (`current.card[...]`) with the stage's curves, eval, samples and trace."""
    card.append(Markdown(f"# {result.stage}\ncheckpoint `{result.checkpoint_dir}` at step {result.step}"))
    if result.params:
        card.append(Markdown(f"trained parameters: {trained_text(result.params)}"))
    if result.curves_png:
        card.append(Image(result.curves_png, label="training curves"))
    evaluation = result.evaluation
    if evaluation is None:
        return
    card.append(Markdown("## Held-out evaluation (greedy decoding)"))
    card.append(Table([[k, _cell(v)] for k, v in evaluation.metrics().items() if not k.startswith("pass@")],
                      headers=["metric", "value"]))
    if evaluation.pass_at_k:
        card.append(Markdown(f"## pass@k ({evaluation.samples_per_problem} samples per problem at the rollout "
                             "decoding, unbiased estimator)"))
        card.append(Table([[_cell(v) for v in evaluation.pass_at_k.values()]], headers=list(evaluation.pass_at_k)))
    if evaluation.accuracy_vs_nfe:
        card.append(Markdown("## Accuracy vs NFE per generated token"))
        card.append(Table([[p.decoding, _cell(p.accuracy), _cell(p.mean_reward), _cell(p.nfe_per_token)]
                           for p in evaluation.accuracy_vs_nfe],
                          headers=["decoding", "accuracy", "mean reward", "NFE/token"]))
        if evaluation.curve_png:
            card.append(Image(evaluation.curve_png, label="accuracy vs NFE"))
    if result.gain:
        metrics = result.gain["metrics"]
        n = next(iter(metrics.values()))["n"]
        card.append(Markdown(f"## Gain over {result.gain['over']} (paired 95% bootstrap interval over the {n} "
                             "held-out problems; * excludes 0)"))
        card.append(Table([[k, _interval(v)] for k, v in metrics.items()], headers=["metric", "change [95%]"]))
    if result.guard:
        card.append(Markdown(_guard_text(result.guard)))
    if evaluation.samples:
        card.append(Markdown("## Sample completions"))
        card.append(Table([[s.prompt, s.answer, s.completion, f"{s.reward:.2f}"] for s in evaluation.samples],
                          headers=["prompt", "answer", "completion", "reward"]))
    if evaluation.trace_png:
        card.append(Markdown("## One denoising trace (blue: committed at that step; grey: still masked)"))
        card.append(Image(evaluation.trace_png, label="denoising trace"))


def _interval(values: Mapping[str, Any]) -> str:
    return (f"{values['estimate']:+.3f} [{values['low']:+.3f}, {values['high']:+.3f}]"
            + ("*" if values["excludes_zero"] else ""))


def _guard_text(guard: Mapping[str, Any]) -> str:
    kept = "OPD's start (OPD ended worse than it)" if guard["kept"] == "start" else "OPD's model"
    lines = [f"## OPD guard ({guard['mode']})", f"the next stage starts from {kept}; the student at each "
             f"comparison (greedy accuracy, change over OPD's start {guard['start_accuracy']:.3f}):", ""]
    lines += [f"- step {p['step']}: {p['accuracy']:.3f}, {_interval(p['change'])}" for p in guard["points"]]
    lines += [f"- {line}" for line in guard["said"]]
    return "\n".join(lines)


def summary_card(card: Any, summary: Mapping[str, Mapping[str, Any]]) -> None:
    """The end step's card: the four models' held-out numbers, pass@k and accuracy vs NFE."""
    passes = pass_keys(summary)
    card.append(Markdown("# Held-out summary"))
    card.append(Table([[row, *(f"{v.get(k, float('nan')):.4g}" for k in ("accuracy", "mean_reward", "nfe_per_token")),
                        str(v.get("n", "")), *(f"{v.get(k, float('nan')):.4g}" for k in passes),
                        trained_text(v) if "params_trained" in v else "—"]
                       for row, v in summary.items()],
                      headers=["model", "accuracy", "mean reward", "NFE/token", "n", *passes, "trained params"]))
    heading, gains = gain_rows(summary)
    if gains:
        card.append(Markdown(f"## Gain over the previous stage\n{heading}"))
        card.append(Table([list[Any](cells) for cells in gains], headers=["model", "over", *gain_keys(summary)]))
    guard = guard_lines(summary)
    if guard:
        card.append(Markdown("\n".join(line.strip() for line in guard if line)))
    decodings, rows = curve_rows(summary)
    if rows:
        card.append(Markdown("## Accuracy @ NFE per token, by decoding"))
        card.append(Table([list[Any](cells) for cells in rows], headers=["model", *decodings]))
        picture = summary_curve_png(summary)
        if picture:
            card.append(Image(picture, label="accuracy vs NFE"))
