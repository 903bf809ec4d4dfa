"""Sampling speed and parallel decoding: KV cache vs full recompute, packed vs per-step trace
replay, and NFE per token, tokens/s and accuracy of threshold decoding on a briefly trained sort
model.
Writes bench/results/sampling.json and its BENCHMARKS.md section.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _report import write_results, write_section

from bd_core import ViewLayout
from bd_data import ByteTokenizer, SortTask
from bd_models import (
    BlockDiffusionLM,
    ModelConfig,
    SamplerConfig,
    SamplingDistribution,
    concat_layouts,
    decode_completions,
    sample,
    token_logprobs,
)
from bd_train import build_replay

HEADLINE = ModelConfig(vocab_size=260, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=1024, block_size=4)
TOK = ByteTokenizer()
BATCH, PROMPT, NEW = 8, 16, 256


def timed(fn, runs: int = 1):
    """The median seconds of `runs` calls after a warm-up call (compilation excluded), and the
    last call's result."""
    jax.block_until_ready(fn())
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds)), out


def speed(results: dict) -> None:
    model = BlockDiffusionLM(HEADLINE, key=jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = (rng.integers(0, 256, (BATCH, PROMPT)).astype(np.int32), np.ones((BATCH, PROMPT), bool))
    # one token per step: the same NFE for both paths
    cfg = SamplerConfig(block_size=4, max_new_tokens=NEW, mask_id=TOK.mask_id, pad_id=TOK.pad_id,
                        distribution=SamplingDistribution(temperature=1.0), strategy="steps")
    key = jax.random.key(1)
    cached_s, out = timed(lambda: sample(model, prompts, cfg, key=key))
    recompute_s, _ = timed(lambda: sample(model, prompts, cfg, key=key, use_cache=False))
    tokens = BATCH * NEW
    results.update(cached_tokens_per_s=tokens / cached_s, recompute_tokens_per_s=tokens / recompute_s,
                   cache_speedup=recompute_s / cached_s, nfe_per_row=float(np.mean(out.nfe)),
                   commit_forwards_saved_by_folding=float(NEW // 4))

    replay = build_replay(out, mask_id=TOK.mask_id, num_views=NEW)
    distribution = cfg.distribution
    packed = eqx.filter_jit(lambda m, batch: token_logprobs(m, batch, distribution)[0])
    canvas = PROMPT + NEW
    layout = replay.batch.layout
    clean = jax.tree_util.tree_map(lambda a: a[:, :canvas], layout)
    views = jax.tree_util.tree_map(lambda a: a[:, canvas:].reshape(BATCH, NEW, 4).swapaxes(0, 1), layout)

    @eqx.filter_jit
    def per_step(m, clean: ViewLayout, views: ViewLayout):
        def one(view):  # [clean stream | this step's view] as its own forward
            return m(concat_layouts(clean, view))[:, canvas:]
        return jax.lax.map(one, views)

    packed_s, logp = timed(lambda: packed(model, replay.batch))
    step_s, _ = timed(lambda: per_step(model, clean, views))
    mask = np.asarray(replay.mask)
    results.update(packed_replay_s=packed_s, per_step_replay_s=step_s, packed_replay_speedup=step_s / packed_s,
                   replay_max_abs_logprob_diff=float(np.max(np.abs(np.asarray(logp - replay.recorded_logprobs))[mask])))


def sort_data(task: SortTask, count: int, start: int, split: str):
    examples = [task.example(start + i, split) for i in range(count)]
    prompt = np.stack([np.concatenate([np.full(8 - len(e.prompt), TOK.pad_id), TOK.encode(e.prompt)])
                       for e in examples])
    valid = prompt != TOK.pad_id
    answer = np.stack([np.concatenate([TOK.encode(e.answer), [TOK.eos_id] * (8 - len(e.answer))]) for e in examples])
    return prompt.astype(np.int32), valid, answer.astype(np.int32), examples


def train_sort_model(steps: int = 400, batch: int = 64):
    """Masked block-diffusion SFT (mean CE over masked tokens, t ~ U[0.3, 0.8]) on 6-digit sort."""
    config = ModelConfig(vocab_size=260, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=512, block_size=4,
                         q_tile=8, k_tile=8)
    model = BlockDiffusionLM(config, key=jax.random.key(2))
    opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, steps))
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    pos = np.arange(16)
    clean_meta = (pos, pos // 4, np.zeros(16), np.ones(16, bool))
    noisy_meta = (pos[8:], pos[8:] // 4, np.ones(8), np.ones(8, bool))

    @eqx.filter_jit
    def step(model, state, prompt, valid, answer, key):
        t_key, m_key = jax.random.split(key)
        t = jax.random.uniform(t_key, (answer.shape[0], 1), minval=0.3, maxval=0.8)
        masked = jax.random.uniform(m_key, answer.shape) < t
        noisy = jnp.where(masked, TOK.mask_id, answer)
        shape = (answer.shape[0], 24)
        parts = [np.concatenate([a, b]) for a, b in zip(clean_meta, noisy_meta)]
        tokens = jnp.concatenate([prompt, answer, noisy], 1)
        positions, block_ids, view_ids = (jnp.broadcast_to(p, shape).astype(
            jnp.bool_ if p.dtype == bool else jnp.int32) for p in parts[:3])
        layout = ViewLayout(tokens, positions, block_ids, view_ids, jnp.concatenate(
            [valid, jnp.ones((shape[0], 16), bool)], 1))

        def loss(m):
            logits = m(layout)[:, 16:]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, answer)
            return jnp.sum(ce * masked) / jnp.maximum(jnp.sum(masked), 1)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, value

    task = SortTask(length=6)
    key = jax.random.key(3)
    for i in range(steps):
        prompt, valid, answer, _ = sort_data(task, batch, i * batch, "train")
        model, state, value = step(model, state, prompt, valid, answer, jax.random.fold_in(key, i))
    return model, task, float(value)


def parallel_decoding(results: dict) -> list[tuple[str, float, float, float]]:
    model, task, loss = train_sort_model()
    results["sort_final_train_loss"] = loss
    prompt, valid, _, examples = sort_data(task, 256, 0, "eval")
    rows = []
    settings: list[tuple[str, dict[str, Any]]] = [
        (f"tau_{tau}", dict(strategy="threshold", threshold=tau)) for tau in (0.5, 0.7, 0.9)]
    settings.append(("one_per_step", dict(strategy="steps")))
    for name, extra in settings:
        cfg = SamplerConfig(block_size=4, max_new_tokens=8, mask_id=TOK.mask_id, pad_id=TOK.pad_id,
                            distribution=SamplingDistribution(temperature=0.0), stop_ids=(TOK.eos_id,), **extra)
        seconds, out = timed(functools.partial(sample, model, (prompt, valid), cfg, key=jax.random.key(4)), runs=3)
        texts = decode_completions(TOK, out, stop_ids=cfg.stop_ids)
        accuracy = float(np.mean([task.is_correct(e, t) for e, t in zip(examples, texts)]))
        generated = np.asarray(out.completion_valid).sum(1)
        assert out.trace is not None  # sample() always records the denoising trace
        nfe_per_token = float(np.mean(np.asarray(out.trace.step_valid).sum(1) / generated))
        tokens_per_s = float(generated.sum() / seconds)
        results[f"nfe_per_token_{name}"], results[f"accuracy_{name}"] = nfe_per_token, accuracy
        results[f"tokens_per_s_{name}"] = tokens_per_s
        rows.append((name, nfe_per_token, tokens_per_s, accuracy))
    return rows


def write_markdown(results: dict, rows) -> None:
    r = results
    one_per_step = r["tokens_per_s_one_per_step"]
    lines = [
        "## Sampling (`bench/sampling.py`)", "",
        f"Headline model (vocab 260, d 256, 4 layers, block 4), batch {BATCH}, prompt {PROMPT}, {NEW} new tokens, "
        "one token per step, no stops; one timed call each after a warm-up (compilation excluded).", "",
        "| measure | value | goal |", "|---|---|---|",
        f"| KV cache, tokens/s | {r['cached_tokens_per_s']:.0f} | |",
        f"| full recompute, tokens/s | {r['recompute_tokens_per_s']:.0f} | |",
        f"| cache speedup | {r['cache_speedup']:.1f}x | >= 3x |",
        f"| packed replay of the trace, s | {r['packed_replay_s']:.2f} | |",
        f"| per-step replay, s | {r['per_step_replay_s']:.2f} | |",
        f"| packed replay speedup | {r['packed_replay_speedup']:.1f}x | >= 3x |",
        f"| max abs replayed - recorded log-prob | {r['replay_max_abs_logprob_diff']:.1e} | <= 1e-5 |",
        f"| commit forwards saved by folding (per row) | {r['commit_forwards_saved_by_folding']:.0f} "
        f"of {r['nfe_per_row']:.0f} + {r['commit_forwards_saved_by_folding']:.0f} | |", "",
        "Parallel decoding: d 128 x 2 layers trained 400 steps on 6-digit sort, 256 eval prompts (one call "
        "of batch 256), greedy; tokens/s: the median of 3 calls after the one that compiled.", "",
        "| decoding | NFE per token | tokens/s | vs one token per step | accuracy |", "|---|---|---|---|---|",
        *[f"| {name} | {nfe:.2f} | {tps:,.0f} | {tps / one_per_step:.2f}x | {acc:.1%} |"
          for name, nfe, tps, acc in rows],
        "", "Goal: tau 0.9 <= 0.5 NFE per token.",
    ]
    write_section("sampling", "\n".join(lines))


def main() -> None:
    results: dict[str, float] = {}
    rows = parallel_decoding(results)
    print(json.dumps(results, indent=1))
    speed(results)
    write_results("sampling", results)
    write_markdown(results, rows)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
