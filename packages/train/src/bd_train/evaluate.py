"""Evaluate any checkpoint a bdlm stage wrote, or a Hugging Face checkpoint folder, on its own:

    python -m bd_train.evaluate --checkpoint runs/pipeline/<run>/checkpoints/grpo [--task NAME]
                                [--samples K] [--best-of logprob vote] [--n N] [--out results.json]
    python -m bd_train.evaluate --checkpoint <HF folder> --config <preset.toml> [...]

Reports greedy accuracy and mean reward, NFE per generated token, generated tokens per second
(timed after compilation), pass@k with the unbiased estimator (K samples per problem at the
rollout temperature, `[grpo] sampler`; `--samples 0`: none), best-of-K over those samples chosen without the reference
answer (`--best-of`: by the model's summed log-probs, or by majority vote; with the NFE of a
problem's K samples), and accuracy against NFE over decoding thresholds
(τ ∈ {0.5, 0.7, 0.9, 0.95} and one token per step) as a table, JSON and a plot. Greedy accuracy
comes with Wilson's 95% score interval (a proportion of independent problems), each pass@k with
a 95% percentile bootstrap interval over the problems (10,000 resamples of the per-problem
estimates, a fixed seed: the same checkpoint gives the same interval). The checkpoint's
own config (kept in its metadata) defines the tokenizer, canvas and eval split; for a Hugging Face
folder (config.json + safetensors) a preset does, with the folder as `[student] pretrained`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import jax

from bd_core import ConfigError, Fingerprint, is_repo_id
from bd_data import CanvasOverflow, JsonlError, TokenizerError
from bd_models import ModelConfig

from ._checkpoint import CheckpointError
from ._output_path import output_path_error
from .stages._compat import check_task_fits
from .stages._config import matmul_precision, parse_pipeline_config
from .stages._errors import CanvasTooSmall
from .stages._evaluate import evaluate_report, pass_at_k
from .stages._intervals import bootstrap_interval, wilson_interval
from .stages._plots import accuracy_nfe_png
from .stages._run import Run, StageError, open_checkpoints

__all__ = ["THRESHOLDS", "evaluate", "format_report", "load", "main", "pass_at_k"]

THRESHOLDS = (0.5, 0.7, 0.9, 0.95)
"""The confidence thresholds of the accuracy-against-NFE curve (then one token per step)."""


def load(checkpoint: str | Path, *, task: str | None = None, n: int | None = None,
         config: str | None = None) -> tuple[Run, Any]:
    """The run config a checkpoint was trained with (optionally another task or eval size) and its
    model; for a Hugging Face folder or Hub repo id, the preset `config` (TOML text) with it as the student."""
    hub = is_repo_id(checkpoint) and not Path(checkpoint).exists()
    if (Path(checkpoint) / "config.json").is_file() or hub:
        if config is None and hub:
            raise StageError(f"{checkpoint}: no such folder here; read as a Hub repo id it records no task or canvas: "
                             f"check the path, or pass --config <preset.toml> (e.g. flows/configs/pretrained.toml)")
        if config is None:
            raise StageError(f"{checkpoint} is a Hugging Face checkpoint folder, which records no task or canvas; "
                             f"pass --config <preset.toml> (e.g. flows/configs/pretrained.toml) to define them")
        import tomllib

        try:
            data = tomllib.loads(config)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"--config is not valid TOML: {err}") from None
        data["student"] = data["teacher"] = {"pretrained": str(checkpoint)}
        try:
            run = _checked(Run(parse_pipeline_config(_overridden(data, task, n))))
        except ConfigError as err:  # the checkpoint stands in for both roles: name the flag, not the keys
            message = str(err)
            for role in ("teacher", "student"):
                if message.startswith(f"{role}.pretrained: "):
                    raise ConfigError(f"--checkpoint {message.removeprefix(f'{role}.pretrained: ')}") from None
            raise ConfigError(_flag_error(err, task, "--config")) from None
        return run, run.pretrained_model("student")
    if config is not None:
        raise StageError(f"--config: {checkpoint} is a stage's checkpoint, which evaluates under the config it was "
                         f"trained with; --config is for a Hugging Face folder (--task and --n change what is "
                         f"evaluated)")
    with open_checkpoints(checkpoint, create=False) as checkpoints:
        try:
            meta = checkpoints.read_meta()
        except CheckpointError as err:
            raise StageError(str(err)) from None
    if not meta.get("config") or "identity" not in meta.get("fingerprints", {}):
        raise StageError(f"checkpoint {checkpoint} holds no pipeline config or model identity; evaluate checkpoints "
                         "written by a bdlm stage (runs/pipeline/<run>/checkpoints/<stage>)")
    try:
        run = _checked(Run(parse_pipeline_config(_held_out_only(_overridden(dict(meta["config"]), task, n)))))
    except (ConfigError, StageError) as err:
        kind = ConfigError if isinstance(err, ConfigError) else StageError
        raise kind(_flag_error(err, task, f"the config that checkpoint {checkpoint} recorded")) from None
    identity = Fingerprint.from_json(meta["fingerprints"]["identity"])
    # bd_models' default attention, which runs on every backend (a checkpoint trained with TPU's
    # splash kernels is evaluated on a GPU or CPU too)
    model_config = ModelConfig.from_dict(identity.fields["architecture"])
    return run, run.restore_model(checkpoint, model_config, identity, what=f"checkpoint {checkpoint}")


RECORDED = ("; its paths are as the run was given them, relative to the folder it was started in: run the command "
            "from that folder")


def _checked(run: Run) -> Run:
    """`run` with its tokenizer and task built and the held-out problems fitted to the canvas, now:
    a mistake is said before any decoding, by key."""
    try:
        _ = run.tokenizer
        if run.task is not None:
            check_task_fits(run, "eval", run.config.eval.n)
    except (TokenizerError, JsonlError, CanvasOverflow) as err:
        raise StageError(str(err)) from None
    return run


def _held_out_only(config: dict) -> dict:
    """The recorded config with the held-out JSONL standing in for a training file that is gone:
    evaluation reads only the held-out problems."""
    section = dict(config.get("task") or {})
    train, held_out = section.get("train_jsonl"), section.get("eval_jsonl")
    if held_out and not Path(held_out).is_file():  # the one file evaluation reads
        raise StageError(f"task.eval_jsonl: file {held_out!r} does not exist")
    if train and held_out and not Path(train).exists():
        config["task"] = {**section, "train_jsonl": held_out}
    return config


def _flag_error(err: Exception, task: str | None, where: str) -> str:
    """A config error named by what the user gave: `--task` for the task's keys and for a canvas
    too small for its problems when it was set; else `where`, with how recorded paths resolve
    when a path is what failed."""
    message = str(err)
    if task is not None and message.startswith(("task.", "task:")):
        return f"--task {task}: {message} (--task keeps the checkpoint's canvas and tokenizer, with the task's " \
               f"default params; a task that needs a file or other params needs a preset)"
    if task is not None and isinstance(err, CanvasTooSmall):
        return f"--task {task}: {err.finding}, the canvas this checkpoint was trained with; evaluate it on a task " \
               f"whose problems fit"
    path_problem = any(words in message for words in ("does not exist", "no such file", "cannot read"))
    return f"{where}: {message}" + (RECORDED if path_problem else "")


def _overridden(config: dict, task: str | None, n: int | None) -> dict:
    if task is not None:  # another task's data, prompted as the checkpoint was trained (its chat template)
        recorded = config.get("task", {})
        kept = {k: v for k, v in recorded.items()
                if k == "chat_template" or (k == "params" and recorded.get("name") == task)}
        config["task"] = {"name": task, **kept}
    if n is not None:
        section = config.get("eval", {})
        config["eval"] = {**section, "n": n, "batch_size": min(n, section.get("batch_size", n))}
    return config


def evaluate(checkpoint: str | Path, *, task: str | None = None, samples: int = 4, n: int | None = None,
             thresholds: tuple[float, ...] = THRESHOLDS, seed: int = 0, config: str | None = None,
             best_of: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every number of the module docstring for one checkpoint, as plain values (JSON-ready).
    `config`: a preset's TOML text, needed for a Hugging Face folder.

    Example:
        ```py
        from bd_train.evaluate import evaluate, format_report

        report = evaluate("runs/pipeline/<run-id>/checkpoints/grpo", samples=8)
        print(format_report(report))
        ```
    """
    run, model = load(checkpoint, task=task, n=n, config=config)
    with matmul_precision(run.config.run.matmul_precision):  # as the stages that made it
        result = evaluate_report(model, run, key=jax.random.key(seed), samples=samples, thresholds=thresholds,
                                 timed=True, best_of=best_of)
    metrics = result.metrics()
    per_problem = result.per_problem()
    correct = int(per_problem["accuracy"].sum())
    intervals = {"accuracy": wilson_interval(correct, result.n).to_dict(),
                 **{k: bootstrap_interval(per_problem[k]).to_dict() for k in result.pass_at_k}}
    section = run.config.task
    return {"checkpoint": str(checkpoint), "task": section.eval_jsonl or section.name, "n": result.n,
            "greedy": {k: v for k, v in metrics.items() if not k.startswith("pass@")},
            "samples_per_problem": samples, "pass_at_k": dict(result.pass_at_k), "intervals": intervals,
            "best_of": [b.to_dict() for b in result.best_of],
            "accuracy_vs_nfe": [dataclasses.asdict(p) for p in result.accuracy_vs_nfe]}


def format_report(report: dict[str, Any]) -> str:
    """The report of `evaluate` as the text the command prints."""
    greedy, intervals = report["greedy"], report["intervals"]

    def bounds(key: str) -> str:
        return f"[{intervals[key]['low']:.3f}, {intervals[key]['high']:.3f}]"

    lines = [f"{report['checkpoint']}: {report['task']}, {report['n']} held-out problems",
             f"greedy: accuracy {greedy['accuracy']:.3f} {bounds('accuracy')} (Wilson 95%), mean reward "
             f"{greedy['mean_reward']:.3f}, NFE/token {greedy['nfe_per_token']:.3f}",
             "  ".join(f"{k} {v:.3f} {bounds(k)}" for k, v in report["pass_at_k"].items())
             + f"  ({report['samples_per_problem']} samples per problem; bootstrap 95% over problems)"
             if report["pass_at_k"] else "no sampled rollouts (--samples 0): no pass@k",
             *(f"best-of-{b['n']} by {b['rule']}: accuracy {b['accuracy']:.3f} (pass@{b['n']} {b['pass_at_n']:.3f}), "
               f"{b['nfe_per_problem']:.1f} NFE per problem" for b in report.get("best_of", ())),
             f"{'decoding':<14} {'accuracy':>9} {'NFE/token':>10} {'tokens/s':>10}"]
    lines += [f"{p['decoding']:<14} {p['accuracy']:>9.3f} {p['nfe_per_token']:>10.3f} {p['tokens_per_second']:>10.0f}"
              for p in report["accuracy_vs_nfe"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line: `python -m bd_train.evaluate --checkpoint ...`; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m bd_train.evaluate", description=__doc__.splitlines()[0]
                                     if __doc__ else None)
    parser.add_argument("--checkpoint", required=True,
                        help="a stage's checkpoint folder (its latest step is used), or a Hugging Face folder")
    parser.add_argument("--config", help="a preset TOML with task, canvas and tokenizer (for a Hugging Face folder)")
    parser.add_argument("--task", help="evaluate on this built-in task instead of the checkpoint's own")
    parser.add_argument("--samples", type=int, default=4,
                        help="samples per problem for pass@k (default 4; 0: greedy decoding and the curve only)")
    parser.add_argument("--best-of", nargs="+", default=[], choices=("logprob", "vote"),
                        help="also best-of-K over the K samples, chosen by the model's summed log-probs or by vote")
    parser.add_argument("--n", type=int, help="held-out problems (default: the checkpoint's [eval] n)")
    parser.add_argument("--out", help="write the results as JSON here, and the accuracy-vs-NFE plot beside it")
    args = parser.parse_args(argv)
    if args.samples < 0 or (args.n is not None and args.n < 1):
        parser.error("--samples must be at least 0 (0: no sampling, as [eval] samples = 0) and --n at least 1")
    if args.best_of and not args.samples:
        parser.error("--best-of chooses among the --samples rollouts: give --samples 1 or more")
    if args.out:  # checked now: the results come after the whole evaluation
        out = Path(args.out)
        if out.with_suffix(".png") == out:
            parser.error(f"--out {args.out}: the plot is written beside the JSON with the suffix .png, so the two "
                         f"would be one file; give a .json path")
        if error := output_path_error("--out", args.out, "results.json"):
            parser.error(error)
    try:
        preset = None if args.config is None else Path(args.config).read_text()
    except OSError as err:
        print(f"bd_train.evaluate: cannot read --config: {err}", file=sys.stderr)
        return 2
    try:
        report = evaluate(args.checkpoint, task=args.task, samples=args.samples, n=args.n, config=preset,
                          best_of=tuple(dict.fromkeys(args.best_of)))
    except (StageError, ConfigError, CanvasOverflow, JsonlError, TokenizerError) as err:
        print(f"bd_train.evaluate: {err}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps(report, indent=2))
        out.with_suffix(".png").write_bytes(accuracy_nfe_png({str(args.checkpoint): report["accuracy_vs_nfe"]},
                                                                 title="accuracy vs NFE"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
