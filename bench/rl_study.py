"""A paired, multi-seed study of the post-training stages on a preset (default: `make run`'s).

For each seed: teacher and student SFT, OPD from that student, then GRPO from that OPD checkpoint
once per rollout mode — `threshold` (the preset's confidence-threshold decoding, whose trace
log-prob is a surrogate) and `random` (a parameter-free random commit order, one token per step,
whose trace log-prob is exact). Every model of a seed is evaluated on the same held-out problems
(greedy, the preset's `[eval]` decoding). Prints per-seed numbers, means and spreads, and the
paired gains; writes `bench/results/rl_study.json`, `bench/results/rl_study.png` and its section of
BENCHMARKS.md.

    python bench/rl_study.py [--config flows/configs/default.toml] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, preset_data, write_results, write_section  # noqa: E402

MODES = {"threshold": {}, "random": {"strategy": "random"}}  # [grpo] sampler overrides


def _config(base: dict, seed: int, output_dir: Path, grpo_sampler: dict):
    from bd_train.stages import parse_pipeline_config

    return parse_pipeline_config(preset_data(base, seed=seed, output_dir=output_dir, grpo={"sampler": grpo_sampler}))


def _metrics(result) -> dict[str, Any]:
    assert result.evaluation is not None, f"{result.stage} was not evaluated"
    return result.evaluation.metrics()


def run_seed(base: dict, seed: int, output_dir: Path) -> dict:
    from bd_train.stages import RunDir, run_grpo, run_opd, run_sft

    config = _config(base, seed, output_dir, {})
    where = RunDir.create(config, run_id=f"seed{seed}")
    teacher = run_sft(config, where, role="teacher")
    student = run_sft(config, where, role="student")
    opd = run_opd(config, where, teacher=teacher, student=student)
    row: dict[str, Any] = {name: _metrics(result) for name, result in
                           (("teacher", teacher), ("student_sft", student), ("student_opd", opd))}
    for mode, sampler in MODES.items():
        grpo_config = _config(base, seed, output_dir, sampler)
        grpo = run_grpo(grpo_config, RunDir.create(grpo_config, run_id=f"seed{seed}-{mode}"), start=opd)
        row[f"grpo_{mode}"] = _metrics(grpo)
        row[f"grpo_{mode}_reward_curve"] = [h["reward_mean"] for h in grpo.history if "reward_mean" in h]
    return row


def _stats(values) -> str:
    values = np.asarray(values, np.float64)
    return f"{values.mean():.3f} ± {values.std(ddof=1) if len(values) > 1 else 0.0:.3f}"


def report(rows: dict[int, dict], seconds: float) -> str:
    seeds = sorted(rows)
    acc = lambda name: [rows[s][name]["accuracy"] for s in seeds]  # noqa: E731
    lines = ["| model | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± sd |",
             "|---|" + "---|" * (len(seeds) + 1)]
    names = ["teacher", "student_sft", "student_opd"] + [f"grpo_{m}" for m in MODES]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{a:.3f}" for a in acc(name)) + f" | {_stats(acc(name))} |")
    gap = np.asarray(acc("teacher")) - np.asarray(acc("student_sft"))
    closed = (np.asarray(acc("student_opd")) - np.asarray(acc("student_sft"))) / np.where(gap == 0, np.nan, gap)
    lines += ["", f"OPD closes {_stats(closed)} of the teacher–student accuracy gap "
              f"(per seed: {', '.join(f'{c:.2f}' for c in closed)})."]
    for mode in MODES:
        gain = np.asarray(acc(f"grpo_{mode}")) - np.asarray(acc("student_opd"))
        lines.append(f"GRPO ({mode} rollouts) adds {_stats(gain)} accuracy over OPD "
                     f"(per seed: {', '.join(f'{g:+.3f}' for g in gain)}; "
                     f"{int((gain > 0).sum())}/{len(gain)} seeds improve).")
    lines.append(f"\n{len(seeds)} seeds, {seconds / 60:.0f} min in one process (a stage whose final checkpoint is "
                 "already in the output folder is restored and evaluated, not trained again). Held-out accuracy: "
                 "greedy threshold decoding on the preset's `[eval] n` problems, the same before and after each "
                 "stage.")
    return "\n".join(lines)


def plot(rows: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for mode, color in zip(MODES, ("tab:blue", "tab:orange")):
        for i, seed in enumerate(sorted(rows)):
            curve = rows[seed][f"grpo_{mode}_reward_curve"]
            ax.plot(np.arange(1, len(curve) + 1), curve, color=color, alpha=0.7,
                    label=f"{mode} rollouts" if i == 0 else None)
    ax.set_xlabel("logged GRPO step")
    ax.set_ylabel("rollout mean reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "flows" / "configs" / "default.toml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--output-dir", default=str(ROOT / "runs" / "rl_study"))
    args = parser.parse_args()
    base = tomllib.loads(Path(args.config).read_text())
    start = time.perf_counter()
    rows = {}
    for seed in args.seeds:
        rows[seed] = run_seed(base, seed, Path(args.output_dir))
        print(f"seed {seed}: " + ", ".join(f"{k} {v['accuracy']:.3f}" for k, v in rows[seed].items()
                                          if isinstance(v, dict)), flush=True)
    body = report(rows, time.perf_counter() - start)
    print(body)
    write_results("rl_study", {str(s): r for s, r in rows.items()})
    plot(rows, ROOT / "bench" / "results" / "rl_study.png")
    write_section("rl_study", f"## RL study: `{Path(args.config).name}`, paired over seeds\n\n{body}\n\n"
                  "![GRPO rollout reward](bench/results/rl_study.png)")


if __name__ == "__main__":
    main()
