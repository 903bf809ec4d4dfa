"""Rollout throughput on one accelerator chip against the chip's roofline, at growing batch.

    python bench/rollouts_on_device.py [--batches 64 128 256 384 512] [--parts 64 128] [--out FILE]
    python bench/rollouts_on_device.py --table     # BENCHMARKS.md's section from the results

`sample` (the KV-cache sampler GRPO's and OPD's rollouts run) on SDAR-1.7B's shapes (its
config.json from flows/configs/sdar, random bfloat16 weights), with the one-chip preset's rollout
canvas: a 64-token prompt, 128 new tokens, block 4, one token committed per denoising step, so a
call is one prefill and 128 forward passes of every row (random weights are never confident; a
real model under `threshold` takes fewer). Per batch: the first call (its compile included) and
the median of three more (other keys), in committed tokens per second.

The roofline is what the program has to do, counted from the shapes: per forward pass, the FLOPs
of every layer's matmuls on the pass's positions (the block, and on a block's first pass the
previous block's clean positions as well), of attention against the whole fixed-size cache, and of
the head on the block's positions; and the bytes of every weight read once, the whole K/V cache
read once, and the block's logits written once in float32. A pass takes at least the larger of
FLOPs / peak and bytes / bandwidth. Two rooflines: the chip's published figures (`bd_train.plan`'s
table), and the peaks this process measured on the chip (the best bfloat16 8192³ product, the best
copy of 2 GiB), which a program can reach.

At the `--parts` batches one denoising step is also timed in parts: the step's own program (the
one `bd_train.plan` costs), its forward pass alone, and the Gumbel noise of its draw alone, beside
XLA's count of the step's FLOPs and bytes.

A batch the chip cannot hold is recorded with the runtime's message. The device run writes its
JSON (`--out`, by default merged into bench/results/rollouts_on_device.json under the device's
kind); the section is rendered from it where `bd_train` is installed (`--table`). `--size small`
(a CPU's check, what tests/test_accelerator_bench.py runs) keeps no result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, device_machine, results_path, write_results, write_section  # noqa: E402
from plan_vs_device import _inputs  # noqa: E402

from bd_core import ViewLayout  # noqa: E402
from bd_models import (  # noqa: E402
    BlockDiffusionLM,
    ModelConfig,
    SamplerConfig,
    SamplingDistribution,
    lower_denoising_step,
    model_config_from_hf,
    read_hf_config,
    sample,
)

SDAR = ROOT / "flows" / "configs" / "sdar" / "SDAR-1.7B-Chat"
PROMPT, NEW, BLOCK = 64, 128, 4
SMALL = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, block_size=BLOCK,
                    compute_dtype="bfloat16", param_dtype="bfloat16")
GiB = 1 << 30


def sdar_config() -> ModelConfig:
    return model_config_from_hf(read_hf_config(SDAR), param_dtype="bfloat16", compute_dtype="bfloat16")


def forward_passes(prompt: int = PROMPT, new: int = NEW, block: int = BLOCK) -> dict[str, int]:
    """How many forward passes of each kind one call makes with one token committed per step:
    `prefill` (the prompt less its last block, once), `first` (a block's first pass: the previous
    block's clean positions and the noisy block) and `step` (the block alone)."""
    blocks = new // block
    return {"prefill": int(prompt > block), "first": blocks, "step": blocks * (block - 1)}


def pass_cost(config: ModelConfig, rows: int, positions: int, cache: int, *, head: bool) -> tuple[float, float]:
    """(FLOPs, bytes) one forward pass has to spend (the module docstring's count) for `rows` rows of
    `positions` positions against a cache of `cache` slots; `head`: the block's logits are made."""
    d, e, f, v = config.d_model, config.head_dim, config.d_ff, config.vocab_size
    h, kv, layers = config.n_heads, config.n_kv_heads, config.n_layers
    per_position = layers * (2 * d * (h * e + 2 * kv * e) + 2 * h * e * d + 2 * 3 * d * f + 4 * h * e * cache)
    flops = rows * positions * per_position + (rows * config.block_size * 2 * d * v if head else 0)
    weight = jnp.dtype(config.param_dtype).itemsize
    layer_weights = layers * (d * (h * e + 2 * kv * e) + h * e * d + 3 * d * f)
    head_weights = d * v if head else 0
    kv_cache = 2 * layers * rows * kv * e * cache * jnp.dtype(config.compute_dtype).itemsize
    logits = rows * config.block_size * v * 4 if head else 0
    return float(flops), float((layer_weights + head_weights) * weight + kv_cache + logits)


def roofline(config: ModelConfig, rows: int, peak_flops: float, bandwidth: float,
             prompt: int = PROMPT, new: int = NEW) -> dict[str, float]:
    """Seconds one call takes at least, and the share of it bound by bandwidth, at the given peaks."""
    b, cache = config.block_size, prompt + new
    counts = forward_passes(prompt, new, b)
    shapes = {"prefill": (prompt - b, False), "first": (2 * b, True), "step": (b, True)}
    seconds = bandwidth_seconds = 0.0
    for kind, n in counts.items():
        flops, nbytes = pass_cost(config, rows, shapes[kind][0], cache, head=shapes[kind][1])
        t = max(flops / peak_flops, nbytes / bandwidth)
        seconds += n * t
        bandwidth_seconds += n * t * (nbytes / bandwidth >= flops / peak_flops)
    return {"seconds": seconds, "bandwidth_share": bandwidth_seconds / seconds}


def measured_peaks() -> dict[str, float]:
    """The best bfloat16 8192³ product (FLOP/s) and the best copy of 2 GiB (bytes read + written
    per second) of ten, on this process's default device (1024³ and 64 MiB on a CPU)."""
    n = 8192 if jax.default_backend() != "cpu" else 1024
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    words = (2 * GiB if jax.default_backend() != "cpu" else 64 << 20) // 2
    x = jnp.ones((words,), jnp.bfloat16)
    copy = jax.jit(lambda x: x * 2)

    return {"matmul_flops": 2 * n**3 / best_seconds(matmul, a, a, runs=10), "matmul_n": n,
            "copy_bytes_per_s": 2 * x.nbytes / best_seconds(copy, x, runs=10), "copy_bytes": x.nbytes}


def sampler_config(config: ModelConfig) -> SamplerConfig:
    return SamplerConfig(block_size=config.block_size, max_new_tokens=NEW, mask_id=config.vocab_size - 1, pad_id=0,
                         distribution=SamplingDistribution(temperature=1.0), strategy="steps")


def best_seconds(fn, *args, runs: int = 5) -> float:
    """The fastest of `runs` calls after a warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def parts(model, config: ModelConfig, rows: int) -> dict[str, float]:
    """Where a denoising step's time goes, in seconds (best of five): the step's whole program
    (`lower_denoising_step`, what a plan costs: the block's forward pass against a full cache, the
    draw, the commit and the trace record), its forward pass alone (the block's logits), and the
    Gumbel noise of the block's draw alone; with XLA's FLOPs and bytes of the step's program."""
    b, v = config.block_size, config.vocab_size
    cache = eqx.filter_eval_shape(model.init_cache, rows, PROMPT + NEW)
    lowered = lower_denoising_step(model, cache, sampler_config(config), prompt_len=PROMPT, key=jax.random.key(1))
    step = lowered.compile()
    inputs = _inputs(lowered, step)  # the model's weights too: small positive values, as a plan's check makes them
    cost = step.cost_analysis() or {}
    tokens = jnp.full((rows, b), v - 1, jnp.int32)
    positions = jnp.broadcast_to(PROMPT + 12 + jnp.arange(b, dtype=jnp.int32), (rows, b))
    block = ViewLayout(tokens, positions, jnp.full((rows, b), PROMPT // b + 3, jnp.int32),
                       jnp.ones((rows, b), jnp.int32), jnp.ones((rows, b), bool))
    full = model.init_cache(rows, PROMPT + NEW)
    full = eqx.tree_at(lambda c: c.valid, full, jnp.ones_like(full.valid))
    forward = eqx.filter_jit(lambda m, c, layout: m.forward_cached(layout, c, layers=m.layer_list())[0])
    noise = jax.jit(lambda key: jax.random.gumbel(key, (rows, b, v), jnp.float32))
    return {"step_s": best_seconds(step, *inputs), "forward_s": best_seconds(forward, model, full, block),
            "noise_s": best_seconds(noise, jax.random.key(2)), "step_flops": float(cost.get("flops", 0.0)),
            "step_bytes": float(cost.get("bytes accessed", 0.0))}


def measure(config: ModelConfig, batch: int, model, runs: int = 3) -> dict:
    """One batch: the first call's seconds, the median of `runs` more, tokens/s and the rows' NFE."""
    rng = np.random.default_rng(batch)
    tokens = rng.integers(0, config.vocab_size - 1, (batch, PROMPT)).astype(np.int32)
    prompts = (jnp.asarray(tokens), jnp.ones((batch, PROMPT), bool))
    sampler = sampler_config(config)
    start = time.perf_counter()
    out = jax.block_until_ready(sample(model, prompts, sampler, key=jax.random.key(0)))
    first = time.perf_counter() - start
    seconds = []
    for i in range(1, runs + 1):
        start = time.perf_counter()
        out = jax.block_until_ready(sample(model, prompts, sampler, key=jax.random.key(i)))
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    return {"first_s": first, "seconds": median, "runs": seconds, "tokens_per_s": batch * NEW / median,
            "nfe": sorted({int(n) for n in np.asarray(out.nfe)})}


def run(size: str, batches: list[int], parts_at: list[int], out: Path | None = None) -> dict:
    """Every batch's calls, then the step's parts at `parts_at`, then the chip's peaks (last, so the
    batches' memory peaks are theirs); with `out`, the result so far is written there as it grows."""
    config = sdar_config() if size == "sdar" else SMALL
    device = jax.devices()[0]
    result: dict = {"size": size, "jax": jax.__version__, "device": f"{device.platform}: {device.device_kind}",
                    "machine": device_machine(device), "prompt": PROMPT, "new": NEW, "block": config.block_size,
                    "config": config.to_dict(), "batches": {}, "parts": {}}

    def keep(where: str, key: str, row: dict) -> None:
        result[where][key] = row
        print(where, key, json.dumps(row), flush=True)
        if out is not None:
            out.write_text(json.dumps(result, indent=1))

    model = BlockDiffusionLM(config, key=jax.random.key(0))
    for batch in batches:
        try:
            row: dict = measure(config, batch, model)
        except Exception as error:  # a batch the chip cannot hold: the runtime's own message
            if "RESOURCE_EXHAUSTED" not in str(error) and "out of memory" not in str(error).lower():
                raise
            row = {"failed": str(error).splitlines()[0][:400]}
        stats = device.memory_stats() or {}
        keep("batches", str(batch), {**row, "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
                                     "peak_bytes_reserved": stats.get("peak_bytes_reserved")})
    for rows in parts_at:
        keep("parts", str(rows), parts(model, config, rows))
    result["peaks"] = measured_peaks()
    print("peaks", json.dumps(result["peaks"]), flush=True)
    if out is not None:
        out.write_text(json.dumps(result, indent=1))
    return result


def table(result: dict) -> str:
    """The section's body: per batch, measured against both rooflines."""
    from bd_train.plan import device_chip  # only where the section is rendered

    config = ModelConfig.from_dict(result["config"])
    kind = result["device"].split(": ", 1)[-1]
    chip = device_chip(type("Device", (), {"device_kind": kind})())
    peaks = result["peaks"]
    rooflines = {"measured": (peaks["matmul_flops"], peaks["copy_bytes_per_s"])}
    if chip is not None:
        rooflines = {"published": (chip.peak_flops, chip.hbm_bandwidth), **rooflines}
    head = " | ".join(f"{name} roofline s (bandwidth-bound share) | of it" for name in rooflines)
    lines = [
        f"Device: {result['device']}, jax {result['jax']}. `sample` on "
        + ("SDAR-1.7B's shapes" if result["size"] == "sdar" else "the small check's model")
        + f" (random bfloat16 weights), {result['prompt']}-token prompt, {result['new']} new tokens, "
        f"block {result['block']}, one token committed "
        "per denoising step (a prefill and 128 forward passes of every row). Seconds: the median of three calls "
        "after the first (compile included). Roofline: the module docstring's count of what each pass has to do "
        "(FLOPs; weights, the whole K/V cache and the block's float32 logits in bytes) at "
        + (f"the chip's published figures ({chip.peak_flops / 1e12:.0f} TFLOP/s, {chip.hbm_bandwidth / 1e9:.0f} GB/s) "
           "and at " if chip is not None else "")
        + f"the peaks measured on the chip ({peaks['matmul_flops'] / 1e12:.1f} TFLOP/s, the best bfloat16 "
        f"{peaks['matmul_n']}³ product; {peaks['copy_bytes_per_s'] / 1e9:.0f} GB/s, the best copy of "
        f"{peaks['copy_bytes'] / GiB:g} GiB). `of it`: roofline "
        "seconds / measured seconds. Process peak, up to that batch: the allocator's peak of bytes in use (the "
        "weights, each call's inputs and outputs, and the weights' random initialization, made op by op before "
        "the first batch) and, on a TPU, of the bytes the runtime reserved for programs' temporaries (the K/V "
        "cache among them)." + (f" Peaks: {result['peaks_note']}." if result.get("peaks_note") else ""),
        "",
        f"| batch | first call s | s per call | tokens/s | s per forward pass | {head} "
        "| process peak GiB: in use / reserved |",
        "|---|---|---|---|---|" + "---|---|" * len(rooflines) + "---|",
    ]
    passes = sum(forward_passes(result["prompt"], result["new"], result["block"]).values())
    for batch, row in sorted(result["batches"].items(), key=lambda item: int(item[0])):
        if "failed" in row:
            lines.append(f"| {batch} | does not fit: {row['failed'][:160]} |" + " |" * (4 + 2 * len(rooflines)))
            continue
        cells = []
        for flops, bandwidth in rooflines.values():
            bound = roofline(config, int(batch), flops, bandwidth, result["prompt"], result["new"])
            cells.append(f"{bound['seconds']:.2f} ({bound['bandwidth_share']:.0%}) | "
                         f"{bound['seconds'] / row['seconds']:.0%}")
        peaks = " / ".join(f"{row[key] / GiB:.2f}" if row.get(key) else "-"
                           for key in ("peak_bytes_in_use", "peak_bytes_reserved"))
        lines.append(f"| {batch} | {row['first_s']:.1f} | {row['seconds']:.2f} | {row['tokens_per_s']:,.0f} | "
                     f"{row['seconds'] / passes * 1e3:.1f} ms | {' | '.join(cells)} | {peaks} |")
    first = next(iter(rooflines))
    return "\n".join(lines + parts_lines(result, config, first, *rooflines[first]))


def parts_lines(result: dict, config: ModelConfig, name: str, peak_flops: float, bandwidth: float) -> list[str]:
    """The step's parts at each batch timed so: the step's program, its forward pass, the rest
    (draw, commit, record), the Gumbel noise alone, and XLA's count of the program at the peaks."""
    if not result.get("parts"):
        return []
    lines = ["", "One denoising step timed in parts (`parts`: the best of five runs of each program; the forward "
             "pass is the block's logits against a full cache; both programs also split the stacked layers' "
             "weights, which `sample` does once per call; the rest is the step less its forward pass: the "
             "draw, the commit and the trace record; the noise is the draw's Gumbel noise alone, made by itself). "
             "XLA's count: the step program's FLOPs and bytes accessed as `cost_analysis` reports them, timed at "
             f"the {name} figures, which is how a plan reads a denoising step.", "",
             "| batch | step ms | forward pass ms | rest ms | of which Gumbel noise ms | XLA's count: TFLOP, GB "
             f"| XLA's count at the {name} figures, ms | a step's roofline (this bench's count, {name}), ms |",
             "|---|---|---|---|---|---|---|---|"]
    for rows, part in sorted(result["parts"].items(), key=lambda item: int(item[0])):
        step, forward = part["step_s"] * 1e3, part["forward_s"] * 1e3
        xla = max(part["step_flops"] / peak_flops, part["step_bytes"] / bandwidth) * 1e3
        flops, nbytes = pass_cost(config, int(rows), config.block_size, result["prompt"] + result["new"], head=True)
        bound = max(flops / peak_flops, nbytes / bandwidth) * 1e3
        lines.append(f"| {rows} | {step:.1f} | {forward:.1f} ({forward / step:.0%}) | {step - forward:.1f} | "
                     f"{part['noise_s'] * 1e3:.1f} | {part['step_flops'] / 1e12:.2f}, {part['step_bytes'] / 1e9:.1f} "
                     f"| {xla:.1f} | {bound:.1f} |")
    return lines


def write_table(results: dict) -> None:
    for kind, result in results.items():
        name = "rollouts_on_device_" + kind.split(": ")[0]
        write_section(name, f"## Rollouts on a device: {kind} (`bench/rollouts_on_device.py`)\n\n{table(result)}",
                      measured_on=result["machine"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", choices=("sdar", "small"), default="sdar")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256, 384, 512])
    parser.add_argument("--parts", type=int, nargs="*", default=[64, 128], help="batches whose step is timed in parts")
    parser.add_argument("--out", type=Path, help="write this run's JSON here instead of merging it into the results")
    parser.add_argument("--table", action="store_true", help="only write BENCHMARKS.md's section from the results")
    args = parser.parse_args(argv)
    path = results_path("rollouts_on_device")
    if args.table:
        write_table(json.loads(path.read_text()))
        return
    result = run(args.size, args.batches, args.parts, args.out)
    if args.out is None and args.size == "sdar" and not result["device"].startswith("cpu"):
        results = json.loads(path.read_text()) if path.exists() else {}
        write_results("rollouts_on_device", {**results, result["device"]: result})
        write_table(json.loads(path.read_text()))
    elif args.out is None:
        print(table(result))  # a check of the script: no result kept


if __name__ == "__main__":
    main()
