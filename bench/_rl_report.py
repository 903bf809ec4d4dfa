"""The RL study's report: tables, the figure and the BENCHMARKS.md section, from the curve points
`bench/rl_study.py` keeps on disk (paired over the same held-out problems, mean ± sd over seeds)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from _report import ROOT, write_section
from rl_study import ARMS, STUDIES


def paired(after: dict, before: dict, key: str = "accuracy") -> tuple[float, float]:
    """The change over the same problems (greedy accuracy, or pass@1 from the correct-sample
    counts) and its paired standard error."""
    if key == "accuracy":
        a, b = (np.asarray(e["rewards"]) == 1.0 for e in (after, before))
    else:
        a, b = (np.asarray([int(c) for c in e["correct_samples"]]) / 4 for e in (after, before))
    d = a.astype(np.float64) - b
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))


def _mean_sd(values) -> str:
    values = np.asarray(values, np.float64)
    sd = values.std(ddof=1) if len(values) > 1 else 0.0
    return f"{100 * values.mean():+.1f} ± {100 * sd:.1f}"


def collect(results: Path) -> dict[str, dict[str, dict[int, dict]]]:
    """{study: {name: {seed: record}}} of everything on disk (arms, `base`, `ascent_*`)."""
    out: dict[str, dict[str, dict[int, dict]]] = {}
    for path in sorted(results.glob("*/seed*/*.json")):
        study, seed, name = path.parent.parent.name, int(path.parent.name.removeprefix("seed")), path.stem
        out.setdefault(study, {}).setdefault(name, {})[seed] = json.loads(path.read_text())
    return out


def _point(record: dict, updates: int) -> dict | None:
    return next((p for p in record.get("points", []) if p["updates"] == updates), None)


def curve_table(arms: dict, base: dict, seeds: list[int]) -> list[str]:
    points = sorted({p["updates"] for name, per in arms.items() if name in ARMS
                     for r in per.values() for p in r["points"] if p["updates"] > 0})
    lines = ["| arm | from | updates | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± sd | pass@1 mean ± sd |",
             "|---|---|---|" + "---|" * (len(seeds) + 2)]
    for name in [n for n in ARMS if n in arms]:
        arm, per = ARMS[name], arms[name]
        for u in points:
            row, gains, pgains, steps = [], [], [], set()
            for s in seeds:
                p = _point(per.get(s, {}), u)
                if p is None:
                    row.append("—")
                    continue
                steps.add(p.get("steps"))
                g, se = paired(p["evaluation"], base[s][arm.start]["evaluation"])
                gains.append(g)
                pgains.append(paired(p["evaluation"], base[s][arm.start]["evaluation"], "pass@1")[0])
                row.append(f"{100 * g:+.1f} ± {100 * se:.1f}")
            if gains:
                label = f"{u}" if arm.matches is None else f"≙ {u} ({'/'.join(map(str, sorted(steps)))} steps)"
                lines.append(f"| {name} | {arm.start} | {label} | " + " | ".join(row)
                             + f" | {_mean_sd(gains)} ({len(gains)}) | {_mean_sd(pgains)} |")
    return lines


def dynamics_table(arms: dict, seeds: list[int]) -> list[str]:
    lines = ["| arm | seed | rollout reward, first → last 16 updates | entropy, first → last | "
             "gradient cosine of two batches, at updates |", "|---|---|---|---|---|"]
    for name in [n for n in ARMS if n in arms and ARMS[n].stage == "grpo"]:
        for s in seeds:
            record = arms[name].get(s)
            if record is None:
                continue
            rows = [r for p in record["points"] for r in p.get("history", [])]
            if len(rows) < 32:
                continue
            first, last = rows[:16], rows[-16:]
            mean = lambda rs, k: float(np.mean([r[k] for r in rs]))  # noqa: E731
            cos = ", ".join(f"{p['updates']}: {p['gradient_cosine']:.2f}"
                            for p in record["points"] if "gradient_cosine" in p)
            lines.append(f"| {name} | {s} | {mean(first, 'reward_mean'):.3f} → {mean(last, 'reward_mean'):.3f} | "
                         f"{mean(first, 'entropy'):.4f} → {mean(last, 'entropy'):.4f} | {cos} |")
    return lines


def ascent_table(arms: dict, seeds: list[int]) -> list[str]:
    lines = ["| rollouts | seed | reward on the 128 prompts updated on, 0 → 4 updates | on 128 other prompts |",
             "|---|---|---|---|"]
    for name in sorted(n for n in arms if n.startswith("ascent_")):
        for s in seeds:
            record = arms[name].get(s)
            if record is None:
                continue
            rows = record["rows"]
            lines.append(f"| {record['strategy']} | {s} | " + " → ".join(f"{r['trained']:.3f}" for r in rows)
                         + " | " + " → ".join(f"{r['other']:.3f}" for r in rows) + " |")
    return lines if len(lines) > 2 else []


def best_of_table(arms: dict, seeds: list[int]) -> list[str]:
    """Best-of-n of the OPD model by each rule, pass@n and the NFE per problem, mean over seeds."""
    records = {s: arms["best_of_opd"][s] for s in seeds if s in arms.get("best_of_opd", {})}
    if not records:
        return []
    greedy = [r["greedy"] for r in records.values()]
    lines = ["| n | best-of-n by log-prob | by vote | pass@n (oracle) | NFE per problem |", "|---|---|---|---|---|",
             f"| greedy | {np.mean([g['accuracy'] for g in greedy]):.3f} | | | "
             f"{np.mean([g['nfe_per_problem'] for g in greedy]):.1f} |"]
    for n in sorted({p["n"] for r in records.values() for p in r["points"]}):
        points = [p for r in records.values() for p in r["points"] if p["n"] == n]
        cells = [f"{np.mean([p[k] for p in points]):.3f}" if all(k in p for p in points) else "—"
                 for k in ("logprob", "vote", "pass_at_n")]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {np.mean([p['nfe_per_problem'] for p in points]):.1f} |")
    return lines


def _correct(evaluation: dict) -> np.ndarray:
    return np.asarray(evaluation["rewards"]) == 1.0


# The GRPO arm a study's controls are compared with: its preset's own (default.toml runs GRPO at 2e-4).
LEAD = {"countdown_teach": "grpo_lr2e-4"}


def _versus_rows(arms: dict, seeds: list[int], lead: str) -> list[tuple[str, int, dict]]:
    grpo = arms.get(lead, {})
    rows = []
    for name in [n for n in ARMS if n in arms and ARMS[n].matches == "grpo"]:
        for u in sorted({p["updates"] for r in arms[name].values() for p in r["points"]}):
            pairs = {s: (_point(grpo.get(s, {}), u), _point(arms[name].get(s, {}), u)) for s in seeds}
            pairs = {s: (_correct(g["evaluation"]), _correct(c["evaluation"])) for s, (g, c) in pairs.items()
                     if g is not None and c is not None}
            rows.append((f"{lead} − {name}", u, pairs))
    best = arms.get("best_of_opd", {})
    common = [{p["updates"] for p in r["points"]} for r in grpo.values()]
    points = sorted(set.intersection(*common) - {0}) if common else []  # the runs every seed has
    for top in points:
        for n in sorted({p["n"] for r in best.values() for p in r["points"]}):
            for rule in ("logprob", "vote"):
                pairs = {}
                for s in seeds:
                    g, b = _point(grpo.get(s, {}), top), next((p for p in best.get(s, {}).get("points", [])
                                                               if p["n"] == n), None)
                    if g is not None and b is not None and rule in b.get("correct", {}):
                        pairs[s] = (_correct(g["evaluation"]), np.asarray([c == "1" for c in b["correct"][rule]]))
                rows.append((f"{lead} (greedy) − OPD best-of-{n} by {rule}", top, pairs))
    return rows


def versus_table(arms: dict, seeds: list[int], lead: str = "grpo") -> list[str]:
    """The `lead` GRPO arm (and the study's `grpo` arm, if another) against each verifier-only or
    continued control at the same wall-clock, and against best-of-n of the OPD model: GRPO's greedy
    accuracy minus the other's, paired over the same problems, per seed (± its paired standard
    error) and mean ± sd over seeds."""
    rows = []
    for arm in dict.fromkeys([lead, "grpo"]):
        rows += _versus_rows(arms, seeds, arm)
    lines = ["| GRPO against | at updates | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± sd |",
             "|---|---|" + "---|" * (len(seeds) + 1)]
    for label, u, pairs in rows:
        if not pairs:
            continue
        cells, gains = [], []
        for s in seeds:
            if s not in pairs:
                cells.append("—")
                continue
            d = pairs[s][0].astype(np.float64) - pairs[s][1]
            gains.append(d.mean())
            cells.append(f"{100 * d.mean():+.1f} ± {100 * d.std(ddof=1) / math.sqrt(len(d)):.1f}")
        lines.append(f"| {label} | {u} | " + " | ".join(cells) + f" | {_mean_sd(gains)} ({len(gains)}) |")
    return lines if len(lines) > 2 else []


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def has_curves(study: str) -> bool:
        return any(p["updates"] > 0 for n in data[study] if n in ARMS
                   for r in data[study][n].values() for p in r["points"])

    studies = [s for s in data if "base" in data[s] and s != "smoke" and has_curves(s)]
    fig, axes = plt.subplots(1, max(1, len(studies)), figsize=(5 * max(1, len(studies)), 3.6), squeeze=False)
    colors = {"grpo": "tab:red", "grpo_exact": "tab:purple", "grpo_positions": "tab:orange", "grpo_rloo": "tab:pink",
              "opd_more": "tab:blue", "sft_more": "tab:green", "rft": "tab:cyan", "rft_lr1e-4": "tab:gray",
              "grpo_from_sft": "tab:brown",
              "grpo_g4": "tab:olive"}
    for ax, study in zip(axes[0], studies):
        arms, base = data[study], data[study]["base"]
        for name in [n for n in ARMS if n in arms and ARMS[n].start == "opd"]:
            by_u: dict[int, list[float]] = {}
            for s, record in arms[name].items():
                for p in record["points"]:
                    if p["updates"] > 0:
                        by_u.setdefault(p["updates"], []).append(
                            paired(p["evaluation"], base[s]["opd"]["evaluation"])[0])
            us = sorted(u for u in by_u if len(by_u[u]) >= 2)
            if not us:
                continue
            mean = [100 * np.mean(by_u[u]) for u in us]
            sd = [100 * np.std(by_u[u], ddof=1) for u in us]
            ax.errorbar(us, mean, yerr=sd, marker="o", capsize=3, color=colors.get(name), label=name)
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GRPO updates (controls: the same wall-clock)")
        ax.set_ylabel("held-out accuracy over OPD, points")
        ax.set_title(study)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(results: Path) -> str:
    data = collect(results)
    lines = []
    for study, arms in data.items():
        base = arms.get("base", {})
        seeds = sorted(base)
        if not seeds or study == "smoke":
            continue
        spec = STUDIES[study]
        changed = f", with {json.dumps(spec.sections)}" if spec.sections else ""
        lines += [f"### `{study}`: `{spec.preset}`{changed}", "",
                  "| model (held-out greedy accuracy) | " + " | ".join(f"seed {s}" for s in seeds) + " |",
                  "|---|" + "---|" * len(seeds)]
        for name in ("teacher", "sft", "opd"):
            lines.append(f"| {name} | " + " | ".join(f"{base[s][name]['evaluation']['accuracy']:.3f}" for s in seeds)
                         + " |")
        lines += ["", "Change in held-out greedy accuracy over the arm's starting checkpoint, in points: per seed "
                  "(± the paired standard error over the 256 problems), mean ± sd over seeds (their count), and the "
                  "change in pass@1 at the rollout decoding (4 samples per problem). Controls (≙) ran for the "
                  "wall-clock of that many GRPO updates.", ""]
        lines += curve_table(arms, base, seeds) + [""]
        captions = [
            ("GRPO's greedy held-out accuracy minus each control's at the same wall-clock (RFT: rejection-sampling "
             "fine-tuning, the verifier-only baseline) and minus best-of-n of the OPD model, in points, paired over "
             "the same problems (± the paired standard error):",
             versus_table(arms, seeds, LEAD.get(study, "grpo"))),
            (f"Best-of-n of the OPD model at the rollout decoding, one of n samples chosen without the reference "
             f"answer, held-out accuracy, mean over {len(seeds)} seed(s) (`python bench/rl_study.py best_of`):",
             best_of_table(arms, seeds)),
            ("GRPO's own rollouts (temperature as the preset's `[grpo] sampler`) and gradients:",
             dynamics_table(arms, seeds)),
            ("Four GRPO updates on one batch of 128 prompts, from the OPD model: mean reward of 64 fresh rollouts of "
             "each of those prompts, and of 128 other training prompts, after each update "
             "(`python bench/rl_study.py ascent`):", ascent_table(arms, seeds)),
        ]
        for caption, table in captions:
            if len(table) > 2:  # more than a header
                lines += [caption, ""] + table + [""]
    return "\n".join(lines)


def write_report(results: Path) -> str:
    body = report(results)
    plot(collect(results), ROOT / "bench" / "results" / "rl_study.png")
    figure = "![held-out accuracy against GRPO updates](bench/results/rl_study.png)"
    write_section("rl_study", "## RL study: GRPO against compute-matched controls (`bench/rl_study.py`)\n\n"
                  + body + "\n" + figure)
    return body
