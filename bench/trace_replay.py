"""How closely a replay scores a rollout's recorded trace on this device: the log-probs the sampler
records while it decodes (the KV-cache forward, one block's view at a time) against those the
training step's scorer computes (`build_replay` + `token_logprobs`: the whole packed sequence at
once), for every committed token. GRPO's first ratio and OPD's student log-probs are these
replayed numbers, so their distance from the recorded ones is the policy's numerical drift between
the two programs, not a learning signal.

    python bench/trace_replay.py [--size sdar4] [--precision default highest]

Models of random weights: `small` (the tests' size, float32) and `sdar4` (SDAR-1.7B's widths and
vocabulary with 4 of its 28 layers, float32 master weights, bfloat16 compute; at float32 compute too).
Rollouts: 16 rows, 32-token prompts, 64 new tokens, block 4, two steps per block at temperature 1.
On a CPU float32 products are float32; on a TPU the default precision passes them through bfloat16,
so each size is also run under `jax.default_matmul_precision("highest")`. Writes
`bench/results/trace_replay_<backend>.json` and the `trace_replay_<backend>` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, results_path, write_results, write_section  # noqa: E402

from bd_models import BlockDiffusionLM, ModelConfig, SamplerConfig, SamplingDistribution, sample, token_logprobs
from bd_train import build_replay

ROWS, PROMPT, NEW, BLOCK = 16, 32, 64, 4
SIZES = {
    "small": ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, block_size=BLOCK,
                         q_tile=16, k_tile=16),
    "sdar4": ModelConfig(vocab_size=151_936, d_model=2048, n_layers=4, n_heads=16, n_kv_heads=8, d_ff=6144,
                         block_size=BLOCK, compute_dtype="bfloat16", param_dtype="float32"),
}


@eqx.filter_jit
def _score(model, batch, distribution):
    return token_logprobs(model, batch, distribution)[0]


def drift(config: ModelConfig, attention: str, precision: str) -> dict[str, float]:
    """Recorded against replayed log-probs of one rollout batch: the largest and mean absolute
    difference over committed tokens, and the largest |exp(difference) - 1| (a ratio's distance
    from 1 at unchanged weights)."""
    config = config.replace(attention=attention, **({"q_tile": 128, "k_tile": 128} if attention == "splash" else {}))
    model = BlockDiffusionLM(config, key=jax.random.key(0))
    mask_id, pad_id = config.vocab_size - 1, config.vocab_size - 2
    tokens = np.random.default_rng(0).integers(0, pad_id, (ROWS, PROMPT)).astype(np.int32)
    sampler = SamplerConfig(block_size=BLOCK, max_new_tokens=NEW, mask_id=mask_id, pad_id=pad_id, strategy="steps",
                            steps_per_block=2, distribution=SamplingDistribution(temperature=1.0))
    with jax.default_matmul_precision(precision):
        out = sample(model, (tokens, np.ones_like(tokens, bool)), sampler, key=jax.random.key(1))
        replay = build_replay(out, mask_id=mask_id)
        replayed = np.asarray(_score(model, replay.batch, sampler.distribution), np.float64)
    mask = np.asarray(replay.mask)
    diff = np.abs(replayed - np.asarray(replay.recorded_logprobs, np.float64))[mask]
    return {"tokens": int(mask.sum()), "max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
            "max_ratio_minus_1": float(np.max(np.abs(np.expm1(diff)))),
            "mean_logprob": float(np.asarray(replay.recorded_logprobs, np.float64)[mask].mean())}


def measure(sizes: list[str], precisions: list[str], done: dict | None = None) -> dict:
    """Every run of `sizes` x `precisions` not already in `done` (an earlier run's results on this
    device, merged into these)."""
    device = jax.devices()[0]
    results: dict = {"device": f"{device.platform}: {device.device_kind}", "jax": jax.__version__,
                     "machine": machine(), "rows": {}}
    if done and done.get("device") == results["device"]:
        results["rows"].update(done["rows"])
    for size in sizes:
        config = SIZES[size]
        runs = [(config, "blocked", p) for p in precisions]
        if config.compute_dtype != "float32":  # and the same model at float32 compute
            runs += [(config.replace(compute_dtype="float32"), "blocked", p) for p in precisions]
            if device.platform == "tpu":  # the scorer with TPU's kernel, at the default precision
                runs.append((config, "splash", precisions[0]))
        for config, attention, precision in runs:
            key = f"{size}/{config.compute_dtype}/{attention}/{precision}"
            if key in results["rows"]:
                continue
            results["rows"][key] = drift(config, attention, precision)
            write_results(f"trace_replay_{device.platform}", results)  # kept run by run
            print(key, results["rows"][key], flush=True)
    return results


def write_markdown(results: dict, name: str) -> None:
    lines = ["| model | compute | scorer's attention | matmul precision | tokens | max abs diff | mean abs diff | "
             "max abs ratio - 1 |", "|---|---|---|---|---|---|---|---|"]
    for key, r in sorted(results["rows"].items(), key=lambda kv: (kv[0].split("/")[0] != "small", kv[0])):
        size, compute, attention, precision = key.split("/")
        lines.append(f"| {size} | {compute} | `{attention}` | {precision} | {r['tokens']} | {r['max_abs']:.1e} | "
                     f"{r['mean_abs']:.1e} | {r['max_ratio_minus_1']:.1e} |")
    write_section(name, f"## A replay against its recorded trace: {results['device']} (`bench/trace_replay.py`)"
                  "\n\nDevice: "
                  f"{results['device']}, jax {results['jax']}. {ROWS} rollouts of {NEW} tokens after a {PROMPT}-token "
                  f"prompt, block {BLOCK}, two steps per block, temperature 1, random weights; each committed token's "
                  "log-prob as the sampler recorded it against the scorer's replay of the trace. `small`: the "
                  "tests' model, float32; `sdar4`: SDAR-1.7B's widths and vocabulary with 4 layers.\n\n"
                  + "\n".join(lines), measured_on=results.get("machine"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", nargs="+", choices=sorted(SIZES), default=["small", "sdar4"])
    parser.add_argument("--precision", nargs="+", choices=["default", "high", "highest"],
                        default=["default", "highest"])
    args = parser.parse_args(argv)
    name = f"trace_replay_{jax.default_backend()}"
    path = results_path(name)
    results = measure(args.size, args.precision, json.loads(path.read_text()) if path.exists() else None)
    write_results(name, results)
    write_markdown(results, name)


if __name__ == "__main__":
    main()
