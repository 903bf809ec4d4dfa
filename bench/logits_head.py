"""The LM head of SFT's and OPD's losses: the whole logits, `map_logits` (chunks, the backward pass
recomputing each chunk's logits) and `sum_logits` (chunks, the head's gradient taken in the forward
pass), on a vocabulary large beside the model, as released checkpoints have.

One process, the same model and batch for every variant: compiled peak (`memory_analysis()`:
arguments + outputs + temporaries) and the median time of the loss, its metrics and its gradient
(what a train step takes), and the gradients' largest difference from the whole logits' (relative
to each leaf's largest entry). Writes bench/results/logits_head.json and its BENCHMARKS.md section.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _report import write_results, write_section
from train_step import median_time, sft_batch

from bd_core import DiffusionTokenBatch, DistillationBatch
from bd_models import BlockDiffusionLM, ModelConfig, map_logits
from bd_train import OPDConfig, opd_objective, opd_positions, sft_objective
from bd_train._opd import _opd_output, _opd_terms, _weights
from bd_train._sft import _sft_output, _sft_terms

CONFIG = ModelConfig(vocab_size=32_000, d_model=256, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=1024, block_size=4,
                     attention="blocked", compute_dtype="float32", param_dtype="float32")
BATCH, CANVAS, CHUNK = 4, 256, 128  # T = 512 packed tokens per row
OPD = OPDConfig(temperature=1.0, hard_ce_weight=0.5)


def sft_map_logits(model, batch):
    """SFT's loss through `map_logits`: what `sft_objective` computed before `sum_logits`."""
    ce, correct = map_logits(model, batch.layout, _sft_terms, batch.targets, batch.weights > 0)
    return _sft_output(ce, correct, batch)


def opd_map_logits(model, batch):
    """OPD's loss through `map_logits`: what `opd_objective` computed before `sum_logits`."""
    weights, denom = opd_positions(batch, OPD)
    weights, denom, targets = _weights(weights, denom, batch.student.targets, OPD)
    kl, ce, agree = map_logits(model, batch.student.layout, functools.partial(_opd_terms, config=OPD),
                               batch.teacher_logits, weights > 0, targets)
    return _opd_output(kl, ce, agree, weights, denom, OPD)


def batches():
    layout, targets, weights = sft_batch(CONFIG, BATCH, CANVAS)
    sft = DiffusionTokenBatch.create(layout, targets, weights, weights)
    shape = (BATCH, 2 * CANVAS, CONFIG.vocab_size)
    teacher = jnp.asarray(np.random.default_rng(1).normal(size=shape) * 3, jnp.float32)
    return sft, DistillationBatch(sft, teacher)


def measure(loss, model, batch, steps: int):
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def value(p, batch):
        out = loss(eqx.combine(p, static), batch)
        return out.loss.compute(), out.aux

    @jax.jit
    def grad(params, batch):  # the loss, its metrics and its gradient, as a train step takes them
        (_, aux), grads = jax.value_and_grad(value, has_aux=True)(params, batch)
        return grads, aux

    memory = grad.lower(params, batch).compile().memory_analysis()
    assert memory is not None, "this backend reports no memory analysis"
    peak = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    def call(p, b):
        jax.block_until_ready(grad(p, b))
        return p, b

    seconds, _ = median_time(call, params, batch, steps=steps)
    return grad(params, batch)[0], {"peak_mb": peak / 2**20, "temp_mb": memory.temp_size_in_bytes / 2**20,
                                    "step_s": seconds}


def largest_difference(grads, reference) -> float:
    return max(float(jnp.max(jnp.abs(g - r)) / (jnp.max(jnp.abs(r)) or 1.0))
               for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)))


VARIANTS = {
    "sft": {"whole logits": (sft_objective, 0), "map_logits": (sft_map_logits, CHUNK),
            "sum_logits": (sft_objective, CHUNK)},
    "opd": {"whole logits": (lambda m, b: opd_objective(m, b, config=OPD), 0), "map_logits": (opd_map_logits, CHUNK),
            "sum_logits": (lambda m, b: opd_objective(m, b, config=OPD), CHUNK)},
}


def main(steps: int = 5) -> None:
    model = BlockDiffusionLM(CONFIG, key=jax.random.key(0))
    sft, opd = batches()
    results: dict[str, dict[str, float]] = {}
    for loss_name, variants in VARIANTS.items():
        batch = sft if loss_name == "sft" else opd
        reference = None
        for name, (loss, chunk) in variants.items():
            grads, r = measure(loss, model.with_logits_chunk(chunk), batch, steps)
            reference = grads if reference is None else reference
            r["grad_difference"] = largest_difference(grads, reference)
            results[f"{loss_name} {name}"] = r
            print(f"{loss_name} {name}: peak {r['peak_mb']:.0f} MiB, {r['step_s']:.3f} s, "
                  f"gradient difference {r['grad_difference']:.1e}")
    write_results("logits_head", {f"{k} {m}": v for k, r in results.items() for m, v in r.items()})
    write_markdown(results)


def write_markdown(results: dict[str, dict[str, float]]) -> None:
    rows = [
        f"The loss, its metrics and its gradient (no optimizer): vocab {CONFIG.vocab_size:,} tied, "
        f"d_model {CONFIG.d_model}, {CONFIG.n_layers} layers, batch {BATCH} at T = {2 * CANVAS} (the 2L layout), "
        f"float32, chunks of {CHUNK} "
        f"positions; OPD with random teacher logits and hard CE 0.5. Peak = compiled `memory_analysis()` arguments "
        f"+ outputs + temporaries; time = median of a few calls; the gradient difference is the largest over "
        f"leaves of |g - g_whole| / max |g_whole|.",
        "",
        "| loss | head | peak | temporaries | time | gradient difference |", "|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        loss, name = key.split(" ", 1)
        base = results[f"{loss} map_logits"]
        rows.append(f"| {loss.upper()} | `{name}` | {r['peak_mb']:.0f} MiB ({r['peak_mb'] / base['peak_mb']:.2f}x) | "
                    f"{r['temp_mb']:.0f} MiB | {r['step_s']:.3f} s ({r['step_s'] / base['step_s']:.2f}x) | "
                    f"{r['grad_difference']:.1e} |")
    rows += ["", "Ratios are against `map_logits` in the same run."]
    write_section("logits_head", "## The LM head in the losses (`bench/logits_head.py`)\n\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
