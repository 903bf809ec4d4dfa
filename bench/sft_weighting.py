"""SFT trial that picks the default loss weighting and t range: same student, same steps, four settings.

Trains the student-size decoder on a built-in task under each corruption setting (weighting x
t-range) and measures exact-match accuracy of greedy threshold decoding on held-out prompts every
`--eval-every` steps, plus the training loss and a held-out masked-token CE under one fixed reference
corruption (the training losses of `elbo` and `none` are different estimators, so only that CE
compares across settings). One seed. Writes bench/results/sft_weighting.json and its BENCHMARKS.md
section.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from typing import Any, cast

import equinox as eqx
import jax
import numpy as np
from _report import results_path, write_results, write_section

from bd_data import (
    ByteTokenizer,
    CanvasConfig,
    CorruptionConfig,
    PromptBatch,
    get_task,
    iterate,
    prompt_dataset,
    sft_dataset,
)
from bd_models import BlockDiffusionLM, ModelConfig, SamplerConfig, SamplingDistribution, sample
from bd_train import OptimizerConfig, Trainer, TrainerConfig, make_optimizer, sft_objective

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = results_path("sft_weighting")

SETTINGS = {  # name -> (weighting, t_min, t_max)
    "none_0.1_1.0": ("none", 0.1, 1.0),
    "elbo_0.001_1.0": ("elbo", 1e-3, 1.0),
    "elbo_0.3_0.8": ("elbo", 0.3, 0.8),
    "none_0.3_0.8": ("none", 0.3, 0.8),
}
NOTES = {
    "none_0.1_1.0": "current default",
    "elbo_0.001_1.0": "textbook NELBO",
    "elbo_0.3_0.8": "BD3-LM clipped",
    "none_0.3_0.8": "",
}
CANVAS = CanvasConfig(prompt_len=8, max_new_tokens=8, block_size=4)
# The held-out CE is measured under one corruption for every setting so the numbers compare.
REFERENCE_CORRUPTION = CorruptionConfig(t_min=0.1, t_max=1.0, weighting="none")
BATCH = 128


def student_config(tok: ByteTokenizer) -> ModelConfig:
    # T = 24 tokens: one 64-token tile, so the blocked kernel would only add overhead.
    return ModelConfig(vocab_size=tok.vocab_size, d_model=48, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=192,
                       block_size=CANVAS.block_size, attention="dense")


def param_count(model) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array)))


class Evaluator:
    """Exact match of greedy threshold decoding on a fixed set of eval prompts, and held-out CE."""

    def __init__(self, task, tok: ByteTokenizer, n: int, trainer: Trainer, seed: int):
        self.task, self.tok, self.trainer = task, tok, trainer
        source = task.dataset("eval")
        self.examples = [source[i] for i in range(n)]
        prompts = prompt_dataset(self.examples, tok, CANVAS, seed=0, batch_size=n, shard_index=0, shard_count=1,
                                 shuffle=False, num_epochs=1, drop_remainder=False)
        self.prompts = cast(PromptBatch, prompts[0])
        self.sampler = SamplerConfig(block_size=CANVAS.block_size, max_new_tokens=CANVAS.max_new_tokens,
                                     mask_id=tok.mask_id, pad_id=tok.pad_id, strategy="threshold",
                                     distribution=SamplingDistribution(temperature=0.0),
                                     threshold=0.9, stop_ids=(tok.eos_id,))
        ce_data = sft_dataset(self.examples, tok, CANVAS, REFERENCE_CORRUPTION, seed=seed + 1,
                              batch_size=min(BATCH, n), shard_index=0, shard_count=1, shuffle=False, num_epochs=1)
        self.ce_batches = [ce_data[i] for i in range(len(ce_data))]
        self.key = jax.random.key(seed)

    def __call__(self, model) -> dict[str, float]:
        rollout = sample(model, (self.prompts.tokens, self.prompts.valid), self.sampler, key=self.key)
        tokens, valid = np.asarray(rollout.completion_tokens), np.asarray(rollout.completion_valid)
        texts = [self.tok.decode(row[ok].tolist(), stop_at_eos=True) for row, ok in zip(tokens, valid)]
        rewards = np.asarray([self.task.reward(ex, text) for ex, text in zip(self.examples, texts)])
        generated = max(1, int(valid.sum()))
        return {"acc": float(np.mean(rewards == 1.0)), "mean_reward": float(rewards.mean()),
                "nfe_per_token": float(np.asarray(rollout.nfe).sum() / generated),
                "heldout_ce": self.heldout_ce(model)}

    def heldout_ce(self, model) -> float:
        """Masked-token CE on the eval sequences under the one fixed reference corruption."""
        return float(self.trainer.evaluate(model, self.ce_batches, key=self.key)["ce"])


def run_setting(task, tok, name: str, *, steps: int, eval_every: int, eval_n: int, seed: int) -> dict[str, float]:
    weighting, t_min, t_max = SETTINGS[name]
    corruption = CorruptionConfig(t_min=t_min, t_max=t_max, weighting=cast(Any, weighting))
    model_key, train_key = jax.random.split(jax.random.key(seed))
    model = BlockDiffusionLM(student_config(tok), key=model_key)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=3e-3, schedule="cosine", warmup_steps=20,
                                               total_steps=steps, end_lr_ratio=0.1, weight_decay=0.0,
                                               max_grad_norm=1.0))
    trainer = Trainer(sft_objective, optimizer, TrainerConfig())
    state = trainer.init(model, key=train_key)
    data = iterate(sft_dataset(task.dataset("train"), tok, CANVAS, corruption, seed=seed, batch_size=BATCH,
                               shard_index=0, shard_count=1))
    evaluator = Evaluator(task, tok, eval_n, trainer, seed)

    out: dict[str, float] = {"params": float(param_count(model))}
    pending: list[dict] = []
    train_seconds = 0.0
    for step in range(1, steps + 1):
        batch = next(data)
        start = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        if step == 1 or step % eval_every == 0 or step == steps:
            jax.block_until_ready(state)
        if step == 1:  # compile + first step, kept out of the training time
            out["compile_s"] = time.perf_counter() - start
        else:
            train_seconds += time.perf_counter() - start
        pending.append({k: metrics[k] for k in ("loss", "ce", "grad_norm", "nonfinite")})
        if step % eval_every == 0 or step == steps:
            window = {k: float(np.mean([float(m[k]) for m in pending])) for k in pending[0]}
            pending.clear()
            scores = evaluator(state.model)
            for key, value in {**scores, "train_loss": window["loss"], "train_ce": window["ce"],
                               "grad_norm": window["grad_norm"]}.items():
                out[f"{key}_step_{step}"] = value
            out["nonfinite_total"] = float(state.nonfinite_total)
            print(f"  {name:15s} step {step:5d}  acc {scores['acc']:.3f}  heldout CE {scores['heldout_ce']:.3f}  "
                  f"train loss {window['loss']:.3f}  train CE {window['ce']:.3f}  |g| {window['grad_norm']:.2f}  "
                  f"({train_seconds:.0f} s)", flush=True)
    out["train_s"] = train_seconds
    out["step_s"] = train_seconds / max(1, steps - 1)
    return out


def mean_acc(results: dict[str, float], task: str, name: str, points: list[int]) -> float:
    """Accuracy averaged over the eval points: the area under the learning curve, our 'learns fastest'."""
    return float(np.mean([results[f"{task}.{name}.acc_step_{s}"] for s in points]))


def run_title(run: str) -> str:
    task, _, seed = run.partition("@")
    return f"**{task}** (length 6)" + (f", {seed.replace('seed', 'seed ')}" if seed else "")


def write_markdown(results: dict[str, float]) -> None:
    runs, names, points, command = contents(results)
    seed, last = int(results["seed"]), points[-1]
    extra = sorted({run.split("@seed")[1] for run in runs if "@seed" in run}, key=int)
    seeds = f"seed {seed}" + (f"; {runs[0].split('@')[0]} is repeated with seeds {', '.join(extra)} to show how "
                              f"much of a gap is seed noise" if extra else " only (differences of a few points "
                              "may be noise)")
    params = next(iter(results[k] for k in results if k.endswith(".params")))
    lines = [
        "## SFT loss weighting and t range (`bench/sft_weighting.py`)",
        "",
        f"Student decoder (d_model 48, 2 layers, 4 heads, SwiGLU d_ff 192, {int(params):,} parameters), byte "
        f"tokenizer, canvas prompt 8 + 8 new tokens, block 4, batch {BATCH}, AdamW lr 3e-3 (warmup 20, cosine to "
        f"0.1x, clip 1.0), {last} steps per setting, float32; {seeds}. "
        f"Accuracy = exact match of greedy threshold decoding (τ 0.9) on the first {int(results['eval_n'])} "
        f"held-out eval-split prompts; mean acc (the mean over the eval points, i.e. the area under the learning "
        f"curve) ranks how fast a setting learns. Train loss is the objective's own mean over the last {points[0]} "
        f"steps: `elbo` and `none` are different estimators, so compare the held-out CE instead (masked-token CE "
        f"on the eval prompts under one fixed corruption, `none` t ~ U[0.1, 1]). Train s: steps 2..{last} without "
        f"compile or evaluation, on a shared 2-core CPU (noisy; every setting costs the same per step).",
        "",
    ]
    for run in runs:
        lines += [run_title(run), "",
                  "| setting | " + " | ".join(f"acc @ {s}" for s in points)
                  + f" | mean acc | held-out CE @ {last} | train loss @ {last} | train s |",
                  "|---|" + "---|" * (len(points) + 4)]
        for name in names:
            p = f"{run}.{name}."
            row = label(name) + (f" ({NOTES[name]})" if NOTES[name] else "")
            accs = " | ".join(f"{results[p + f'acc_step_{s}']:.1%}" for s in points)
            lines.append(f"| {row} | {accs} | {mean_acc(results, run, name, points):.1%} | "
                         f"{results[p + f'heldout_ce_step_{last}']:.3f} | "
                         f"{results[p + f'train_loss_step_{last}']:.3f} | {results[p + 'train_s']:.0f} |")
        lines.append("")
    lines += ["Conclusion: " + conclusion(results, runs, names, points), "", "Command (then `--render` "
              "rewrites this section from the JSON):", "", "```", command, "```"]
    write_section("sft_weighting", "\n".join(lines))


def label(name: str, sep: str = ", ") -> str:
    weighting, t_min, t_max = SETTINGS[name]
    return f"`{weighting}`{sep}t ~ U[{t_min:g}, {t_max:g}]"


def short(name: str) -> str:
    return label(name, sep=" ")


def conclusion(results, runs, names, points, tie: float = 0.01) -> str:
    """Filled from the numbers so that a rerun cannot leave a stale verdict behind. Settings whose mean
    accuracy is within `tie` of the best are reported as tied. The recommendation averages the first
    task's runs over its seeds."""
    parts = []
    for run in runs:
        curve = {n: mean_acc(results, run, n, points) for n in names}
        ranked = sorted(names, key=lambda n: curve[n], reverse=True)
        best = ranked[0]
        tied = [n for n in ranked[1:] if curve[best] - curve[n] < tie]
        order = "; ".join(f"{short(n)} {curve[n]:.1%} mean, {results[f'{run}.{n}.acc_step_{points[-1]}']:.1%} "
                          f"final" for n in ranked)
        verdict = f"On {run.replace('@', ' ').replace('seed', 'seed ')}, {short(best)} learned fastest"
        if tied:
            verdict += " (tied within 1 point with " + ", ".join(short(n) for n in tied) + ")"
        parts.append(f"{verdict}: {order}.")
    task = runs[0].split("@")[0]
    primary = [run for run in runs if run.split("@")[0] == task]
    over_seeds = {n: float(np.mean([mean_acc(results, run, n, points) for run in primary])) for n in names}
    ranked = sorted(names, key=lambda n: over_seeds[n], reverse=True)
    parts.append(f"Mean acc on {task} averaged over its {len(primary)} seed(s): "
                 + "; ".join(f"{short(n)} {over_seeds[n]:.1%}" for n in ranked) + ". "
                 f"The default corruption should be the fastest setting on {task}, the task the pipeline trains by "
                 f"default: {short(ranked[0])}.")
    primary_best = max(results[f"{task}.{n}.acc_step_{points[-1]}"] for n in names)
    for other in [run for run in runs if run.split("@")[0] != task]:
        reached = [s for s in points if max(results[f"{other}.{n}.acc_step_{s}"] for n in names) >= 0.99]
        if reached and primary_best < 0.99:
            parts.append(f"{other.capitalize()} saturates (≥ 99% by step {reached[0]}) while {task} is at most "
                         f"{primary_best:.0%} at step {points[-1]}, so {task} is the task that leaves headroom for "
                         f"distillation and RL: it stays the default task.")
    return " ".join(parts)


def contents(results: dict[str, float]) -> tuple[list[str], list[str], list[int], str]:
    """Runs (`task` for the main seed, `task@seedN` for confirmation seeds), settings, eval steps and the
    reproducing command, read back from a flat results dict."""
    # Keys are `run.setting.metric`; setting names contain dots themselves.
    keys = [(k.split(".", 1)[0], k.split(".", 1)[1].rsplit(".", 1)) for k in results if k.count(".") >= 2]
    runs = list(dict.fromkeys(run for run, _ in keys))
    names = [n for n in SETTINGS if any(name == n for _, (name, _) in keys)]
    points = sorted({int(metric.rsplit("_", 1)[1]) for _, (_, metric) in keys if metric.startswith("acc_step_")})
    tasks = [run for run in runs if "@" not in run]
    extra = [run.split("@seed")[1] for run in runs if "@seed" in run]
    command = (f"python bench/sft_weighting.py --steps {int(results['steps'])} --eval-every "
               f"{int(results['eval_every'])} --eval-n {int(results['eval_n'])} --tasks {','.join(tasks)} "
               f"--settings {','.join(names)} --seed {int(results['seed'])}"
               + (f" --confirm-seeds {','.join(extra)}" if extra else ""))
    return runs, names, points, command


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per setting (default 400)")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between evaluations (default 100)")
    parser.add_argument("--eval-n", type=int, default=256, help="held-out prompts per evaluation (default 256)")
    parser.add_argument("--tasks", default="argsort,sort", help="comma-separated tasks, each with length 6; the "
                        "first one picks the recommended default")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated subset of {list(SETTINGS)}")
    parser.add_argument("--seed", type=int, default=0, help="seed of every task's run (model init, data order, "
                        "corruption)")
    parser.add_argument("--confirm-seeds", default="1,2", help="comma-separated extra seeds, run on the first task "
                        "only (default: 1,2; empty for none)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave the JSON and BENCHMARKS.md alone")
    parser.add_argument("--render", action="store_true",
                        help="train nothing: rewrite the BENCHMARKS.md section from bench/results/sft_weighting.json")
    args = parser.parse_args()
    if args.render:
        if not RESULTS.exists():
            parser.error(f"--render: {RESULTS.relative_to(ROOT)} does not exist; run without --render first")
        results = json.loads(RESULTS.read_text())
        write_markdown(results)
        print(conclusion(results, *contents(results)[:3]))
        return
    tasks = [t for t in args.tasks.split(",") if t]
    names = [n for n in args.settings.split(",") if n]
    unknown = sorted(set(names) - set(SETTINGS))
    if not tasks or not names:
        parser.error("--tasks and --settings must each name at least one entry")
    if unknown:
        parser.error(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
    try:
        extra_seeds = [int(x) for x in args.confirm_seeds.split(",") if x]
    except ValueError:
        parser.error(f"--confirm-seeds: expected comma-separated ints, got {args.confirm_seeds!r}")
    if args.seed in extra_seeds:
        parser.error(f"--confirm-seeds: {args.seed} is already the main --seed")
    if args.steps <= 20:
        parser.error(f"--steps: must exceed the 20 warmup steps, got {args.steps}")
    if args.eval_every < 1 or args.eval_n < 1:
        parser.error("--eval-every and --eval-n must be >= 1")

    tok = ByteTokenizer()
    results: dict[str, float] = {"steps": float(args.steps), "eval_every": float(args.eval_every),
                                 "eval_n": float(args.eval_n), "seed": float(args.seed)}
    plan = [(task, args.seed, task) for task in tasks] + [(tasks[0], s, f"{tasks[0]}@seed{s}") for s in extra_seeds]
    for task_name, seed, run in plan:
        task = get_task(task_name, length=6)
        print(f"{run}:", flush=True)
        for name in names:
            for key, value in run_setting(task, tok, name, steps=args.steps, eval_every=args.eval_every,
                                          eval_n=args.eval_n, seed=seed).items():
                results[f"{run}.{name}.{key}"] = value
    if args.no_write:
        print(json.dumps(results, indent=2, sort_keys=True))
    else:
        write_results("sft_weighting", results)
        write_markdown(results)
    print(conclusion(results, *contents(results)[:3]))


if __name__ == "__main__":
    main()
