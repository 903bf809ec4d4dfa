"""Where GRPO helps and where it can't: learning curves against updates, with controls.

A study is a preset (task, canvas, models) and its seeds' chain: teacher and student SFT, then OPD.
From a checkpoint of that chain (`start`), each arm trains on with one stage and is evaluated at
every curve point (`--updates`, e.g. 8 32 128) on the same held-out problems: greedy accuracy (and
each problem's reward, for paired errors), pass@k at the rollout decoding, and, for GRPO arms, the
rollouts' reward and entropy and the cosine between the GRPO gradients of two independent batches.

- GRPO arms run with a constant learning rate, so the run to 32 updates continues the run to 8
  exactly (the stage resumes from its checkpoint with `[run] allow_changes` on its step count).
- Control arms (`opd_more`, `sft_more`, and `rft`: rejection-sampling fine-tuning, the
  verifier-only baseline that samples as GRPO does and takes SFT steps on the verified samples)
  continue from the same checkpoint for the same wall-clock: at curve point U,
  `U x (GRPO s/update) / (control s/step)` steps (RFT: rounds), the per-step times measured on
  this host once per study (`budget`: short runs of the stages in turn).
- Every evaluation holds best-of-4 over its pass@4 samples (`best_of@4_logprob`, `best_of@4_vote`);
  `best_of` records best-of-n of the OPD model (n rollouts per held-out problem at the rollout
  decoding, one chosen without the reference: by summed log-prob, or by vote), with pass@n and
  the NFE of a problem's n samples, to be set beside the GRPO and RFT arms' compute: their curve
  points keep each round's rollout `tokens` and `nfe_per_token`, so training NFE is their product.
- `argsort_ar` is `argsort` with block_size 1: one token per block, an autoregressive LM whose
  trajectory likelihood is exact and whose GRPO is the textbook one.

Every finished curve point is written at once to `bench/results/rl_study/<study>/seed<k>/<arm>.json`
(checkpoints live in `--output-dir`), so an interrupted study resumes where it stopped: `run`
skips points on disk. `report` rebuilds tables, the figure and the BENCHMARKS.md section from them
(`_rl_report.py`); `ascent` measures whether updates raise the reward on their own prompts and on
others.

    python bench/rl_study.py run --study argsort --arms grpo opd_more sft_more rft --seeds 0 1 2 --updates 8 32 128
    python bench/rl_study.py best_of --study argsort --seeds 0 1 2 --n 4 16 64
    python bench/rl_study.py report
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, preset_data  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "rl_study"
CONFIGS = ROOT / "flows" / "configs"
# What every study changes in its preset: no accuracy-vs-NFE curve (pass@k stays, with best-of-4
# over the same samples), a checkpoint only at each curve point's end, and the step count of a
# resumed stage may grow.
# (and the microbatch counts OPD and GRPO gained after the first chains were trained: 1 either way)
STEPS = ["training.grpo.steps", "training.opd.steps", "training.sft.steps", "training.steps", "training.rft.steps",
         "training.opd.microbatches", "training.grpo.microbatches"]
COMMON = {"eval": {"thresholds": [], "samples": 4, "best_of": ["logprob", "vote"]},
          "run": {"checkpoint_every": 100_000, "max_to_keep": 1, "allow_changes": STEPS}}


@dataclasses.dataclass(frozen=True)
class Study:
    preset: str
    sections: dict[str, Any] = dataclasses.field(default_factory=dict)


STUDIES = {
    "argsort": Study("argsort.toml"),
    "argsort_ar": Study("argsort.toml", {"canvas": {"block_size": 1}}),
    "countdown": Study("countdown.toml"),
    # the default preset: countdown with a teacher trained 2.5x longer than countdown.toml's and
    # twice the OPD steps, clearly ahead of its student, so that distillation has a gap to close.
    "countdown_teach": Study("default.toml", {"sft": {"teacher_steps": 1500}}),
    # ... with the teacher trained 1000 steps (two minutes less of `make run`)
    "countdown_teach1000": Study("default.toml", {"sft": {"teacher_steps": 1000}}),
    # countdown_teach with a student 4.2x larger (615,552 parameters against 147,968: the
    # teacher's width, 96, and 4 layers), above its teacher's 467,904: does GRPO's gain hold?
    "countdown_4x": Study("default.toml", {"sft": {"teacher_steps": 1500}, "student": {"d_model": 96, "n_layers": 4}}),
    "smoke": Study("smoke.toml"),  # the driver's own test: tiny models, seconds per point
}

# GRPO at a constant learning rate for curves; 1e-4 is the preset's peak (1e-3 collapsed the
# default student within 16 updates: accuracy 0.75 -> 0.40).
GRPO = {"updates_per_rollout": 1, "optim": {"lr": 1e-4, "schedule": "constant", "warmup_steps": 0}}
CONTROL_OPTIM = {"lr": 1e-3, "schedule": "constant", "warmup_steps": 5}


@dataclasses.dataclass(frozen=True)
class Arm:
    """`stage` trains on from the chain's `start` checkpoint with `sections` over the study's
    preset; a control (`stage` opd, sft or rft) is matched in wall-clock to the GRPO arm `matches`.
    An RFT arm samples as the `grpo` arm does (its prompts per step, group size and sampler)."""

    stage: str
    start: str = "opd"
    sections: dict[str, Any] = dataclasses.field(default_factory=dict)
    matches: str | None = None


def _grpo(**grpo: Any) -> dict[str, Any]:
    merged = {**GRPO, **grpo}
    merged["optim"] = {**GRPO["optim"], **grpo.get("optim", {})}
    return {"grpo": merged}


ARMS = {
    "grpo": Arm("grpo", sections=_grpo()),
    "grpo_exact": Arm("grpo", sections=_grpo(sampler={"strategy": "random"})),
    "grpo_positions": Arm("grpo", sections={**_grpo(), "task": {"params": {"credit": "positions"}}}),
    "grpo_rloo": Arm("grpo", sections=_grpo(advantage="rloo")),
    "grpo_g4": Arm("grpo", sections=_grpo(prompts_per_step=512, group_size=4)),
    "grpo_lr2e-4": Arm("grpo", sections=_grpo(optim={"lr": 2e-4})),
    "grpo_lr3e-4": Arm("grpo", sections=_grpo(optim={"lr": 3e-4})),
    "grpo_lr3e-5": Arm("grpo", sections=_grpo(optim={"lr": 3e-5})),
    "opd_more": Arm("opd", sections={"opd": {"optim": CONTROL_OPTIM}}, matches="grpo"),
    "sft_more": Arm("sft", sections={"sft": {"optim": CONTROL_OPTIM}}, matches="grpo"),
    # one SFT update per round on the round's verified samples (an unmeasured starting point)
    "rft": Arm("rft", sections={"rft": {"updates_per_rollout": 1, "optim": CONTROL_OPTIM}}, matches="grpo"),
    # at GRPO's constant learning rate: on countdown_teach, `rft` (1e-3) lost half its accuracy
    "rft_lr1e-4": Arm("rft", sections={"rft": {"updates_per_rollout": 1, "optim": {**CONTROL_OPTIM, "lr": 1e-4}}},
                      matches="grpo"),
    "grpo_from_sft": Arm("grpo", start="sft", sections=_grpo()),
    "opd_from_sft": Arm("opd", start="sft", sections={"opd": {"optim": CONTROL_OPTIM}}, matches="grpo_from_sft"),
    "sft_from_sft": Arm("sft", start="sft", sections={"sft": {"optim": CONTROL_OPTIM}}, matches="grpo_from_sft"),
}


def _merge(base: dict, sections: dict) -> dict:
    out = json.loads(json.dumps(base))
    for name, values in sections.items():
        section = out.setdefault(name, {})
        for key, value in values.items():
            section[key] = {**section.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def study_config(study: str, seed: int, output_dir: Path, *sections: dict) -> dict:
    from bd_train.stages import parse_pipeline_config

    spec = STUDIES[study]
    data = tomllib.loads((CONFIGS / spec.preset).read_text())
    for extra in (spec.sections, COMMON, *sections):
        data = _merge(data, extra)
    return parse_pipeline_config(preset_data(data, seed=seed, output_dir=output_dir / study))


def arm_sections(study: str, name: str, output_dir: Path) -> list[dict]:
    """The sections an arm adds to the study's preset: an RFT arm first takes the `grpo` arm's
    rollouts (prompts per step, group size, sampler), so the two sample alike."""
    arm = ARMS[name]
    if arm.stage != "rft":
        return [arm.sections]
    grpo = study_config(study, 0, output_dir, ARMS["grpo"].sections)["grpo"]
    return [{"rft": {k: grpo[k] for k in ("prompts_per_step", "group_size", "sampler")}}, arm.sections]


# -- results on disk ------------------------------------------------------------------------------

def _path(study: str, seed: int, arm: str) -> Path:
    return RESULTS / study / f"seed{seed}" / f"{arm}.json"


def load(study: str, seed: int, arm: str) -> dict:
    path = _path(study, seed, arm)
    return json.loads(path.read_text()) if path.exists() else {"points": []}


def save(study: str, seed: int, arm: str, record: dict) -> None:
    path = _path(study, seed, arm)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def _evaluation(evaluation) -> dict[str, Any]:
    """The numbers of an evaluation, with each problem's greedy reward and correct-sample count."""
    return {**evaluation.metrics(), "rewards": [round(r, 4) for r in evaluation.rewards],
            "correct_samples": "".join(map(str, evaluation.correct_samples))}


def _per_update(seconds: dict[str, float] | None) -> float | None:
    """A compiled update's seconds in a stage call (None when it took fewer than two)."""
    if not seconds or seconds["updates"] < 2:
        return None
    return (seconds["train"] - seconds["first"]) / (seconds["updates"] - 1)


# -- the chain and the arms -----------------------------------------------------------------------

def chain(study: str, seed: int, output_dir: Path) -> dict[str, Any]:
    """The seed's teacher, student SFT and OPD results (trained once, then restored); their
    evaluations and compiled step times are kept in `base.json`."""
    from bd_train.stages import RunDir, run_opd, run_sft

    config = study_config(study, seed, output_dir)
    where = RunDir.create(config, run_id=f"seed{seed}")
    results = {"teacher": run_sft(config, where, role="teacher")}
    results["sft"] = run_sft(config, where, role="student")
    results["opd"] = run_opd(config, where, teacher=results["teacher"], student=results["sft"])
    record = load(study, seed, "base")
    for name, result in results.items():
        entry = record.setdefault(name, {})
        entry["evaluation"] = _evaluation(result.evaluation)
        if _per_update(result.seconds) is not None:  # a restored stage took no steps: keep the trained one's
            entry["seconds_per_step"] = _per_update(result.seconds)
    save(study, seed, "base", record)
    return results


BUDGET_STAGES = (("grpo", 8), ("opd", 60), ("sft", 100), ("rft", 8))


def budget(study: str, output_dir: Path, *, rounds: int = 3) -> dict[str, Any]:
    """Seconds per compiled GRPO update (the `grpo` arm's setting), per OPD and SFT step and per
    RFT round (the `rft` arm's), for matching controls to GRPO in wall-clock: measured once per
    study, from seed 0's chain, in short runs of each stage taken in turn `rounds` times (so that
    a slow spell of the host slows them all), medians kept in `budget.json`. A stage the file
    lacks (one added after it was written) is measured in turn with GRPO again, and its time
    scaled by the recorded GRPO time over the new one: its ratio to GRPO is then the one measured
    side by side."""
    import shutil

    from bd_train.stages import RunDir, run_grpo, run_opd, run_rft, run_sft

    path = RESULTS / study / "budget.json"
    record: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    missing = [stage for stage, _ in BUDGET_STAGES if f"{stage}_seconds_per_step" not in record]
    if not missing:
        return record
    measured = [stage for stage, _ in BUDGET_STAGES if stage in missing or stage == "grpo"]
    results = chain(study, 0, output_dir)
    times: dict[str, list[float]] = {stage: [] for stage in measured}
    for r in range(rounds):
        for stage, steps in ((stage, steps) for stage, steps in BUDGET_STAGES if stage in measured):
            extra = arm_sections(study, "rft", output_dir) if stage == "rft" else []
            config = study_config(study, 0, output_dir, ARMS["grpo"].sections, *extra, {stage: {"steps": steps}},
                                  {"eval": {"n": 8, "samples": 0, "best_of": []}})
            folder = output_dir / study / "pipeline" / f"budget-{stage}-{r}"
            shutil.rmtree(folder, ignore_errors=True)
            where = RunDir.create(config, run_id=folder.name)
            if stage == "grpo":
                result = run_grpo(config, where, start=results["opd"])
            elif stage == "opd":
                result = run_opd(config, where, teacher=results["teacher"], student=results["opd"])
            elif stage == "rft":
                result = run_rft(config, where, start=results["opd"])
            else:
                result = run_sft(config, where, role="student", start=results["opd"])
            times[stage].append(_per_update(result.seconds) or float("nan"))
            shutil.rmtree(folder, ignore_errors=True)
    medians = {stage: float(np.median(values)) for stage, values in times.items()}
    scale = record["grpo_seconds_per_step"] / medians["grpo"] if "grpo_seconds_per_step" in record else 1.0
    record.update({f"{stage}_seconds_per_step": medians[stage] * scale for stage in missing})
    record.setdefault("rounds", {}).update({stage: times[stage] for stage in missing})
    if scale != 1.0:  # GRPO measured again beside the new stages: what their times were scaled by
        record["rounds"][f"grpo_beside_{'_'.join(missing)}"] = times["grpo"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def _steps(study: str, arm: Arm, updates: int, output_dir: Path) -> tuple[int, float | None]:
    """The arm's step count at curve point `updates`, and for a control the GRPO seconds it matches."""
    if arm.matches is None:
        return updates, None
    costs = budget(study, output_dir)
    seconds = updates * costs["grpo_seconds_per_step"]
    return max(1, round(seconds / costs[f"{arm.stage}_seconds_per_step"])), seconds


def gradient_cosine(config: dict, checkpoint_dir: str, *, start_dir: str, seed: int, point: int) -> float:
    """The cosine between the GRPO gradients of two independent rollout batches of the model in
    `checkpoint_dir` (fresh prompts and rollout keys, the arm's `[grpo]` settings; `start_dir`'s
    model is the KL reference when `[grpo] beta` > 0)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from bd_data import iterate, prompt_dataset
    from bd_train import distribution_score, make_grpo_loss
    from bd_train.stages import Run, grpo_config, rollout_batch

    run = Run(config)
    restore = lambda d: run.restore_model(d, run.model_config("student"), run.identity("student"), what=d)  # noqa: E731
    model = restore(checkpoint_dir)
    reference = restore(start_dir) if run.config.grpo.beta > 0 else None
    distribution = run.sampler_config(run.config.grpo.sampler).distribution
    loss_fn = make_grpo_loss(grpo_config(run), distribution_score(distribution, kl=run.config.grpo.beta > 0))

    @eqx.filter_jit
    def grad(model, batch):
        def value(m):
            loss = loss_fn(m, batch, jax.random.key(0)).loss
            return loss.numerator / jnp.maximum(loss.denominator, 1.0)

        return jax.tree.leaves(eqx.filter_grad(value)(model))

    prompts = iterate(prompt_dataset(run.source("train"), run.tokenizer, run.config.canvas,
                                     seed=10_000 + 97 * seed + point, batch_size=run.config.grpo.prompts_per_step,
                                     shard_index=0, shard_count=1))
    key = jax.random.key(10_000 + point)
    g = [jnp.concatenate([x.ravel() for x in grad(model, rollout_batch(run, model, next(prompts),
                                                                       key=jax.random.fold_in(key, i), mesh=None,
                                                                       reference=reference)[0])])
         for i in range(2)]
    return float(jnp.dot(g[0], g[1]) / (jnp.linalg.norm(g[0]) * jnp.linalg.norm(g[1]) + 1e-30))


def run_arm(study: str, seed: int, name: str, updates: list[int], output_dir: Path, results: dict[str, Any]) -> None:
    from bd_train.stages import RunDir, run_grpo, run_opd, run_rft, run_sft

    arm = ARMS[name]
    record = load(study, seed, name)
    done = {p["updates"] for p in record["points"]}
    start = results[arm.start]
    if arm.stage == "grpo" and 0 not in done:  # the start model, for the gradient cosine at 0 updates
        config = study_config(study, seed, output_dir, arm.sections)
        cosine = gradient_cosine(config, start.checkpoint_dir, start_dir=start.checkpoint_dir, seed=seed, point=0)
        record["points"].append({"updates": 0, "evaluation": _evaluation(start.evaluation), "gradient_cosine": cosine})
        save(study, seed, name, record)
    for point in sorted(updates):
        if point in done:
            continue
        steps, matched = _steps(study, arm, point, output_dir)
        config = study_config(study, seed, output_dir, *arm_sections(study, name, output_dir),
                              {arm.stage: {"steps": steps}})
        where = RunDir.create(config, run_id=f"seed{seed}-{name}")
        t0 = time.perf_counter()
        if arm.stage == "grpo":
            result = run_grpo(config, where, start=start)
        elif arm.stage == "opd":
            result = run_opd(config, where, teacher=results["teacher"], student=start)
        elif arm.stage == "rft":
            result = run_rft(config, where, start=start)
        else:
            result = run_sft(config, where, role="student", start=start)
        # the stage step the previous curve point ended at (a control's rounds or steps, not GRPO's updates)
        previous = config[arm.stage].get("updates_per_rollout", 1) * max(
            (p.get("steps", p["updates"]) for p in record["points"] if p["updates"] < point), default=0)
        entry: dict[str, Any] = {"updates": point, "steps": steps, "evaluation": _evaluation(result.evaluation),
                                 "seconds": result.seconds, "wall_seconds": time.perf_counter() - t0}
        if matched is not None:
            entry["matched_grpo_seconds"] = matched
        per_update = _per_update(result.seconds)
        if arm.stage in ("grpo", "rft"):  # rollout tokens x NFE per token: the round's sampling NFE
            keys = ("reward_mean", "rollout_accuracy", "entropy", "clip_fraction", "loss", "accepted", "tokens",
                    "nfe_per_token")
            entry["history"] = [{k: row[k] for k in ("step", *keys) if k in row}
                                for row in result.history if row["step"] > previous]
        if arm.stage == "grpo":
            entry["gradient_cosine"] = gradient_cosine(config, result.checkpoint_dir, start_dir=start.checkpoint_dir,
                                                        seed=seed, point=point)
            if per_update is not None and result.seconds is not None:  # the longest segment's measure is kept
                longest = max((p["seconds"]["updates"] for p in record["points"] if "seconds" in p), default=0)
                if result.seconds["updates"] >= longest:
                    record["seconds_per_update"] = per_update
        record["points"].append(entry)
        record["points"].sort(key=lambda p: p["updates"])
        save(study, seed, name, record)
        ev = entry["evaluation"]
        print(f"{study} seed {seed} {name} @ {point} updates ({steps} steps): accuracy {ev['accuracy']:.3f}, "
              f"pass@1 {ev.get('pass@1', float('nan')):.3f}, {entry['wall_seconds']:.0f} s", flush=True)


def best_of_opd(study: str, seed: int, output_dir: Path, ns: list[int]) -> dict:
    """Best-of-n of the seed's OPD model for each n in `ns`: n rollouts of every held-out problem at
    the `grpo` arm's rollout decoding, one chosen by summed log-prob and one by vote (neither reads
    the reference), with pass@n (the oracle's choice) and the NFE of a problem's n samples; beside
    them the OPD model's greedy NFE per problem. Kept in `seed<k>/best_of_opd.json`."""
    import jax

    from bd_train.stages import Run, best_of

    record = load(study, seed, "best_of_opd")
    done = {p["n"] for p in record["points"]}
    results = chain(study, seed, output_dir)
    greedy = results["opd"].evaluation
    record["greedy"] = {"accuracy": greedy.accuracy, "nfe_per_problem": greedy.nfe_per_token * greedy.generated_tokens}
    run = Run(study_config(study, seed, output_dir, ARMS["grpo"].sections))
    model = None
    for n in sorted(set(ns) - done):
        if model is None:
            model = run.restore_model(results["opd"].checkpoint_dir, run.model_config("student"),
                                      run.identity("student"), what="the OPD checkpoint")
        chosen = best_of(model, run, n, key=jax.random.key(30_000 + seed))
        record["points"].append({"n": n, **{b.rule: b.accuracy for b in chosen}, "pass_at_n": chosen[0].pass_at_n,
                                 "nfe_per_problem": chosen[0].nfe_per_problem,
                                 "correct": {b.rule: "".join(str(int(c)) for c in b.correct) for b in chosen}})
        record["points"].sort(key=lambda p: p["n"])
        save(study, seed, "best_of_opd", record)
        print(f"{study} seed {seed} OPD best-of-{n}: " + ", ".join(f"{b.rule} {b.accuracy:.3f}" for b in chosen)
              + f", pass@{n} {chosen[0].pass_at_n:.3f}, {chosen[0].nfe_per_problem:.0f} NFE per problem", flush=True)
    save(study, seed, "best_of_opd", record)
    return record


def ascent(study: str, seed: int, output_dir: Path, *, strategy: str, updates: int = 4, samples: int = 64) -> dict:
    """Whether GRPO's updates raise the expected reward where they were computed, and elsewhere:
    from the seed's OPD model, `updates` GRPO updates (the `grpo` arm's setting, `strategy`
    rollouts) all on the same 128 training prompts; after each, the mean reward of `samples`
    fresh rollouts of each of those prompts and of 128 other training prompts."""
    import jax

    from bd_data import iterate, prompt_dataset
    from bd_train import Trainer, distribution_score, make_grpo_loss, make_optimizer
    from bd_train.stages import Run, grpo_config, rollout_batch

    path = RESULTS / study / f"seed{seed}" / f"ascent_{strategy}.json"
    if path.exists():
        return json.loads(path.read_text())
    results = chain(study, seed, output_dir)
    sampler = {} if strategy == "threshold" else {"strategy": strategy}
    config = study_config(study, seed, output_dir, _grpo(sampler=sampler))
    run = Run(config)
    model = run.restore_model(results["opd"].checkpoint_dir, run.model_config("student"), run.identity("student"),
                              what="the OPD checkpoint")
    distribution = run.sampler_config(run.config.grpo.sampler).distribution
    trainer = Trainer(make_grpo_loss(grpo_config(run), distribution_score(distribution)),
                      make_optimizer(run.optimizer_config(run.config.grpo.optim, updates)))
    state = trainer.init(model, key=jax.random.key(seed))
    stream = iterate(prompt_dataset(run.source("train"), run.tokenizer, run.config.canvas, seed=20_000 + seed,
                                    batch_size=run.config.grpo.prompts_per_step, shard_index=0, shard_count=1))
    trained, other = next(stream), next(stream)
    group = run.config.grpo.group_size

    def reward(m, prompts) -> float:
        return float(np.mean([rollout_batch(run, m, prompts, key=jax.random.key(7_000 + i), mesh=None)[1].rewards
                              for i in range(samples // group)]))

    rows = [{"updates": 0, "trained": reward(model, trained), "other": reward(model, other)}]
    for k in range(updates):
        batch, _ = rollout_batch(run, state.model, trained, key=jax.random.key(1_000 + k), mesh=None)
        state, _ = trainer.step(state, batch)
        rows.append({"updates": k + 1, "trained": reward(state.model, trained), "other": reward(state.model, other)})
        print(f"{study} seed {seed} ascent ({strategy}) {rows[-1]}", flush=True)
    record = {"strategy": strategy, "samples": samples, "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def main() -> None:
    global RESULTS
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train and evaluate the arms' missing curve points")
    run.add_argument("--study", choices=list(STUDIES), default="argsort")
    run.add_argument("--arms", nargs="+", default=["grpo", "opd_more", "sft_more"])
    run.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    run.add_argument("--updates", type=int, nargs="+", default=[8, 32, 128])
    run.add_argument("--output-dir", default=str(ROOT / "runs" / "rl_study"))
    diagnose = sub.add_parser("ascent", help="does an update raise the reward on its own prompts, and on others?")
    diagnose.add_argument("--study", choices=list(STUDIES), default="argsort")
    diagnose.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    diagnose.add_argument("--strategies", nargs="+", default=["threshold", "random"])
    diagnose.add_argument("--output-dir", default=str(ROOT / "runs" / "rl_study"))
    best = sub.add_parser("best_of", help="best-of-n of the OPD model, chosen without the reference answer")
    best.add_argument("--study", choices=list(STUDIES), default="argsort")
    best.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    best.add_argument("--n", type=int, nargs="+", default=[4, 16, 64])
    best.add_argument("--output-dir", default=str(ROOT / "runs" / "rl_study"))
    sub.add_parser("report", help="tables and the BENCHMARKS.md section from the results on disk")
    parser.add_argument("--results", default=str(RESULTS), help="where curve points are kept (default: %(default)s)")
    args = parser.parse_args()
    RESULTS = Path(args.results)
    if args.command == "ascent":
        for seed in args.seeds:
            for strategy in args.strategies:
                ascent(args.study, seed, Path(args.output_dir), strategy=strategy)
        return
    if args.command == "best_of":
        for seed in args.seeds:
            best_of_opd(args.study, seed, Path(args.output_dir), args.n)
        return
    if args.command == "report":
        from _rl_report import write_report

        print(write_report(RESULTS))
        return
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; known: {list(ARMS)}")
    for seed in args.seeds:
        results = chain(args.study, seed, Path(args.output_dir))
        for name in args.arms:
            run_arm(args.study, seed, name, args.updates, Path(args.output_dir), results)


if __name__ == "__main__":
    main()
