"""Train-step throughput and MFU of the block-diffusion decoder, and dense vs blocked attention.

Forward + backward + AdamW on the 2L SFT layout `[clean canvas | noisy copy]`. MFU = useful FLOPs
(matmuls + attention over the entries the mask allows) / step time / a float32 matmul peak
measured in this process: per round the best of three 2048² products, then one step, and the
median over rounds of each step's rate over the peak beside it (`_peak.py`). Writes
bench/results/train_step.json and its BENCHMARKS.md section. `--device gpu` runs
bench/accelerator.py instead (bfloat16 MFU at a 1B config, Pallas vs XLA attention).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _peak import interleaved
from _report import write_results, write_section

from bd_core import ViewLayout
from bd_models import BlockDiffusionLM, ModelConfig, model_flops

HEADLINE = ModelConfig(vocab_size=260, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=1024, block_size=4,
                       attention="blocked", compute_dtype="float32", param_dtype="float32")
TOKENS_PER_STEP = 4096  # packed tokens; batch 8 at T = 512 (the headline), 2 at 2048, 1 at 4096


def median_time(fn, *args, steps: int) -> tuple[float, tuple]:
    """Median seconds per call after one warm-up call; `fn` returns its next args."""
    args = fn(*args)
    jax.block_until_ready(args)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        args = fn(*args)
        jax.block_until_ready(args)
        times.append(time.perf_counter() - start)
    return statistics.median(times), args


def sft_batch(config: ModelConfig, batch: int, canvas: int, *, seed: int = 0):
    """An all-completion canvas, clean then one noisy copy; about half the noisy tokens masked."""
    rng = np.random.default_rng(seed)
    clean = rng.integers(0, config.vocab_size - 1, size=(batch, canvas))
    masked = rng.random((batch, canvas)) < 0.5
    noisy = np.where(masked, config.vocab_size - 1, clean)
    pos = np.tile(np.arange(canvas), (batch, 2))
    view = np.concatenate([np.zeros((batch, canvas), int), np.ones((batch, canvas), int)], axis=1)
    layout = ViewLayout.create(np.concatenate([clean, noisy], axis=1), pos, pos // config.block_size, view,
                               np.ones((batch, 2 * canvas), bool))
    targets = np.concatenate([clean, clean], axis=1)
    weights = np.concatenate([np.zeros((batch, canvas)), masked], axis=1).astype(np.float32)
    return layout, jnp.asarray(targets, jnp.int32), jnp.asarray(weights)


def make_step(optimizer):
    def loss_fn(model, layout, targets, weights):
        logp = jax.nn.log_softmax(model(layout), axis=-1)
        ce = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)

    def step(model, opt_state, layout, targets, weights):
        grads = jax.grad(loss_fn)(model, layout, targets, weights)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return optax.apply_updates(model, updates), opt_state, layout, targets, weights

    return jax.jit(step, donate_argnums=(0, 1))


def setup(config: ModelConfig, length: int, tokens: int = TOKENS_PER_STEP):
    """A jitted step and its first args for `tokens` packed tokens at T = `length`."""
    layout, targets, weights = sft_batch(config, tokens // length, length // 2)
    model = BlockDiffusionLM(config, key=jax.random.key(0))
    optimizer = optax.adamw(3e-4, weight_decay=0.01)
    opt_state = optimizer.init(model)  # pyright: ignore[reportArgumentType]  (a Module is a pytree of params)
    return make_step(optimizer), (model, opt_state, layout, targets, weights)


def run(config: ModelConfig, length: int, steps: int) -> dict[str, float]:
    """Median step seconds and compiled temp memory for one (attention, T) point."""
    step, args = setup(config, length)
    memory = step.lower(*args).compile().memory_analysis()
    assert memory is not None, "this backend reports no memory analysis"
    seconds, _ = median_time(step, *args, steps=steps)
    return {"step_s": seconds, "temp_mb": memory.temp_size_in_bytes / 2**20}


def headline(rounds: int = 15) -> dict[str, float]:
    """The headline step interleaved with the matmul peak (`_peak.interleaved`)."""
    step, args = setup(HEADLINE, 512)
    state = [step(*args)]
    jax.block_until_ready(state[0])

    def call() -> None:
        state[0] = step(*state[0])
        jax.block_until_ready(state[0])

    layout = args[2]
    flops = model_flops(HEADLINE, layout)["train_step"]
    paired = interleaved(call, flops, rounds)
    seconds, peak = paired.median_seconds, max(paired.peaks)
    median_peak = statistics.median(paired.peaks)
    return {"step_s": seconds, "target_tokens_per_s": float(np.sum(layout.view_ids != 0)) / seconds,
            "useful_gflops": flops / seconds / 1e9, "mfu": paired.ratio, "mfu_best_step": paired.best_ratio,
            "mfu_vs_best_peak": flops / seconds / peak, "mfu_vs_median_matmul": flops / seconds / median_peak,
            "peak_gflops": peak / 1e9, "median_matmul_gflops": median_peak / 1e9, "rounds": float(rounds)}


def write_markdown(results: dict[str, float], lengths) -> None:
    rows = [
        "Headline: vocab 260, d_model 256, 4 layers, 4 heads, SwiGLU d_ff 1024, block 4, batch 8, 2L layout of "
        "a 256-token all-completion canvas (T = 512), float32, AdamW, remat `elementwise` (the default).",
        "",
        "| metric | value |", "|---|---|",
        f"| step time | {results['step_s']:.3f} s |",
        f"| target tokens / s | {results['target_tokens_per_s']:,.0f} |",
        f"| useful FLOP/s | {results['useful_gflops']:.1f} GFLOP/s |",
        f"| **MFU** (median over {results['rounds']:.0f} rounds of a step's rate over the best of three 2048² "
        f"matmuls timed just before it) | **{results['mfu']:.1%}** |",
        f"| MFU of the median step over the run's best matmul ({results['peak_gflops']:.1f} GFLOP/s, the highest "
        f"round peak) | {results['mfu_vs_best_peak']:.1%} |",
        f"| MFU of the fastest step over the run's best matmul | {results['mfu_best_step']:.1%} |",
        f"| MFU of the median step over the median round peak ({results['median_matmul_gflops']:.1f} GFLOP/s) "
        f"| {results['mfu_vs_median_matmul']:.1%} |",
        "",
        f"Attention sweep ({TOKENS_PER_STEP} packed tokens per step: batch = {TOKENS_PER_STEP} / T; temp = compiled "
        f"`memory_analysis()` temp bytes of the jitted step):",
        "",
        "| T | dense step | blocked step | blocked speed-up | dense temp | blocked temp |", "|---|---|---|---|---|---|",
    ]
    for t in lengths:
        rows.append(
            f"| {t} | {results[f'dense_T{t}_step_s']:.3f} s | {results[f'blocked_T{t}_step_s']:.3f} s | "
            f"{results[f'blocked_speedup_T{t}']:.2f}x | {results[f'dense_T{t}_temp_mb']:.1f} MiB | "
            f"{results[f'blocked_T{t}_temp_mb']:.1f} MiB |"
        )
    write_section("train_step", "## Train step (`bench/train_step.py`)\n\n" + "\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description="Train-step throughput and MFU (see the module docstring).")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="gpu: the bfloat16 1B-config step and the Pallas kernels (bench/accelerator.py)")
    args, rest = parser.parse_known_args()
    if args.device == "gpu":
        import accelerator  # it imports this module's step

        accelerator.main(rest)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    results = headline()
    print(f"headline: {results['step_s']:.3f} s/step, MFU {results['mfu']:.1%} (median over rounds), "
          f"{results['mfu_vs_best_peak']:.1%} of the run's best peak {results['peak_gflops']:.1f} GFLOP/s")
    lengths = (512, 2048, 4096)
    for t in lengths:
        for impl in ("dense", "blocked"):
            point = run(HEADLINE.replace(attention=impl), t, steps=3)
            results[f"{impl}_T{t}_step_s"] = point["step_s"]
            results[f"{impl}_T{t}_temp_mb"] = point["temp_mb"]
            print(f"{impl:8s} T={t:5d}: {point['step_s']:.3f} s/step, temp {point['temp_mb']:.1f} MiB")
        results[f"blocked_speedup_T{t}"] = results[f"dense_T{t}_step_s"] / results[f"blocked_T{t}_step_s"]
    write_results("train_step", results)
    write_markdown(results, lengths)


if __name__ == "__main__":
    main()
