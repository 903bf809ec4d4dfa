"""OPD or GRPO settings against each other, from the same starting checkpoints of each seed.

Reuses (or trains) the SFT and OPD checkpoints of `bench/rl_study.py`'s seed folders, then runs
the stage once per variant — each a set of `[opd]` or `[grpo]` overrides, or of other sections
(`lora*`: the student trains LoRA adapters in that stage, `[student] lora`) — and prints the held-out
accuracy (and for OPD the fraction of the teacher–student gap closed), per seed and as mean ± sd.
Writes `bench/results/<stage>_sweep.json`.

    python bench/stage_sweep.py opd [--seeds 0] [--variants base masked ...]
    python bench/stage_sweep.py grpo [--seeds 0] [--variants base p128x4 ...] [--from-sft]
"""

from __future__ import annotations

import argparse
import sys
import time
import tomllib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, preset_data, write_results  # noqa: E402

OPD_VARIANTS = {
    "base": {},
    "committed": {"positions": "committed"},
    "lr3e-3": {"optim": {"lr": 3e-3, "warmup_steps": 5}},
    "lr3e-3_steps240": {"steps": 240, "optim": {"lr": 3e-3, "warmup_steps": 5}},
    "greedy_rollouts": {"sampler": {"temperature": 0.0}},
    "steps240": {"steps": 240},
}


def _on(base: dict, **changes) -> dict:
    """`base` with `changes`; an `optim` change merges into the base's `optim`."""
    merged = {**base, **changes}
    if "optim" in changes:
        merged["optim"] = {**base.get("optim", {}), **changes["optim"]}
    return merged


# Rollouts at temperature 1, as every variant measured before the preset moved to 0.7 had them.
T1 = {"sampler": {"temperature": 1.0}}
# The GRPO preset before the sweep below replaced it: 30 rollouts of 32 prompts x 16, 4 updates each.
EARLIER = {"steps": 30, "prompts_per_step": 32, "group_size": 16, "updates_per_rollout": 4, "optim": {"lr": 1e-5},
           **T1}
# Then: 8 rollouts of 128 prompts x 16, one update each at lr 1e-4, at temperature 1.
EIGHT = {"steps": 8, "prompts_per_step": 128, "group_size": 16, "updates_per_rollout": 1, "optim": {"lr": 1e-4},
         **T1}
GRPO_VARIANTS = {
    "base": {},
    "earlier": EARLIER,
    "p128x4": _on(EARLIER, prompts_per_step=128, group_size=4),
    "p128x4_lr3e-5": _on(EARLIER, prompts_per_step=128, group_size=4, optim={"lr": 3e-5}),
    "p256x2_lr3e-5": _on(EARLIER, prompts_per_step=256, group_size=2, optim={"lr": 3e-5}),
    "lr3e-5": _on(EARLIER, optim={"lr": 3e-5}),
    "t0.7": _on(EARLIER, sampler={"temperature": 0.7}),
    # Adam's epsilon above the typical gradient RMS (~1e-3 here): parameters with a small, noisy
    # gradient (e.g. embedding rows of tokens the task never uses) move in proportion to it
    # instead of by a full unit step, so a larger learning rate can follow the signal.
    "eps1e-3_lr1e-4": _on(EARLIER, optim={"lr": 1e-4, "eps": 1e-3}),
    "eps1e-3_lr3e-4": _on(EARLIER, optim={"lr": 3e-4, "eps": 1e-3}),
    "eps1e-4_lr3e-5": _on(EARLIER, optim={"lr": 3e-5, "eps": 1e-4}),
    # The earlier preset's sample budget (30 rollouts x 512 samples) spent on fewer, larger
    # on-policy updates: one update per rollout of 2,048 samples, 8 rollouts. Two updates'
    # gradients from independent 512-sample batches had cosine ~0 (prompt noise); 4x the samples
    # average it down.
    "p128x16_u1_lr1e-4": EIGHT,
    "p512x4_u1_lr1e-4": _on(EIGHT, prompts_per_step=512, group_size=4),
    "p128x16_u1_lr3e-4": _on(EIGHT, optim={"lr": 3e-4}),
    "p128x16_u1_lr1e-4_x16": _on(EIGHT, steps=16),
    # Longer GRPO at that rollout size: 32 rollouts, cosine decay or a constant lr.
    "x32": _on(EIGHT, steps=32),
    "x32_const": _on(EIGHT, steps=32, optim={"schedule": "constant"}),
    # Four times the prompts per update (8,192 samples): less prompt noise per step, so a larger lr.
    "p512x16_u1_lr1e-4": _on(EIGHT, prompts_per_step=512),
    "p512x16_u1_lr3e-4": _on(EIGHT, prompts_per_step=512, optim={"lr": 3e-4}),
    # Rollouts nearer the greedy decoding the evaluation uses (confidence stays the temperature-1
    # probability of the sampled token). `base_t0.7` is the preset now.
    "base_t0.7": _on(EIGHT, sampler={"temperature": 0.7}),
    "base_t0.5": _on(EIGHT, sampler={"temperature": 0.5}),
    "t0.7_x16": _on(EIGHT, steps=16, sampler={"temperature": 0.7}),
    "t0.7_lr2e-4": _on(EIGHT, sampler={"temperature": 0.7}, optim={"lr": 2e-4}),
    "t0.7_p512": _on(EIGHT, prompts_per_step=512, sampler={"temperature": 0.7}),
    "t0.7_x32": _on(EIGHT, steps=32, sampler={"temperature": 0.7}),
    "t0.7_x32_lr3e-4": _on(EIGHT, steps=32, sampler={"temperature": 0.7}, optim={"lr": 3e-4}),
    "t0.7_x64_const": _on(EIGHT, steps=64, sampler={"temperature": 0.7}, optim={"schedule": "constant"}),
}
# LoRA against full fine-tuning at the same budget (steps, batch): rank 8 on all seven projections,
# at the full run's learning rate and at a higher one (low-rank updates are usually run hotter).
LORA = {"rank": 8, "alpha": 16.0, "targets": ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]}
OPD_VARIANTS |= {"lora_r8": {"student": {"lora": LORA | {"stages": ["opd"]}}},
                 "lora_r8_lr1e-2": {"student": {"lora": LORA | {"stages": ["opd"]}},
                                    "opd": {"optim": {"lr": 1e-2}}}}
GRPO_VARIANTS |= {"lora_r8": _on(EARLIER, student={"lora": LORA | {"stages": ["grpo"]}}),  # on the earlier preset
                  "lora_r8_lr1e-4": _on(EARLIER, student={"lora": LORA | {"stages": ["grpo"]}}, optim={"lr": 1e-4})}
VARIANTS = {"opd": OPD_VARIANTS, "grpo": GRPO_VARIANTS}


def overrides(stage: str, variant: dict) -> dict:
    """A variant as `{section: overrides}`: plain entries belong to the swept stage's section."""
    sections = {k: v for k, v in variant.items() if k in ("student", "opd", "grpo")}
    own = {k: v for k, v in variant.items() if k not in ("student", "opd", "grpo")}
    if own:
        sections[stage] = {**sections.get(stage, {}), **own}
    return sections


def main() -> None:
    from bd_train.stages import RunDir, parse_pipeline_config, run_grpo, run_opd, run_sft

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("stage", choices=list(VARIANTS))
    parser.add_argument("--config", default=str(ROOT / "flows" / "configs" / "default.toml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--variants", nargs="+", default=None)
    parser.add_argument("--output-dir", default=str(ROOT / "runs" / "rl_study"))
    parser.add_argument("--results", default=None, help="the results file's name (default: <stage>_sweep)")
    parser.add_argument("--from-sft", action="store_true",
                        help="grpo: start from the student's SFT checkpoint instead of OPD's")
    args = parser.parse_args()
    variants = VARIANTS[args.stage]
    names = args.variants or list(variants)
    unknown = sorted(set(names) - set(variants))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known for {args.stage}: {list(variants)}")
    base = tomllib.loads(Path(args.config).read_text())
    results: dict[str, dict[str, float]] = {}
    start = time.perf_counter()
    for seed in args.seeds:
        config = parse_pipeline_config(preset_data(base, seed=seed, output_dir=args.output_dir))
        where = RunDir.create(config, run_id=f"seed{seed}")  # rl_study's folder: SFT resumes when done
        teacher = run_sft(config, where, role="teacher")
        student = run_sft(config, where, role="student")
        opd = run_opd(config, where, teacher=teacher, student=student) if args.stage == "grpo" else None
        if opd is not None and args.from_sft:
            opd = student  # GRPO's starting model: what OPD would have started from
        assert teacher.evaluation is not None and student.evaluation is not None
        for name in names:
            vconfig = parse_pipeline_config(preset_data(base, seed=seed, output_dir=args.output_dir,
                                                        **overrides(args.stage, variants[name])))
            vwhere = RunDir.create(vconfig, run_id=f"seed{seed}-{args.stage}-{name}" + ("-from-sft" * args.from_sft))
            t0 = time.perf_counter()
            if opd is None:
                result = run_opd(vconfig, vwhere, teacher=teacher, student=student)
                before = student.evaluation.accuracy
            else:
                result = run_grpo(vconfig, vwhere, start=opd)
                assert opd.evaluation is not None
                before = opd.evaluation.accuracy
            assert result.evaluation is not None
            closed = (result.evaluation.accuracy - student.evaluation.accuracy) / (
                teacher.evaluation.accuracy - student.evaluation.accuracy)
            results.setdefault(name, {})[str(seed)] = result.evaluation.accuracy
            results.setdefault("start", {})[str(seed)] = before  # the stage's starting model
            results.setdefault(f"{name}/trained_params", {})[str(seed)] = (result.params or {}).get("trained", 0)
            print(f"seed {seed} {args.stage} {name}: accuracy {before:.3f} -> {result.evaluation.accuracy:.3f} "
                  f"(teacher {teacher.evaluation.accuracy:.3f}; the student now closes {closed:.2f} of the "
                  f"SFT gap), {time.perf_counter() - t0:.0f} s", flush=True)
    for name, per_seed in results.items():
        if name.endswith("/trained_params") or name == "start":
            continue
        values = np.asarray(list(per_seed.values()))
        print(f"{name}: {values.mean():.3f} ± {values.std(ddof=1) if len(values) > 1 else 0:.3f}")
    print(f"{time.perf_counter() - start:.0f} s in all")
    write_results(args.results or f"{args.stage}_sweep", results)


if __name__ == "__main__":
    main()
