"""Sampler throughput against batch size, with compiles counted and executed FLOP/s.

The headline model samples 64 new tokens after a 16-token prompt, one token per step with the KV
cache, at batch 8, 32, 128 and 512. Each batch is one bucket: one warm-up call compiles, then two
timed calls with another key and another temperature (a traced leaf) must compile nothing; JAX's
own compile events are counted (`jax.monitoring`).

Executed FLOPs are counted from what the sampler runs, not from what is useful: every denoising
step runs the model on the block's positions of every row (the first step of a block also the
previous block's clean positions) against the whole fixed-size cache, masked entries included;
matmuls are 2 FLOPs per multiply-add, attention is QK^T and PV. The rate is against the float32
matmul peak measured just before each timed call (`_peak.interleaved`: the best of three 2048²
products), the median over the timed calls.

Writes bench/results/sampler_batch.json and its BENCHMARKS.md section.
"""

from __future__ import annotations

import jax
import numpy as np
from _peak import interleaved, matmul_timer
from _report import write_results, write_section
from train_step import HEADLINE

from bd_data import ByteTokenizer
from bd_models import BlockDiffusionLM, ModelConfig, SamplerConfig, SamplingDistribution, model_flops, sample

TOK = ByteTokenizer()
PROMPT, NEW = 16, 64
BATCHES = (8, 32, 128, 512)
COMPILES: list[str] = []


def _count_compiles(event: str, *_args, **_kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES.append(event)


def executed_flops(config: ModelConfig, batch: int) -> float:
    """FLOPs one sampler call executes (see the module docstring)."""
    b, cache = config.block_size, PROMPT + NEW
    attention = config.n_layers * 4 * cache * config.n_heads * config.head_dim  # QK^T and PV over the cache
    per_position = model_flops(config, (1, 1))["matmul_forward"] + attention
    blocks = NEW // b
    prefill = PROMPT - b
    positions = prefill + blocks * (2 * b + (b - 1) * b)  # per block: [clean prev | noisy] then b - 1 steps
    return float(batch * positions * per_position)


def main() -> None:
    matmul_timer()  # compiled before compiles are counted
    jax.monitoring.register_event_duration_secs_listener(_count_compiles)
    model = BlockDiffusionLM(HEADLINE, key=jax.random.key(0))
    results: dict[str, float] = {}
    lines = [
        f"Headline model (vocab 260, d 256, 4 layers, block 4), prompt {PROMPT}, {NEW} new tokens, one token per "
        "step with the KV cache, float32; median of 2 timed calls after one warm-up call. Executed FLOP/s count "
        "every position each step runs against the whole cache (masked entries included); `of peak` is the "
        "median over the timed calls of each call's rate over the float32 matmul peak measured just before it "
        "(the best of three 2048² products).",
        "",
        "| batch | tokens/s | s per call | executed GFLOP/s | matmul peak beside it | of peak | compiles, warm-up "
        "| compiles, 2 timed calls |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rng = np.random.default_rng(0)
    for batch in BATCHES:
        prompts = (rng.integers(0, 256, (batch, PROMPT)).astype(np.int32), np.ones((batch, PROMPT), bool))
        configs = [SamplerConfig(block_size=4, max_new_tokens=NEW, mask_id=TOK.mask_id, pad_id=TOK.pad_id,
                                 distribution=SamplingDistribution(temperature=temp), strategy="steps")
                   for temp in (1.0, 0.7, 1.3)]
        before = len(COMPILES)
        jax.block_until_ready(sample(model, prompts, configs[0], key=jax.random.key(0)))
        warmup, before = len(COMPILES) - before, len(COMPILES)
        timed = iter(enumerate(configs[1:], start=1))

        def call(prompts=prompts, timed=timed) -> None:
            i, config = next(timed)
            jax.block_until_ready(sample(model, prompts, config, key=jax.random.key(i)))

        flops = executed_flops(HEADLINE, batch)
        paired = interleaved(call, flops, rounds=len(configs) - 1)
        seconds, compiles = paired.median_seconds, len(COMPILES) - before
        rate, peak = flops / seconds, float(np.median(paired.peaks))
        results.update({f"b{batch}_s": seconds, f"b{batch}_tokens_per_s": batch * NEW / seconds,
                        f"b{batch}_gflops": rate / 1e9, f"b{batch}_peak_gflops": peak / 1e9,
                        f"b{batch}_of_peak": paired.ratio,
                        f"b{batch}_compiles": float(compiles), f"b{batch}_warmup_compiles": float(warmup)})
        print(f"batch {batch}: {batch * NEW / seconds:,.0f} tokens/s, {rate / 1e9:.1f} GFLOP/s "
              f"({paired.ratio:.0%} of peak), {compiles} compiles")
        lines.append(f"| {batch} | {batch * NEW / seconds:,.0f} | {seconds:.2f} | {rate / 1e9:.1f} | "
                     f"{peak / 1e9:.0f} GFLOP/s | {paired.ratio:.0%} | {warmup} | {compiles} |")
    write_results("sampler_batch", results)
    write_section("sampler_batch", "## Sampler throughput vs batch (`bench/sampler_batch.py`)\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
