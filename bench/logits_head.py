"""The LM head of SFT's and OPD's losses: the whole logits, `map_logits` (chunks, the backward pass
recomputing each chunk's logits) and `sum_logits` (chunks, the head's gradient taken in the forward
pass; for OPD also from the teacher's features and head instead of its logits), on a vocabulary
large beside the model, as released checkpoints have.

One process, the same model and batch for every variant: compiled peak (`memory_analysis()`:
arguments + outputs + temporaries) and the median time of the loss, its metrics and its gradient
(what a train step takes), and the gradients' largest difference from the whole logits' (relative
to each leaf's largest entry). Writes bench/results/logits_head.json and its BENCHMARKS.md section.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from _report import write_results, write_section
from train_step import median_time, sft_batch

from bd_core import DiffusionTokenBatch, DistillationBatch, LossOutput, WeightedMetric
from bd_models import BlockDiffusionLM, ModelConfig, first_argmax, map_logits
from bd_train import OPDConfig, opd_objective, opd_positions, sft_objective, teacher_head, token_cross_entropy

CONFIG = ModelConfig(vocab_size=32_000, d_model=256, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=1024, block_size=4,
                     attention="blocked", compute_dtype="float32", param_dtype="float32")
BATCH, CANVAS, CHUNK = 4, 256, 128  # T = 512 packed tokens per row
OPD = OPDConfig(temperature=1.0, hard_ce_weight=0.5)


def sft_map_logits(model, batch):
    """SFT's loss and metrics through `map_logits` (the backward pass recomputes each chunk): the
    same per-position terms as `sft_objective`'s."""
    def terms(logits, targets, active):
        return token_cross_entropy(logits, targets, active), (first_argmax(logits) == targets) & active

    ce, correct = map_logits(model, batch.layout, terms, batch.targets, batch.weights > 0)
    counted = jnp.sum((batch.weights > 0).astype(jnp.float32))
    return LossOutput(WeightedMetric(jnp.sum(batch.weights * ce), jnp.sum(batch.denom_weights)),
                      {"ce": WeightedMetric(jnp.sum(ce), counted),
                       "token_accuracy": WeightedMetric(jnp.sum(correct.astype(jnp.float32)), counted)})


def opd_map_logits(model, batch):
    """OPD's loss and metrics through `map_logits`, from the teacher's logits: the same
    per-position terms as `opd_objective`'s."""
    weights, denom = opd_positions(batch, OPD)
    t = OPD.temperature

    def terms(student, teacher, active, targets):
        p = jax.nn.log_softmax(jax.lax.stop_gradient(teacher).astype(jnp.float32) / t, axis=-1)
        q = jax.nn.log_softmax(student.astype(jnp.float32) / t, axis=-1)
        kl = jnp.where(active, jnp.sum(jnp.exp(p) * (p - q), axis=-1), 0.0)
        agree = (first_argmax(student) == first_argmax(teacher)) & active
        return kl, token_cross_entropy(student, targets, active), agree

    kl, ce, agree = map_logits(model, batch.student.layout, terms, batch.teacher_logits, weights > 0,
                               batch.student.targets)
    den = jnp.sum(denom)
    return LossOutput(WeightedMetric(jnp.sum(weights * (kl * t**2 + OPD.hard_ce_weight * ce)), den),
                      {"kl": WeightedMetric(jnp.sum(weights * kl), den),
                       "hard_ce": WeightedMetric(jnp.sum(weights * ce), den),
                       "teacher_agreement": WeightedMetric(jnp.sum(agree.astype(jnp.float32)),
                                                           jnp.sum((weights > 0).astype(jnp.float32)))})


def batches():
    layout, targets, weights = sft_batch(CONFIG, BATCH, CANVAS)
    sft = DiffusionTokenBatch.create(layout, targets, weights, weights)
    teacher = BlockDiffusionLM(CONFIG, key=jax.random.key(1))
    by_logits = DistillationBatch(sft, teacher(layout))
    by_features = DistillationBatch(sft, teacher_features=teacher.features(layout), teacher_head=teacher_head(teacher))
    return sft, by_logits, by_features


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


def opd(model, batch):
    return opd_objective(model, batch, config=OPD)


# (loss, chunk, batch): "sft", "opd logits" (the teacher's logits in the batch) or "opd features"
VARIANTS = {
    "sft": {"whole logits": (sft_objective, 0, "sft"), "map_logits": (sft_map_logits, CHUNK, "sft"),
            "sum_logits": (sft_objective, CHUNK, "sft")},
    "opd": {"whole logits": (opd, 0, "opd logits"), "map_logits": (opd_map_logits, CHUNK, "opd logits"),
            "sum_logits": (opd, CHUNK, "opd logits"),
            "sum_logits, teacher features": (opd, CHUNK, "opd features")},
}


def main(steps: int = 5) -> None:
    model = BlockDiffusionLM(CONFIG, key=jax.random.key(0))
    sft, by_logits, by_features = batches()
    named = {"sft": sft, "opd logits": by_logits, "opd features": by_features}
    results: dict[str, dict[str, float]] = {}
    for loss_name, variants in VARIANTS.items():
        reference = None
        for name, (loss, chunk, batch) in variants.items():
            grads, r = measure(loss, model.with_logits_chunk(chunk), named[batch], steps)
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
        f"positions; OPD against a teacher of the same shape (its logits, or its features and head, in the batch), "
        f"hard CE 0.5. Peak = compiled `memory_analysis()` arguments "
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
    rows += ["", "Ratios are against `map_logits` in the same run. `sum_logits` takes the head's gradient in the "
             "forward pass: three head products per chunk instead of four, and nothing of the logits kept for the "
             "backward pass. From the teacher's features, the batch holds `[B, T, D]` features and the teacher's "
             "head instead of `[B, T, V]` logits, and the loss computes the teacher's logits a chunk at a time. "
             "Every gradient is within the tests' 1e-5 of the whole logits'."]
    write_section("logits_head", "## The LM head in the losses (`bench/logits_head.py`)\n\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
