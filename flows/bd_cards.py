"""Metaflow card contents for the pipeline: each stage's curves, held-out eval (greedy, pass@k,
accuracy vs NFE), sample completions and one denoising trace; the end step's summary tables and
the four models' accuracy-vs-NFE curves in one plot."""

from collections.abc import Mapping
from typing import Any

from metaflow.cards import Image, Markdown, Table

from bd_train.stages import StageResult, curve_rows, pass_keys, summary_curve_png, trained_text


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
    if evaluation.samples:
        card.append(Markdown("## Sample completions"))
        card.append(Table([[s.prompt, s.answer, s.completion, f"{s.reward:.2f}"] for s in evaluation.samples],
                          headers=["prompt", "answer", "completion", "reward"]))
    if evaluation.trace_png:
        card.append(Markdown("## One denoising trace (blue: committed at that step; grey: still masked)"))
        card.append(Image(evaluation.trace_png, label="denoising trace"))


def summary_card(card: Any, summary: Mapping[str, Mapping[str, Any]]) -> None:
    """The end step's card: the four models' held-out numbers, pass@k and accuracy vs NFE."""
    passes = pass_keys(summary)
    card.append(Markdown("# Held-out summary"))
    card.append(Table([[row, *(f"{v.get(k, float('nan')):.4g}" for k in ("accuracy", "mean_reward", "nfe_per_token")),
                        str(v.get("n", "")), *(f"{v.get(k, float('nan')):.4g}" for k in passes),
                        trained_text(v) if "params_trained" in v else "—"]
                       for row, v in summary.items()],
                      headers=["model", "accuracy", "mean reward", "NFE/token", "n", *passes, "trained params"]))
    decodings, rows = curve_rows(summary)
    if rows:
        card.append(Markdown("## Accuracy @ NFE per token, by decoding"))
        card.append(Table([list[Any](cells) for cells in rows], headers=["model", *decodings]))
        picture = summary_curve_png(summary)
        if picture:
            card.append(Image(picture, label="accuracy vs NFE"))
