"""Where the headline train step spends its time, part by part, and what fusing projections buys.

XLA:CPU's profiler trace shows one event per fused kernel (`ynn_fusion`), not per model part, so
the breakdown is measured the other way round: each part of the step (for one layer, times the
layer count where it repeats) is jitted alone as forward + backward at the headline's shapes and
timed; its useful FLOPs are `model_flops`' terms for that part (3x forward; XLA's cost analysis
counts a loop body once, so it cannot count the flash kernel's tiles). What the parts do not cover (the
layer scan, residual adds, the gather of the embedding's gradient, dispatch) is the step's time
minus their sum. The parts overlap nothing when run alone, so the sum slightly overstates them.

The same harness times q/k/v as three matmuls against one matmul of the concatenated weights, and
gate/up as two against one (forward + backward, the concatenation inside the program, as a model
that keeps separate checkpoint tensors would have to do it).

Writes bench/results/profile_step.json and its BENCHMARKS.md section.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import optax
from _peak import matmul_peak
from _report import write_results, write_section
from train_step import HEADLINE, make_step, median_time, sft_batch

from bd_core import TokenMeta
from bd_models import (
    BlockDiffusionLM,
    ModelConfig,
    apply_rope,
    blocked_attention,
    dense_attention,
    model_flops,
    rms_norm,
    rope_angles,
    tile_needed,
)

BATCH, CANVAS = 8, 256  # the headline: T = 512 in the 2L layout
STEPS = 20


def fwd_bwd(fn):
    """`fn(*arrays) -> array` as one program: its value and the gradient of a fixed projection of
    it with respect to every input (a backward pass of the same shapes a loss would give)."""
    def loss(*args):
        out = fn(*args)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=out.dtype).reshape(out.shape)))
    return jax.jit(lambda *args: jax.grad(loss, argnums=tuple(range(len(args))))(*args))


def time_part(fn, *args) -> float:
    """Median seconds of `fn`'s forward + backward on `args`."""
    return _median_seconds(fwd_bwd(fn), args)


def _median_seconds(program, args) -> float:
    """Median seconds of `program(*args)` to its outputs, after one warm-up call."""
    jax.block_until_ready(program(*args))
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        jax.block_until_ready(program(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parts(config: ModelConfig, model: BlockDiffusionLM, layout) -> tuple[dict[str, tuple[float, float]], float]:
    """name -> (seconds, useful FLOPs) of each part of one train step (all layers), and the seconds
    of the dense attention kernel at the same shapes (the reference, not part of the step)."""
    b, t, d = layout.tokens.shape[0], layout.tokens.shape[1], config.d_model
    kv, g, e, f, v = config.n_kv_heads, config.q_per_kv, config.head_dim, config.d_ff, config.vocab_size
    layer = jax.tree.map(lambda x: x[0], model.layers)
    keys = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(keys[0], (b * t, d), jnp.float32)
    o = jax.random.normal(keys[3], (b * t, kv * g * e), jnp.float32)
    q = jax.random.normal(keys[1], (b, t, kv * g, e), jnp.float32)
    k = jax.random.normal(keys[2], (b, t, kv, e), jnp.float32)
    cos, sin = rope_angles(layout.positions, config)
    meta = TokenMeta.from_layout(layout)
    heads = (jnp.transpose(q.reshape(b, t, kv, g, e), (0, 2, 3, 1, 4)), jnp.transpose(k, (0, 2, 1, 3)),
             jnp.transpose(k, (0, 2, 1, 3)))
    assert config.activation == "silu", "the MLP part below is SwiGLU"
    act = jax.nn.silu
    eps = config.norm_eps
    n, bt = config.n_layers, b * t
    useful = model_flops(config, layout)
    attention_flops = 3 * useful["attention_forward"]
    projection_flops = 3 * n * bt * 2 * (d * (kv * g * e + 2 * kv * e) + kv * g * e * d)
    mlp_flops = 3 * n * bt * 2 * 3 * d * f
    head_flops = 3 * bt * 2 * d * v

    def part(fn, *args, flops: float = 0.0, times: int = n) -> tuple[float, float]:
        return time_part(fn, *args) * times, flops

    def blocked(q, k, v):
        return blocked_attention(q, k, v, meta, meta, q_tile=config.q_tile, k_tile=config.k_tile)

    rows = {
        "attention kernel (blocked: flash tiles, masked tiles skipped)": part(blocked, *heads, flops=attention_flops),
        "q/k/v/o projections": part(lambda x, o, wq, wk, wv, wo: jnp.concatenate([x @ wq, x @ wk, x @ wv, o @ wo], 1),
                                    x, o, layer.wq, layer.wk, layer.wv, layer.wo, flops=projection_flops),
        "MLP (gate, up, activation, down)": part(lambda x, wg, wu, wd: (act(x @ wg) * (x @ wu)) @ wd,
                                                 x, layer.w_gate, layer.w_up, layer.w_down, flops=mlp_flops),
        "RMSNorms (2 per layer)": part(
            lambda x, a, m: rms_norm(x, a, eps, jnp.float32) + rms_norm(x, m, eps, jnp.float32),
            x, layer.attn_norm, layer.mlp_norm),
        "RoPE on q and k": part(lambda q, k: jnp.concatenate([apply_rope(q, cos, sin), apply_rope(k, cos, sin)], 2),
                                q, k),
        "head-first layout transposes (q, k, v in; output back)": part(
            lambda q, k: jnp.transpose(q.reshape(b, t, kv, g, e), (0, 2, 3, 1, 4)).reshape(b, kv, g * t, e)
            + 2 * jnp.transpose(k, (0, 2, 1, 3)), q, k),
        "final norm, tied logits and log-softmax": part(
            lambda x, norm, emb: jax.nn.log_softmax(rms_norm(x, norm, eps, jnp.float32) @ emb.T, axis=-1),
            x, model.final_norm, model.embedding, flops=head_flops, times=1),
    }
    return rows, n * time_part(lambda q, k, v: dense_attention(q, k, v, meta, meta), *heads)


def adamw_part(model: BlockDiffusionLM) -> tuple[float, float]:
    optimizer = optax.adamw(3e-4, weight_decay=0.01)
    state = optimizer.init(model)  # pyright: ignore[reportArgumentType]
    grads = jax.tree.map(lambda p: p * 1e-3, model)

    @jax.jit
    def update(model, state, grads):
        updates, state = optimizer.update(grads, state, model)
        return optax.apply_updates(model, updates), state, grads

    return _median_seconds(update, (model, state, grads)), 0.0


def fusion(config: ModelConfig, tokens: int) -> dict[str, float]:
    """Separate vs fused q/k/v and gate/up matmuls, forward + backward, seconds."""
    keys = jax.random.split(jax.random.key(2), 6)
    d, hd, f = config.d_model, config.n_heads * config.head_dim, config.d_ff
    x = jax.random.normal(keys[0], (tokens, d), jnp.float32)
    wq, wk, wv = (jax.random.normal(kk, (d, hd), jnp.float32) for kk in keys[1:4])
    wg, wu = (jax.random.normal(kk, (d, f), jnp.float32) for kk in keys[4:6])

    def qkv_fused(x, a, b, c):
        q, k, v = jnp.split(x @ jnp.concatenate([a, b, c], axis=1), 3, axis=1)
        return q * k + v

    def gate_up_fused(x, a, b):
        gate, up = jnp.split(x @ jnp.concatenate([a, b], axis=1), 2, axis=1)
        return jax.nn.silu(gate) * up

    return {
        "qkv_separate_s": time_part(lambda x, a, b, c: (x @ a) * (x @ b) + (x @ c), x, wq, wk, wv),
        "qkv_fused_s": time_part(qkv_fused, x, wq, wk, wv),
        "gate_up_separate_s": time_part(lambda x, a, b: jax.nn.silu(x @ a) * (x @ b), x, wg, wu),
        "gate_up_fused_s": time_part(gate_up_fused, x, wg, wu),
    }


def tile_products(config: ModelConfig, layout) -> dict[str, float]:
    """The flash kernel's matmuls on their own: the rate XLA:CPU gives a batch of one tile's
    products (`[B·H, Q, E] x [B·H, U, E]` in the three forms the kernel uses), and the FLOPs the kernel
    executes (every product of every needed tile, forward and backward) and would take at those rates."""
    b, h, e = layout.tokens.shape[0], config.n_heads, config.head_dim
    q_tile, k_tile = config.q_tile, config.k_tile
    keys = jax.random.split(jax.random.key(3), 3)
    a = jax.random.normal(keys[0], (b * h, q_tile, e), jnp.float32)  # queries (or dO)
    c = jax.random.normal(keys[1], (b * h, k_tile, e), jnp.float32)  # keys (or values)
    p = jax.random.normal(keys[2], (b * h, q_tile, k_tile), jnp.float32)  # probabilities (or dS)
    flops = 2 * b * h * q_tile * k_tile * e
    forms = {  # per tile: scores, and dP, and the backward's recomputed scores; P V and dS K; P^T dO and dS^T Q
        "scores": (3, jax.jit(lambda a, c: jnp.einsum("bqe,bue->bqu", a, c)), (a, c)),
        "p_v": (2, jax.jit(lambda p, c: jnp.einsum("bqu,bue->bqe", p, c)), (p, c)),
        "p_t_do": (2, jax.jit(lambda p, a: jnp.einsum("bqu,bqe->bue", p, a)), (p, a)),
    }
    meta = TokenMeta.from_layout(layout)
    tiles = config.n_layers * int(jnp.sum(tile_needed(meta, meta, q_tile, k_tile)))
    out: dict[str, float] = {"executed_tiles": float(tiles), "executed_gflop": tiles * 7 * flops / 1e9}
    ideal = 0.0
    for name, (uses, fn, args) in forms.items():
        seconds = _median_seconds(fn, args)
        out[f"{name}_gflops"] = flops / seconds / 1e9
        ideal += tiles * uses * seconds
    out["ideal_s"] = ideal
    return out


def main() -> None:
    peak, _ = matmul_peak()
    config = HEADLINE
    layout, targets, weights = sft_batch(config, BATCH, CANVAS)
    model = BlockDiffusionLM(config, key=jax.random.key(0))
    optimizer = optax.adamw(3e-4, weight_decay=0.01)
    step = make_step(optimizer)
    opt_state = optimizer.init(model)  # pyright: ignore[reportArgumentType]
    step_s, _ = median_time(step, model, opt_state, layout, targets, weights, steps=10)
    step_flops = model_flops(config, layout)["train_step"]

    model = BlockDiffusionLM(config, key=jax.random.key(0))  # the step donated the first one
    rows, dense_s = parts(config, model, layout)
    rows["AdamW update (all parameters)"] = adamw_part(model)
    covered = sum(s for s, _ in rows.values())
    results: dict[str, float] = {"step_s": step_s, "peak_gflops": peak / 1e9, "step_mfu": step_flops / step_s / peak,
                                 "covered_s": covered, "dense_attention_s": dense_s}
    for name, (s, fl) in rows.items():
        results[f"{name}: s"], results[f"{name}: useful GFLOP"] = s, fl / 1e9
    fused = fusion(config, BATCH * 2 * CANVAS)
    results.update(fused)
    tile = tile_products(config, layout)
    results.update({f"tile_{k}": v for k, v in tile.items()})
    print(f"step {step_s:.3f} s; parts sum to {covered:.3f} s")

    lines = [
        "Headline step (vocab 260, d 256, 4 layers, 4 heads, d_ff 1024, block 4, batch 8, T = 512, float32, "
        "AdamW, remat `elementwise`), each part jitted alone as forward + backward at the step's shapes, median of "
        f"{STEPS}; repeated parts times the layer count. GFLOP are the part's useful FLOPs (`model_flops`' terms, "
        "3x forward; attention over the entries the mask allows); their rate is against the float32 matmul peak "
        f"measured in the same process ({peak / 1e9:.0f} GFLOP/s).",
        "",
        "| part | time | share of the step | GFLOP | rate | of peak |", "|---|---|---|---|---|---|",
    ]
    for name, (s, fl) in rows.items():
        rate = fl / s if s else 0.0
        flop_cells = f"{fl / 1e9:.2f} | {rate / 1e9:.1f} GFLOP/s | {rate / peak:.0%}" if fl else "| |"
        lines.append(f"| {name} | {s * 1e3:.1f} ms | {s / step_s:.1%} | {flop_cells} |")
    lines += [
        f"| not covered by the parts (scan, residuals, embedding gradient, dispatch; negative = the parts "
        f"overlap in the step) | {(step_s - covered) * 1e3:.1f} ms | {(step_s - covered) / step_s:.1%} | | | |",
        f"| **whole step** | **{step_s * 1e3:.1f} ms** | 100% | {step_flops / 1e9:.2f} (useful) | "
        f"{step_flops / step_s / 1e9:.1f} GFLOP/s | **{step_flops / step_s / peak:.0%}** |",
        "",
        f"The dense attention kernel at the same shapes takes {dense_s * 1e3:.1f} ms "
        f"({dense_s / rows[next(iter(rows))][0]:.2f}x the blocked kernel).",
        "",
        f"What bounds the attention kernel: it executes {tile['executed_gflop']:.2f} GFLOP (every product of "
        f"the {tile['executed_tiles']:.0f} needed {config.q_tile}x{config.k_tile} tiles of all layers, forward and "
        "backward; the useful count above leaves out the masked entries inside them), and XLA:CPU runs a "
        f"batch of one tile's {BATCH * config.n_heads} products at {tile['scores_gflops']:.0f} GFLOP/s "
        f"(Q K^T, {tile['scores_gflops'] * 1e9 / peak:.0%} of peak), {tile['p_v_gflops']:.0f} (P V, "
        f"{tile['p_v_gflops'] * 1e9 / peak:.0%}) and {tile['p_t_do_gflops']:.0f} (P^T dO, "
        f"{tile['p_t_do_gflops'] * 1e9 / peak:.0%}): at those rates alone the kernel's products take "
        f"{tile['ideal_s'] * 1e3:.1f} ms of its {rows[next(iter(rows))][0] * 1e3:.1f} ms.",
        "",
        f"Fused projections, forward + backward on {BATCH * 2 * CANVAS} tokens: q/k/v as one matmul "
        f"{fused['qkv_fused_s'] * 1e3:.1f} ms vs three {fused['qkv_separate_s'] * 1e3:.1f} ms "
        f"({fused['qkv_separate_s'] / fused['qkv_fused_s']:.2f}x); gate/up as one "
        f"{fused['gate_up_fused_s'] * 1e3:.1f} ms vs two {fused['gate_up_separate_s'] * 1e3:.1f} ms "
        f"({fused['gate_up_separate_s'] / fused['gate_up_fused_s']:.2f}x).",
    ]
    write_results("profile_step", results)
    write_section("profile_step", "## Train-step profile (`bench/profile_step.py`)\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
