"""The accelerator path on one GPU: the bfloat16 train-step MFU at SCALING.md's 1B config, and the
Pallas (Triton) attention kernels against XLA's blocked kernel.

`make bench-gpu` (or `python bench/accelerator.py`; `python bench/train_step.py --device gpu` calls it) on a GPU:
- Train step: SCALING.md's 1B decoder (D 2048, 22 layers, 32 query and 4 kv heads of 64, SwiGLU
  5632, vocab 32,000 tied, block 4), mixed precision (float32 master weights and AdamW state,
  bfloat16 activations and matmul operands: `compute_dtype="bfloat16"`), remat `elementwise`,
  batch 8 of the 2L layout of a 1024-token canvas (T = 2048), once with `attention="pallas"` and
  once with `"blocked"`. MFU = useful FLOPs (`model_flops`) / median step time / the bfloat16
  matmul peak measured in this process (best of 8192³ products).
- Attention alone at the step's shapes (forward + backward of one layer's kernel): `blocked`,
  `pallas` and `dense` in bfloat16, their values and gradients compared with `dense` in float32.
Writes bench/results/accelerator.json and the BENCHMARKS.md section, naming the device.
`--size small` runs a small config on any backend (Pallas in interpret mode on CPU): what the test
in tests/test_accelerator_bench.py runs, so the script stays runnable without a GPU.

On a TPU (`python bench/accelerator.py --size sdar --attention-only`) the fused kernel is `splash`
(JAX's splash kernels with the block-diffusion mask) instead of the Triton one, at SDAR-1.7B's
attention shapes (16 query and 8 kv heads of 128, tiles of 128); the section is `accelerator_tpu_sdar`.
SDAR-1.7B's train steps on one chip are measured by `bench/plan_vs_device.py`.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from _peak import matmul_timer
from _report import machine, write_results, write_section
from sampling import timed
from train_step import median_time, setup, sft_batch

from bd_core import TokenMeta
from bd_models import ModelConfig, attend, model_flops

SIZES = {
    "1b": (ModelConfig(vocab_size=32_000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632,
                       block_size=4, compute_dtype="bfloat16", param_dtype="float32"), 8, 1024, 8192),
    "small": (ModelConfig(vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, block_size=4,
                          compute_dtype="bfloat16", param_dtype="float32", q_tile=16, k_tile=16), 2, 32, 256),
    "sdar": (ModelConfig(vocab_size=151_936, d_model=2048, n_layers=28, n_heads=16, n_kv_heads=8, d_ff=6144,
                         block_size=4, compute_dtype="bfloat16", param_dtype="bfloat16", q_tile=128, k_tile=128),
             8, 256, 8192),
}  # config, batch, canvas (T = 2 x canvas), matmul size for the peak


def fused_kernel() -> str:
    """The backend's fused attention kernel: JAX's splash kernels on a TPU, bdlm's Pallas (Triton)
    kernels elsewhere (in interpret mode on a CPU)."""
    return "splash" if jax.default_backend() == "tpu" else "pallas"


def bf16_peak(n: int, runs: int = 10) -> float:
    """FLOP/s of the best of `runs` bfloat16 `n`³ products accumulated in float32."""
    timer = matmul_timer(n, jnp.bfloat16)
    return 2 * n**3 / min(timer() for _ in range(runs))


def step_seconds(config: ModelConfig, batch: int, canvas: int, steps: int) -> float:
    """Median seconds of a jitted SFT step (forward, backward, AdamW)."""
    step, args = setup(config, 2 * canvas, tokens=batch * 2 * canvas)
    return median_time(step, *args, steps=steps)[0]


def attention_kernels(config: ModelConfig, batch: int, canvas: int, steps: int) -> dict[str, float]:
    """Forward + backward of one layer's attention at the step's shapes, per implementation in the
    compute dtype: the median seconds, and the largest error of the value and of each gradient
    relative to `dense` in float32 on the same inputs."""
    layout, _, _ = sft_batch(config, batch, canvas)
    meta = TokenMeta.from_layout(layout)
    t, kv, g, e = layout.shape[1], config.n_kv_heads, config.q_per_kv, config.head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    dtype = config.compute_jnp_dtype
    q = jax.random.normal(keys[0], (batch, kv, g, t, e), dtype)
    k, v = (jax.random.normal(key, (batch, kv, t, e), dtype) for key in keys[1:3])
    probe = jax.random.normal(keys[3], q.shape, jnp.float32)

    def grads_of(impl: str, dtype=dtype):
        def loss(q, k, v):
            q, k, v = (x.astype(dtype) for x in (q, k, v))
            out = attend(impl, q, k, v, meta, meta, q_tile=config.q_tile, k_tile=config.k_tile)
            return jnp.sum(probe * out.astype(jnp.float32))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    # The reference: dense attention in float32 on the same (rounded) inputs.
    with jax.default_matmul_precision("highest"):  # a TPU's default passes float32 products through bfloat16
        reference = jax.block_until_ready(grads_of("dense", jnp.float32)(q, k, v))
    outputs, results = {}, {}
    kernels = ("dense", "blocked", fused_kernel())
    for impl in kernels:
        results[f"attention_{impl}_s"], outputs[impl] = timed(functools.partial(grads_of(impl), q, k, v), runs=steps)
        print(f"attention {impl}: {results[f'attention_{impl}_s'] * 1e3:.2f} ms", flush=True)
    value_d, grads_d = reference
    for impl in kernels:
        value, grads = outputs[impl]
        errors = [abs(float(value) - float(value_d)) / max(abs(float(value_d)), 1e-30)]
        for got, want in zip(grads, grads_d, strict=True):
            want32 = want.astype(jnp.float32)
            errors.append(float(jnp.max(jnp.abs(got.astype(jnp.float32) - want32)) / jnp.max(jnp.abs(want32))))
        results[f"attention_{impl}_max_rel_error"] = max(errors)
    fused = kernels[-1]
    results[f"{fused}_speedup_vs_blocked"] = results["attention_blocked_s"] / results[f"attention_{fused}_s"]
    return results


def measure(size: str, steps: int, *, attention_only: bool = False) -> dict[str, float | str]:
    config, batch, canvas, peak_n = SIZES[size]
    device = jax.devices()[0]
    results: dict[str, float | str] = {"device": f"{device.platform}: {device.device_kind}", "size": size,
                                       "batch": batch, "canvas": canvas, "machine": machine(), "jax": jax.__version__}
    peak = bf16_peak(peak_n)
    results["bf16_peak_tflops"] = peak / 1e12
    results["fused"], results["reference_precision"] = fused_kernel(), "highest"
    if not attention_only:
        flops = model_flops(config, sft_batch(config, batch, canvas)[0])["train_step"]
        results["step_tflop"] = flops / 1e12
        for impl in (fused_kernel(), "blocked"):
            seconds = step_seconds(config.replace(attention=impl), batch, canvas, steps)
            results[f"step_{impl}_s"], results[f"mfu_{impl}"] = seconds, flops / seconds / peak
    results.update(attention_kernels(config, batch, canvas, steps))
    results["bf16_peak_after_tflops"] = bf16_peak(peak_n) / 1e12
    return results


def write_markdown(results: dict, markdown=None) -> None:
    config, batch, canvas, peak_n = SIZES[str(results["size"])]
    fused = str(results.get("fused", "pallas"))
    kernels = ("dense", "blocked", fused)
    head = (f"Device: {results['device']}, jax {results.get('jax', '?')}. Peak: the best bfloat16 {peak_n}³ product "
            f"(float32 accumulation) in the same process, {results['bf16_peak_tflops']:.0f} TFLOP/s before the "
            f"measurements and {results['bf16_peak_after_tflops']:.0f} after.")
    rows = [head, ""]
    if "step_tflop" in results:
        rows += [
            f"Train step: d_model {config.d_model}, {config.n_layers} layers, {config.n_heads} query / "
            f"{config.n_kv_heads} kv heads of {config.head_dim}, SwiGLU {config.d_ff}, vocab {config.vocab_size:,} "
            f"tied, block {config.block_size}, batch {batch} of the 2L layout of a {canvas}-token canvas "
            f"(T = {2 * canvas}), {config.param_dtype} master weights and AdamW, {config.compute_dtype} compute, "
            f"remat `{config.remat}`; "
            f"{results['step_tflop']:.1f} TFLOP per step (useful).",
            "",
            "| attention | step time | MFU (bf16) |", "|---|---|---|",
            *(f"| `{impl}` | {results[f'step_{impl}_s']:.3f} s | {results[f'mfu_{impl}']:.1%} |"
              for impl in (fused, "blocked")),
            "",
        ]
    rows += [
        f"One layer's attention kernel alone ({config.n_heads} query / {config.n_kv_heads} kv heads of "
        f"{config.head_dim}, batch {batch} of the 2L layout of a {canvas}-token canvas, T = {2 * canvas}, block "
        f"{config.block_size}) in bfloat16, forward + backward (error: the largest of the value's and each "
        "gradient's max difference, relative to their largest entry, from `dense` in float32 at the "
        f"{results.get('reference_precision', 'default')} matmul precision on the same inputs):",
        "",
        "| kernel | time | vs `blocked` | max relative error |", "|---|---|---|---|",
        *(f"| `{impl}` | {results[f'attention_{impl}_s'] * 1e3:.2f} ms | "
          f"{results['attention_blocked_s'] / results[f'attention_{impl}_s']:.2f}x | "
          f"{results[f'attention_{impl}_max_rel_error']:.1e} |" for impl in kernels),
    ]
    kwargs = {} if markdown is None else {"markdown": markdown}
    kwargs["measured_on"] = str(results.get("machine") or "") or None
    name = section_name(str(results["device"]).split(":")[0], str(results["size"]))
    kernel = "splash" if fused == "splash" else "Pallas"
    title = ("Accelerator: bf16 MFU and Pallas attention" if name == "accelerator" else
             f"{results['device']}: {kernel} attention at size `{results['size']}`")
    write_section(name, f"## {title} (`bench/accelerator.py --size {results['size']}`)\n\n" + "\n".join(rows),
                  **kwargs)


def section_name(backend: str, size: str) -> str:
    """The results file and BENCHMARKS.md section of a run: `accelerator` for the GPU's 1B step
    (the headline), `accelerator_<backend>_<size>` for any other."""
    return "accelerator" if (backend, size) == ("gpu", "1b") else f"accelerator_{backend}_{size}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="bfloat16 train-step MFU and fused vs XLA attention on a GPU or TPU")
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--attention-only", action="store_true", help="only the attention kernels (no train step)")
    args = parser.parse_args(argv)
    backend = jax.default_backend()
    if args.size != "small" and backend not in ("gpu", "tpu"):
        parser.error(f"--size {args.size} needs a GPU or TPU (JAX's default backend here is {backend!r}); "
                     "--size small runs the same measurements on any backend")
    results = measure(args.size, args.steps, attention_only=args.attention_only)
    for key, value in results.items():
        print(f"{key}: {value}")
    if args.size != "small":  # the small size is a check of the script, not a result to keep
        write_results(section_name(backend, args.size), results)
        write_markdown(results)


if __name__ == "__main__":
    main()
