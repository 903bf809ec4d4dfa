"""A preset's stage chain run end to end on this host's accelerator, as `python -m bd_train.stages
run` runs it (`bd_train.stages.cli.run_chain`: teacher and student SFT, OPD, GRPO, each evaluated
and checkpointed), on random weights of the preset's shapes; per stage its first step (compile
included), its steady step (for OPD and GRPO: rollouts, scoring and the update), its evaluation and
the device's peak memory, beside the plan of the same preset.

    python bench/stages_on_device.py bench/configs/sdar_1p7b_lora_1chip.toml \
        --plan bench/results/plan_sdar_1p7b_lora_1chip_v5e1.json [--steps 4] [--stage sft|opd|grpo]

Released checkpoints cannot be fetched where this runs, so both models start from one checkpoint
written here with `save_pretrained`: the student's config.json with random weights in bfloat16, and
the ChatML fixture's tokenizer (its special tokens' ids set in the config; the vocabulary keeps the
preset's size, so every matrix has the released shapes). The preset's task, canvas, batches,
microbatches, LoRA and dtypes are kept; only the steps, the evaluation's size and the output folder
change. Random weights are never confident, so the rollouts commit one token per denoising step:
the most steps a rollout can take.

Each stage runs in its own process (`--stage sft`, then `opd`, then `grpo`, each restoring the
finished stages as a rerun does), so the allocator's peak is that stage's; `--stage` runs one of
them (a later one needs the earlier ones' folder, `--work`, and the same `--attention`, which
replaces both models' attention and keeps its results apart). Results merge into
`bench/results/stages_on_device.json` under the device's kind; a CPU run (`--shrink`: a model of
the same layout at toy sizes) checks the script and keeps none.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, device_machine, preset_data, reserved_bytes, results_path, write_results, write_section  # noqa: E402

CHATML = ROOT / "packages" / "models" / "tests" / "fixtures" / "hf" / "chatml"
STAGES = {"sft": ("sft-teacher", "sft-student"), "opd": ("opd",), "grpo": ("grpo",)}
SHRUNK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
GiB = 1 << 30
ONE_CHIP = ROOT / "bench" / "configs" / "sdar_1p7b_lora_1chip.toml"


def write_checkpoint(preset: dict, folder: Path, *, shrink: bool) -> dict:
    """The student's config.json with random bfloat16 weights and the ChatML fixture's tokenizer."""
    import jax

    from bd_models import BlockDiffusionLM, model_config_from_hf, read_hf_config, save_pretrained

    raw = dict(read_hf_config(ROOT / preset["student"]["pretrained"]))
    tokens = {t["content"]: t["id"] for t in json.loads((CHATML / "tokenizer.json").read_text())["added_tokens"]}
    raw |= {"bos_token_id": tokens["<|endoftext|>"], "eos_token_id": tokens["<|im_end|>"],
            "mask_token_id": tokens["<|MASK|>"], **(SHRUNK if shrink else {})}
    model = BlockDiffusionLM(model_config_from_hf(raw, param_dtype="bfloat16"), key=jax.random.key(0))
    save_pretrained(model, folder, base_config=raw, dtype="bfloat16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(CHATML / name, folder / name)
    return raw


def chain_preset(preset: dict, checkpoint: Path, output_dir: Path, steps: int, eval_n: int,
                 attention: str | None = None) -> dict:
    """The preset with both models at `checkpoint` (and `attention`, when given), `steps` steps per
    stage and a small evaluation."""
    models = {role: {"pretrained": str(checkpoint), **({"attention": attention} if attention else {})}
              for role in ("teacher", "student")}
    eval_batch = min(eval_n, preset.get("eval", {}).get("batch_size", eval_n))
    return preset_data(preset, seed=0, output_dir=output_dir, **models,
                       sft={"steps": steps}, opd={"steps": steps}, grpo={"steps": steps},
                       eval={"n": eval_n, "batch_size": eval_batch, "samples": 0, "thresholds": []},
                       run={"checkpoint_every": steps, "export": False})


def run_stage(data: dict, until: str) -> dict:
    """In this process: the chain up to `until`; the stages it ran, timed, and the device's peak."""
    import jax

    from bd_train.stages import RunDir, parse_pipeline_config
    from bd_train.stages.cli import run_chain

    config = parse_pipeline_config(data)
    begun = time.perf_counter()
    try:
        results = run_chain(config, RunDir.create(config, run_id="device"), until=until)
    except Exception as error:  # kept as the stage's result (an out-of-memory is a finding), then raised
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return {"failed": f"{type(error).__name__}: {' '.join(lines[:3])}", **_device(jax)}
    out: dict[str, Any] = {"wall_s": time.perf_counter() - begun}
    for name in STAGES[until]:
        s, evaluation = results[name].seconds or {}, results[name].evaluation
        steady = (s["train"] - s["first"]) / max(s["updates"] - 1, 1)
        metrics = evaluation.metrics() if evaluation is not None else {}
        out[name] = {"first_step_s": s["first"], "step_s": steady, "updates": int(s["updates"]),
                     "eval_s": s["eval"], "nfe_per_token": metrics.get("nfe_per_token"),
                     "memory": results[name].memory,  # the allocator at the stage's phases
                     "last": {k: v for k, v in results[name].history[-1].items() if isinstance(v, float)}}
    return out | _device(jax)


def _device(jax) -> dict:
    stats = jax.local_devices()[0].memory_stats() or {}
    return {"peak_bytes": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit"),
            "memory_stats": dict(stats),  # every key the runtime keeps, for later reading
            "device": f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind}", "jax": jax.__version__,
            "machine": f"{device_machine(jax.devices()[0])}, jax {jax.__version__}"}


def planned(plan: Path | None) -> dict:
    """`{stage: {peak, train_step_s}}` from a plan's JSON (`bd_train.plan --json`)."""
    if plan is None:
        return {}
    out = {}
    for stage in json.loads(plan.read_text())["stages"]:
        step = next((p for p in stage["programs"] if p["program"] == "train step"), {})
        out[stage["stage"]] = {"peak": stage["peak"], "train_step_s": step.get("seconds")}
    return out


def table(result: dict) -> str:
    rows = ["| stage | first step (compile included) s | steady step s | planned train step s | evaluation s "
            "| NFE per token | peak GiB in the stage's process | reserved peak GiB | planned peak GiB "
            "| peak reached in |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    plan = result.get("plan", {})
    for until, names in STAGES.items():
        run = result.get(until)
        if run is None:
            continue
        if "failed" in run:
            peak = f"{run['peak_bytes'] / GiB:.2f}" if run.get("peak_bytes") else ""
            at = f" ({run['at']})" if run.get("at") else ""
            rows.append(f"| {' and '.join(names)} | failed{at}: {run['failed']} |  |  |  |  | {peak} |  |  |  |")
            continue
        for name in names:
            r, p = run[name], plan.get(name, {})
            train_s = f"{p['train_step_s']:.2f}" if p.get("train_step_s") else ""
            nfe = f"{r['nfe_per_token']:.2f}" if r.get("nfe_per_token") is not None else ""
            plan_peak = f"{p['peak'] / GiB:.2f}" if p else ""
            reserved = reserved_bytes(run)
            rows.append(f"| {name} | {r['first_step_s']:.1f} | {r['step_s']:.2f} | {train_s} | {r['eval_s']:.1f} | "
                        f"{nfe} | {(run['peak_bytes'] or 0) / GiB:.2f} | "
                        f"{'' if reserved is None else f'{reserved / GiB:.2f}'} | {plan_peak} | "
                        f"{_peaked_in(r.get('memory'))} |")
    return "\n".join(rows)


def _peaked_in(memory: dict | None) -> str:
    from bd_train.stages import peaked_in  # no device is touched: the parent leaves it to the children

    return peaked_in(memory) or ""


def write_table(results: dict) -> None:
    for kind, result in results.items():
        attention = result.get("attention")  # a run with `--attention`: its own section
        write_section(f"stages_on_device_{kind.split(':')[0]}" + (f"_{attention}" if attention else ""),
                      f"## The stage chain on a device: {result['device']}"
                      + (f", `{attention}` attention" if attention else "") + " (`bench/stages_on_device.py`)\n\n"
                      f"`{result['preset']}` run by `bd_train.stages`' chain, {result['steps']} steps per stage, "
                      f"random weights of its shapes, each stage in its own process (peak: the allocator's, "
                      f"restoring the finished stages included), evaluated on {result['eval_n']} problems; jax "
                      f"{result['jax']}. Steady step: (the stage's training time - its first step) / (steps - 1); "
                      "for OPD and GRPO it holds the rollouts, scoring and update of a step, the plan's figure the "
                      "update alone. Planned: the plan given (`--plan`): a stage's largest program with what the "
                      "stage holds beside it (blank times: planned with `--cost none`). Reserved peak: a TPU "
                      "runtime's peak of the bytes it reserves for compiled programs' temporaries, which the "
                      "allocator's peak leaves out (blank: not kept then). Peak reached in: the first of the stage's "
                      "phases (`StageResult.memory`: state, first update, trained, merged, evaluated) whose allocator "
                      "peak is the stage's (blank: measured before the stages recorded them)."
                      + (f" Code: {result['code']}." if result.get("code") else "") + "\n\n" + table(result),
                      measured_on=result.get("machine"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("preset", nargs="?", type=Path, default=ONE_CHIP)
    parser.add_argument("--plan", type=Path, help="the same preset's plan (JSON) to set beside the figures")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--eval-n", type=int, default=64)
    parser.add_argument("--stage", choices=tuple(STAGES), help="run only the chain up to this stage")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bdlm_stages_on_device"))
    parser.add_argument("--shrink", action="store_true", help="toy sizes of the same layout (a CPU's check)")
    parser.add_argument("--attention", help="replace both models' attention (splash, pallas, ...): its own results")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the stage a child process runs
    parser.add_argument("--table", action="store_true", help="only write BENCHMARKS.md's section")
    args = parser.parse_args(argv)
    path = results_path("stages_on_device")
    if args.child:  # the accelerator is this process's alone: the parent never touches it
        data = json.loads((args.work / "preset.json").read_text())
        checkpoint = Path(data["student"]["pretrained"])
        if not (checkpoint / "config.json").exists():
            write_checkpoint(tomllib.loads(args.preset.read_text()), checkpoint, shrink=args.shrink)
        (args.work / f"{args.child}.json").write_text(json.dumps(run_stage(data, args.child), indent=1))
        return
    if args.table:
        write_table(json.loads(path.read_text()))
        return
    if args.stage in (None, "sft"):
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        preset = tomllib.loads(args.preset.read_text())
        data = chain_preset(preset, args.work / "checkpoint", args.work / "runs", args.steps, args.eval_n,
                            args.attention)
        (args.work / "preset.json").write_text(json.dumps(data, indent=1))
    kept = json.loads((args.work / "preset.json").read_text())["student"].get("attention")
    if kept != args.attention:
        parser.error(f"--attention {args.attention} but {args.work} holds a chain run with {kept}: give the same "
                     "--attention as its --stage sft run (or run --stage sft again)")
    result = {"preset": str(args.preset.relative_to(ROOT) if args.preset.is_absolute() else args.preset),
              "steps": args.steps, "eval_n": args.eval_n, "plan": planned(args.plan),
              **({"attention": args.attention} if args.attention else {})}
    for until in STAGES if args.stage is None else (args.stage,):
        print(f"== {until}", flush=True)
        (args.work / f"{until}.json").unlink(missing_ok=True)
        subprocess.run([sys.executable, __file__, str(args.preset), "--child", until, "--work", str(args.work)]
                       + ["--shrink"] * args.shrink, check=False)
        result[until] = json.loads((args.work / f"{until}.json").read_text())
        result |= {key: result[until][key] for key in ("jax", "device", "machine") if key in result[until]}
        print(json.dumps(result[until], indent=1), flush=True)
        if "failed" in result[until]:
            break
    if args.shrink or result["device"].startswith("cpu"):
        print(table(result))  # a check of the script: no result kept
        return
    results = json.loads(path.read_text()) if path.exists() else {}
    kind = result["device"] + (f" attention={args.attention}" if args.attention else "")
    write_results("stages_on_device", {**results, kind: {**results.get(kind, {}), **result}})
    write_table(json.loads(path.read_text()))


if __name__ == "__main__":
    main()
