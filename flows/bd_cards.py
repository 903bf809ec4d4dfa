"""Metaflow card contents for the pipeline: each stage's curves, held-out eval, sample
completions and one denoising trace; the end step's summary table."""

from collections.abc import Mapping
from typing import Any

from metaflow.cards import Image, Markdown, Table

from bd_train.stages import StageResult


def stage_card(card: Any, result: StageResult) -> None:
    """Fill a Metaflow card (`current.card[...]`) with the stage's curves, eval, samples and trace."""
    card.append(Markdown(f"# {result.stage}\ncheckpoint `{result.checkpoint_dir}` at step {result.step}"))
    if result.curves_png:
        card.append(Image(result.curves_png, label="training curves"))
    evaluation = result.evaluation
    if evaluation is None:
        return
    card.append(Markdown("## Held-out evaluation"))
    card.append(Table([[k, f"{v:.4g}" if isinstance(v, float) else str(v)] for k, v in evaluation.metrics().items()],
                      headers=["metric", "value"]))
    if evaluation.samples:
        card.append(Markdown("## Sample completions"))
        card.append(Table([[s.prompt, s.answer, s.completion, f"{s.reward:.2f}"] for s in evaluation.samples],
                          headers=["prompt", "answer", "completion", "reward"]))
    if evaluation.trace_png:
        card.append(Markdown("## One denoising trace (blue: committed at that step; grey: still masked)"))
        card.append(Image(evaluation.trace_png, label="denoising trace"))


def summary_card(card: Any, summary: Mapping[str, Mapping[str, Any]]) -> None:
    card.append(Markdown("# Held-out summary"))
    card.append(Table([[row, *(f"{v.get(k, float('nan')):.4g}" for k in ("accuracy", "mean_reward", "nfe_per_token")),
                        str(v.get("n", ""))] for row, v in summary.items()],
                      headers=["model", "accuracy", "mean reward", "NFE/token", "n"]))
