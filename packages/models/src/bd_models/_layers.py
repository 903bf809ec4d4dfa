"""The decoder layer (RMSNorm, GQA projections with RoPE, gated MLP) and its pieces.

The optional parts a released checkpoint may carry (per-head q/k RMSNorm, q/k/v biases, Llama-3
RoPE scaling, the gate activation) follow `ModelConfig`; with them off a layer has none of their
arrays.

A layer's arrays are unbatched here; the model stacks `n_layers` of them on a leading axis and
scans. Every matmul runs on 2-D `[B·T, ·]` operands, the fastest form on CPU (ENVIRONMENT.md).

Under `remat="elementwise"` (the default) the elementwise stretches between matmuls (RMSNorm, the
q/k norms, RoPE, the gated activation) run under `jax.checkpoint`: the backward pass keeps their
inputs, which it keeps anyway as matmul outputs or the residual stream, and recomputes the rest. A
scanned layer writes every saved activation into a per-layer stack and reads it back; for the
headline training step that traffic cost more than the recomputation (BENCHMARKS.md, remat).
Shape letters: see bd_core (B, T, D, H = K·G, K, G, E, F); `BT` is the flattened B·T axis.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ._activations import rows
from ._attention import MODEL_AXIS
from ._config import ModelConfig, RopeScaling
from ._lora import LoRAWeight, lora_matmul

Array = jax.Array


def rms_norm(x_xD, weight_D, eps: float, dtype) -> Array:
    """RMSNorm over the last axis (D) of `[B, T, D]` or `[BT, D]`; statistics in float32 whatever
    the compute dtype."""
    x32 = x_xD.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight_D.astype(jnp.float32)).astype(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Array:
    """The `E/2` rotation frequencies theta^(-2i/E) in float32, Llama-3 scaled when `scaling` is set
    (the same formula as transformers' `_compute_llama3_parameters`)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    old_len, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * jnp.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return jnp.where(medium, smoothed, scaled)


def rope_angles(positions_BxT, config: ModelConfig) -> tuple[Array, Array]:
    """cos, sin `[B, T, E/2]` in float32 for the canvas positions."""
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    angles = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def rope_table(length: int, config: ModelConfig) -> tuple[Array, Array]:
    """cos, sin `[length, E/2]` of positions 0..length-1, as `rope_angles` computes them."""
    cos, sin = rope_angles(jnp.arange(length, dtype=jnp.int32)[None], config)
    return cos[0], sin[0]


def apply_rope(x_BxTxHxE, cos, sin) -> Array:
    """Rotate-half RoPE on a head axis (H query heads or K kv heads); `cos`, `sin` `[B, T, E/2]`."""
    x1, x2 = jnp.split(x_BxTxHxE.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[:, :, None], sin[:, :, None]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BxTxHxE.dtype)


def _recompute(fn, config: ModelConfig):
    """`fn` under `jax.checkpoint` when the config recomputes elementwise stretches; `fn` otherwise.
    (Inside the layer scan the CSE barrier only costs, as in `remat_layer`.)"""
    return jax.checkpoint(fn, prevent_cse=False) if config.remat == "elementwise" else fn


def _matmul(x, w, dtype, bias=None) -> Array:
    """`x [rows, in] @ w [in, out]` (+ `bias [out]`) in `dtype`; `w` may carry a LoRA adapter."""
    if isinstance(w, LoRAWeight):
        y = lora_matmul(x, w, dtype)
    else:
        y = jnp.dot(x, w.astype(dtype), preferred_element_type=dtype)
    return y if bias is None else y + bias.astype(dtype)


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu": lambda x: jax.nn.gelu(x, approximate=False),
                "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class DecoderLayer(eqx.Module):
    """One pre-norm block: x + Attn(norm(x)), then x + down(act(gate(norm(x))) * up(norm(x))).

    Attributes:
        attn_norm: the RMSNorm scale before attention.
        wq: the query projection (possibly a `LoRAWeight`).
        wk: the key projection.
        wv: the value projection.
        wo: the attention output projection.
        mlp_norm: the RMSNorm scale before the MLP.
        w_gate: the MLP's gate projection.
        w_up: the MLP's up projection.
        w_down: the MLP's down projection.
        q_norm: the per-head query RMSNorm scale (`qk_norm`), or None.
        k_norm: the per-head key RMSNorm scale (`qk_norm`), or None.
        bq: the query bias (`qkv_bias`), or None.
        bk: the key bias (`qkv_bias`), or None.
        bv: the value bias (`qkv_bias`), or None.
    """

    attn_norm: Array
    wq: Array | LoRAWeight  # a projection may carry a LoRA adapter (`add_lora`)
    wk: Array | LoRAWeight
    wv: Array | LoRAWeight
    wo: Array | LoRAWeight
    mlp_norm: Array
    w_gate: Array | LoRAWeight
    w_up: Array | LoRAWeight
    w_down: Array | LoRAWeight
    q_norm: Array | None
    k_norm: Array | None
    bq: Array | None
    bk: Array | None
    bv: Array | None

    def __init__(self, config: ModelConfig, *, key: Array):
        d, e, f = config.d_model, config.head_dim, config.d_ff
        h, kv = config.n_heads, config.n_kv_heads
        dtype = config.params_jnp_dtype
        q_key, k_key, v_key, o_key, gate_key, up_key, down_key = jax.random.split(key, 7)
        # Residual-branch outputs are scaled down with depth so the stream starts near identity.
        out_scale = (2 * config.n_layers) ** -0.5
        init = lambda k, shape, scale=1.0: (  # noqa: E731
            jax.random.normal(k, shape, jnp.float32) * scale / shape[0] ** 0.5).astype(dtype)
        self.attn_norm = jnp.ones((d,), dtype)
        self.wq = init(q_key, (d, h * e))
        self.wk = init(k_key, (d, kv * e))
        self.wv = init(v_key, (d, kv * e))
        self.wo = init(o_key, (h * e, d), out_scale)
        self.mlp_norm = jnp.ones((d,), dtype)
        self.w_gate = init(gate_key, (d, f))
        self.w_up = init(up_key, (d, f))
        self.w_down = init(down_key, (f, d), out_scale)
        ones, zeros = (lambda n: jnp.ones((n,), dtype)), (lambda n: jnp.zeros((n,), dtype))
        self.q_norm, self.k_norm = (ones(e), ones(e)) if config.qk_norm else (None, None)
        self.bq, self.bk, self.bv = (zeros(h * e), zeros(kv * e), zeros(kv * e)) if config.qkv_bias else (None,) * 3

    def qkv(self, x_BxTxD, cos, sin, config: ModelConfig) -> tuple[Array, Array, Array]:
        """q `[B, T, K, G, E]` (pre-scaled by 1/sqrt(E)), k and v `[B, T, K, E]`, RoPE applied."""
        b, t, d = x_BxTxD.shape
        kv, g, e = config.n_kv_heads, config.q_per_kv, config.head_dim
        dtype, eps = config.compute_jnp_dtype, config.norm_eps

        # Two stretches to recompute: the norm before the projections (the matmuls' backward needs
        # only the normed input, so they are not rerun), and the q/k norms and RoPE after them.
        def project(layer: DecoderLayer, x_BxTxD):
            h_BTxD = rms_norm(rows(x_BxTxD), layer.attn_norm, eps, dtype).reshape(b * t, d)
            return (rows(_matmul(h_BTxD, layer.wq, dtype, layer.bq), MODEL_AXIS).reshape(b, t, kv * g, e),
                    rows(_matmul(h_BTxD, layer.wk, dtype, layer.bk), MODEL_AXIS).reshape(b, t, kv, e),
                    rows(_matmul(h_BTxD, layer.wv, dtype, layer.bv), MODEL_AXIS).reshape(b, t, kv, e))

        def position(q_norm, k_norm, q, k, cos, sin):
            if q_norm is not None and k_norm is not None:
                q, k = rms_norm(q, q_norm, eps, dtype), rms_norm(k, k_norm, eps, dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            return (q * jnp.asarray(e ** -0.5, dtype)).reshape(b, t, kv, g, e), k

        q, k, v = _recompute(project, config)(self, x_BxTxD)
        q, k = _recompute(position, config)(self.q_norm, self.k_norm, q, k, cos, sin)
        return q, k, v

    def finish(self, x_BxTxD, attn_BxTxKxGxE, config: ModelConfig) -> Array:
        """Output projection and residual, then the SwiGLU MLP and residual."""
        b, t, d = x_BxTxD.shape
        dtype = config.compute_jnp_dtype
        x_BTxD = x_BxTxD.reshape(b * t, d) + rows(
            _matmul(rows(attn_BxTxKxGxE.reshape(b * t, -1).astype(dtype), MODEL_AXIS), self.wo, dtype))

        # Recomputed stretches (see `qkv`): the norm before gate/up, the activation before down.
        def gate_up(norm, w_gate, w_up, x_BTxD):
            h_BTxD = rms_norm(x_BTxD, norm, config.norm_eps, dtype)
            return rows(_matmul(h_BTxD, w_gate, dtype), MODEL_AXIS), rows(_matmul(h_BTxD, w_up, dtype), MODEL_AXIS)

        def down(w_down, gate_BTxF, up_BTxF):
            return rows(_matmul(_ACTIVATIONS[config.activation](gate_BTxF) * up_BTxF, w_down, dtype))

        gate_BTxF, up_BTxF = _recompute(gate_up, config)(self.mlp_norm, self.w_gate, self.w_up, x_BTxD)
        x_BTxD = x_BTxD + _recompute(down, config)(self.w_down, gate_BTxF, up_BTxF)
        return x_BTxD.reshape(b, t, d)
