"""Metaflow card contents for the pipeline: each stage's curves, held-out eval, sample
completions and one denoising trace; the end step's summary table."""

from collections.abc import Mapping
from typing import Any

from bd_train.stages import StageResult
from metaflow.cards import Image, Markdown, Table


def stage_card(card: Any, result: StageResult) -> None:
    """Fill a Metaflow card (`current.card[...]`) with the stage's curves, eval, samples and trace."""
    card.append(Markdown(f"# {result.stage}\ncheckpoint `{result.checkpoint_dir}` at step {result.step}"))
    if result.curves_png:
        card.append(Image(result.curves_png, label="training curves"))
    if result.evaluation:
        card.append(Markdown("## Held-out evaluation"))
        card.append(Table([[k, f"{v:.4g}" if isinstance(v, float) else str(v)] for k, v in result.evaluation.items()],
                          headers=["metric", "value"]))
    if result.samples:
        card.append(Markdown("## Sample completions"))
        card.append(Table([[s["prompt"], s["answer"], s["completion"], f"{s['reward']:.2f}"] for s in result.samples],
                          headers=["prompt", "answer", "completion", "reward"]))
    if result.trace_png:
        card.append(Markdown("## One denoising trace (blue: committed at that step; grey: still masked)"))
        card.append(Image(result.trace_png, label="denoising trace"))


def summary_card(card: Any, summary: Mapping[str, Mapping[str, Any]]) -> None:
    card.append(Markdown("# Held-out summary"))
    card.append(Table([[row, *(f"{v.get(k, float('nan')):.4g}" for k in ("accuracy", "mean_reward", "nfe_per_token")),
                        str(v.get("n", ""))] for row, v in summary.items()],
                      headers=["model", "accuracy", "mean reward", "NFE/token", "n"]))
