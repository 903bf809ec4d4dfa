"""What several noisy views per clean sequence buy: held-out loss against training wall-clock.

`CorruptionConfig.views = K` packs K independent corruptions of each sequence beside its one clean
stream, so a step pays for the clean stream once and learns from K noise draws. The same student as
`bench/sft_weighting.py` (argsort, length 6) trains under each (views, batch) setting for the same
wall-clock budget at a constant learning rate; the held-out masked-token CE (one fixed one-view
corruption of eval-split sequences, the same for every setting) is read at fixed points of training
time, and greedy exact-match accuracy at the end. Seeds run interleaved (every setting of seed s, then
seed s + 1), so load on the shared CPU falls on every setting alike. Writes
bench/results/noisy_views.json and its BENCHMARKS.md section.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
from _report import results_path, write_results, write_section
from sft_weighting import CANVAS, Evaluator, student_config

from bd_data import ByteTokenizer, CorruptionConfig, get_task, iterate, sft_dataset
from bd_models import BlockDiffusionLM
from bd_train import OptimizerConfig, Trainer, TrainerConfig, make_optimizer, sft_objective

SETTINGS = {  # name -> (views, clean sequences per step)
    "1x128": (1, 128),
    "1x32": (1, 32),
    "2x32": (2, 32),
    "4x32": (4, 32),
    "4x128": (4, 128),
}
NOTES = {"1x128": "the default", "1x32": "a quarter of the batch", "2x32": "", "4x32": "the default's noisy tokens",
         "4x128": "the default's clean batch"}


def run_setting(task, tok, name: str, *, points: list[float], eval_n: int, seed: int) -> dict:
    views, batch = SETTINGS[name]
    model_key, train_key = jax.random.split(jax.random.key(seed))
    model = BlockDiffusionLM(student_config(tok), key=model_key)
    # Constant after warmup: the number of steps a budget buys differs between settings.
    optimizer = make_optimizer(OptimizerConfig(learning_rate=3e-3, schedule="constant", warmup_steps=20,
                                               weight_decay=0.0, max_grad_norm=1.0))
    trainer = Trainer(sft_objective, optimizer, TrainerConfig())
    state = trainer.init(model, key=train_key)
    corruption = CorruptionConfig(views=views)
    data = iterate(sft_dataset(task.dataset("train"), tok, CANVAS, corruption, seed=seed, batch_size=batch,
                               shard_index=0, shard_count=1))
    evaluator = Evaluator(task, tok, eval_n, trainer, seed)

    state, _ = trainer.step(state, next(data))  # compile; not counted
    jax.block_until_ready(state)
    out: dict[str, float] = {}
    seconds, steps, pending = 0.0, 0, list(points)
    while pending:
        batch_data = next(data)
        start = time.perf_counter()
        state, _ = trainer.step(state, batch_data)
        jax.block_until_ready(state)
        seconds += time.perf_counter() - start
        steps += 1
        while pending and seconds >= pending[0]:
            point = pending.pop(0)
            out[f"ce_at_{point:g}s"] = evaluator.heldout_ce(state.model)
            out[f"steps_at_{point:g}s"] = float(steps)
    scores = evaluator(state.model)
    out.update(acc=scores["acc"], steps=float(steps), step_s=seconds / steps)
    print(f"  seed {seed} {name:6s} {steps:5d} steps ({out['step_s'] * 1e3:.0f} ms each)  held-out CE "
          + " ".join(f"{out[f'ce_at_{p:g}s']:.3f}" for p in points) + f"  acc {scores['acc']:.1%}", flush=True)
    return out


def write_markdown(results: dict, names: list[str], seeds: list[int], points: list[float]) -> None:
    def cell(name: str, metric: str, fmt: str) -> str:
        values = np.asarray([results[f"seed{s}.{name}.{metric}"] for s in seeds])
        return f"{values.mean():{fmt}} ± {values.std():{fmt}}"

    base = names[0]
    lines = [
        "## Several noisy views per clean sequence (`bench/noisy_views.py`)",
        "",
        f"The `bench/sft_weighting.py` student (argsort, length 6, canvas 8 + 8, block 4, `none` weighting, t ~ "
        f"U[0.1, 1]) trained for {points[-1]:g} s of step time under each setting, AdamW at a constant 3e-3 after "
        f"20 warmup steps; mean ± std over seeds {', '.join(map(str, seeds))} (run interleaved). Held-out CE: "
        f"masked-token CE of {int(results['eval_n'])} eval-split sequences under one fixed one-view corruption, "
        f"read when the training time passes each point. A setting `KxB` packs K noisy views of each of B clean "
        f"sequences per step (`[sft.corruption] views = K`, `[sft] batch_size = B`).",
        "",
        "| setting | ms per step | steps in budget | " + " | ".join(f"held-out CE @ {p:g} s" for p in points)
        + " | final greedy acc | CE @ end vs default, per seed |",
        "|---|---|---|" + "---|" * len(points) + "---|---|",
    ]
    last = f"ce_at_{points[-1]:g}s"
    for name in names:
        views, batch = SETTINGS[name]
        ratio = " ".join(f"{results[f'seed{s}.{name}.{last}'] / results[f'seed{s}.{base}.{last}']:.2f}"
                         for s in seeds)
        step_ms = np.mean([results[f"seed{s}.{name}.step_s"] for s in seeds]) * 1e3
        note = f" ({NOTES[name]})" if NOTES[name] else ""
        lines.append(f"| {views} view{'s' if views > 1 else ''} x {batch}{note} | {step_ms:.0f} | "
                     f"{cell(name, 'steps', '.0f')} | "
                     + " | ".join(cell(name, f"ce_at_{p:g}s", ".3f") for p in points)
                     + f" | {cell(name, 'acc', '.1%')} | {ratio} |")
    lines += ["", conclusion(results, names, seeds, last), "", "Command:", "", "```",
              f"python bench/noisy_views.py --budget {points[-1]:g} --seeds "
              f"{','.join(map(str, seeds))} --settings {','.join(names)}", "```"]
    write_section("noisy_views", "\n".join(lines))


def conclusion(results: dict, names: list[str], seeds: list[int], last: str) -> str:
    """Each multi-view setting against the one-view setting of the same clean batch, per seed:
    filled from the numbers, so a rerun cannot leave a stale verdict behind."""
    parts = []
    for name in names:
        views, batch = SETTINGS[name]
        single = next((n for n in names if SETTINGS[n] == (1, batch)), None)
        if views == 1 or single is None:
            continue
        ce = lambda n, s: results[f"seed{s}.{n}.{last}"]  # noqa: E731
        wins = sum(ce(name, s) < ce(single, s) for s in seeds)
        cost = np.mean([results[f"seed{s}.{name}.step_s"] / results[f"seed{s}.{single}.step_s"] for s in seeds])
        parts.append(f"{views} views x {batch} against 1 view x {batch}: a step costs {cost:.2f}x, and the held-out "
                     f"CE at the end of the budget is lower on {wins} of {len(seeds)} seeds ("
                     + ", ".join(f"{ce(name, s):.3f} vs {ce(single, s):.3f}" for s in seeds) + ").")
    best = min(names, key=lambda n: np.mean([results[f"seed{s}.{n}.{last}"] for s in seeds]))
    views, batch = SETTINGS[best]
    parts.append(f"Lowest mean held-out CE at the end: {views} view{'s' if views > 1 else ''} x {batch}.")
    return " ".join(parts)


def read_back(results: dict) -> tuple[list[str], list[int], list[float]]:
    """Settings, seeds and read-out points of a results file, in run order."""
    keys = [k.split(".") for k in results if k.startswith("seed")]
    seeds = list(dict.fromkeys(int(k[0].removeprefix("seed")) for k in keys))
    names = [n for n in SETTINGS if any(k[1] == n for k in keys)]
    points = sorted({float(k[2].removeprefix("ce_at_").removesuffix("s")) for k in keys if k[2].startswith("ce_at_")})
    return names, seeds, points


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--budget", type=float, default=40.0, help="seconds of step time per setting (default 40)")
    parser.add_argument("--points", type=int, default=4, help="evenly spaced CE read-outs in the budget (default 4)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated subset of {list(SETTINGS)}; "
                        "the first is the reference of the per-seed ratio")
    parser.add_argument("--eval-n", type=int, default=256, help="held-out sequences (default 256)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--render", action="store_true", help="train nothing: rewrite the BENCHMARKS.md section "
                        "from bench/results/noisy_views.json")
    args = parser.parse_args()
    if args.render:
        results = json.loads(results_path("noisy_views").read_text())
        write_markdown(results, *read_back(results))
        return
    names = [n for n in args.settings.split(",") if n]
    if not names or set(names) - set(SETTINGS):
        parser.error(f"--settings: expected a comma-separated subset of {list(SETTINGS)}, got {args.settings!r}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--seeds: expected comma-separated ints, got {args.seeds!r}")
    if not seeds or args.budget <= 0 or args.points < 1:
        parser.error("--seeds must name a seed, --budget must be > 0 and --points >= 1")
    points = [args.budget * (i + 1) / args.points for i in range(args.points)]

    tok, task = ByteTokenizer(), get_task("argsort", length=6)
    results: dict[str, float] = {"eval_n": float(args.eval_n), "budget": args.budget}
    for seed in seeds:
        for name in names:
            for key, value in run_setting(task, tok, name, points=points, eval_n=args.eval_n, seed=seed).items():
                results[f"seed{seed}.{name}.{key}"] = value
    if not args.no_write:
        write_results("noisy_views", results)
        write_markdown(results, names, seeds, points)


if __name__ == "__main__":
    main()
