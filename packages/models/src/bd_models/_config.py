"""`ModelConfig`: the frozen, validated architecture of the block-diffusion decoder.

Every field is checked on construction; an error names the field, the value and the fix.
`head_dim` defaults (0) to d_model / n_heads; query groups are a property. The architecture options a
released checkpoint may need (per-head query/key RMSNorm as in Qwen3 and SDAR, q/k/v biases as in
Qwen2, an untied head, Llama-3 RoPE scaling, the activation) are off by default. `to_dict`/`from_dict`
round-trip plain JSON values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from bd_core import ConfigError, config_error

ATTENTION_IMPLS = ("dense", "blocked", "shard_map", "pallas", "splash")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("elementwise", "none", "full", "save_matmuls")
"""The values of `ModelConfig.remat`: what the backward pass recomputes per layer."""
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 RoPE frequency scaling (`rope_type = "llama3"` in a checkpoint's config): wavelengths
    longer than `original_max_position_embeddings / low_freq_factor` are divided by `factor`,
    shorter than `.../ high_freq_factor` kept, and the band between interpolated smoothly.

    Attributes:
        factor: what long wavelengths are divided by.
        low_freq_factor: sets where the long wavelengths begin.
        high_freq_factor: sets where the short (kept) wavelengths end.
        original_max_position_embeddings: the context length the model was trained at.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise config_error("RopeScaling", name, value, "a positive number")
        if not self.high_freq_factor > self.low_freq_factor:
            raise config_error("RopeScaling", "high_freq_factor", self.high_freq_factor,
                               f"greater than low_freq_factor={self.low_freq_factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder architecture. `attention` picks the implementation: `dense` (reference), `blocked`
    (online softmax over the key tiles the mask allows; O(T) memory) or `shard_map` (`blocked` per
    shard, batch over (`data`, `fsdp`), heads over `model`, on the mesh set with `jax.set_mesh`)
    or `pallas` (`blocked` as Pallas kernels, forward and backward: Triton on GPU, interpret mode
    on CPU, which is slow and meant for tests) or `splash` (TPU's splash kernels with each row's
    mask, per shard like `shard_map`; tiles multiples of 128; interpret mode on CPU).
    `remat` picks what the backward pass recomputes per layer: `elementwise` (the default: keep the
    matmul outputs and attention's, recompute the RMSNorms, the per-head q/k norms, RoPE and the
    MLP's gated activation from them, which costs less than saving and reloading their outputs),
    `none` (keep every activation), `full` (keep only each layer's input) or `save_matmuls` (keep
    the matmul outputs; recompute attention too).
    `logits_chunk` (0: off) makes the losses compute the logits `logits_chunk` positions of every
    row at a time, so that the whole `[B, T, V]` float32 logits are never held at once: SFT's and
    OPD's (`sum_logits`) with the head's gradient in the same pass, replay scoring's and GRPO's
    (`map_logits`) recomputed in the backward pass; the values and gradients are the same.
    `head_dim` (0: d_model / n_heads) may differ from d_model / n_heads, as in Qwen3. `qk_norm`
    adds a per-head RMSNorm on queries and keys before RoPE (Qwen3, SDAR); `qkv_bias` adds biases to
    the q/k/v projections (Qwen2); `rope_scaling` applies Llama-3 frequency scaling; `activation`
    is the MLP gate's (`silu`, `gelu` exact, `gelu_tanh`).

    Attributes:
        vocab_size: V, rows of the embedding (and of the untied head).
        d_model: D, the residual width.
        n_layers: L, decoder layers.
        n_heads: H, query heads.
        n_kv_heads: K, key/value heads; it divides `n_heads` (grouped-query attention).
        d_ff: F, the SwiGLU MLP's hidden width.
        block_size: b, tokens per block.
        rope_theta: RoPE's base.
        norm_eps: the RMSNorms' epsilon.
        param_dtype: the dtype weights are stored in (`float32` or `bfloat16`).
        compute_dtype: the dtype of activations and matmul operands.
        attention: the attention implementation (see above).
        tie_embeddings: the output head reuses the embedding matrix.
        q_tile: query tile of the blocked kernels.
        k_tile: key tile of the blocked kernels.
        remat: what the backward pass recomputes per layer (see above).
        head_dim: E, per-head width (0: `d_model // n_heads`).
        qk_norm: a per-head RMSNorm on queries and keys before RoPE.
        qkv_bias: biases on the q/k/v projections.
        rope_scaling: Llama-3 RoPE frequency scaling, or None.
        activation: the MLP gate's activation (`silu`, `gelu`, `gelu_tanh`).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    block_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    attention: str = "blocked"
    tie_embeddings: bool = True
    q_tile: int = 64
    k_tile: int = 64
    remat: str = "elementwise"
    logits_chunk: int = 0  # 0: the losses take the whole logits at once
    head_dim: int = 0  # 0: d_model // n_heads
    qk_norm: bool = False
    qkv_bias: bool = False
    rope_scaling: RopeScaling | None = None
    activation: str = "silu"

    def __post_init__(self):
        fail = lambda field, expected, fix=None: config_error(  # noqa: E731
            "ModelConfig", field, getattr(self, field), expected, fix)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "block_size",
                     "q_tile", "k_tile"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise fail(name, "a positive int")
        if self.head_dim == 0 and not isinstance(self.head_dim, bool):
            if self.d_model % self.n_heads:
                raise fail("d_model", f"a multiple of n_heads={self.n_heads}",
                           "choose d_model = n_heads * head_dim, or set head_dim")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 1:
            raise fail("head_dim", "a positive int (or 0 for d_model / n_heads)")
        if self.head_dim % 2:
            raise fail("head_dim", "an even number for RoPE", "change head_dim (or d_model / n_heads)")
        if self.n_heads % self.n_kv_heads:
            raise fail("n_kv_heads", f"a divisor of n_heads={self.n_heads}",
                       "grouped-query attention needs n_kv_heads to divide n_heads")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise fail(name, "a positive number")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPES:
                raise fail(name, f"one of {DTYPES}")
        if self.attention not in ATTENTION_IMPLS:
            raise fail("attention", f"one of {ATTENTION_IMPLS}")
        if self.attention == "pallas":
            for name in ("q_tile", "k_tile"):
                value = getattr(self, name)
                if value & (value - 1):
                    raise fail(name, "a power of two with attention='pallas'",
                               "Triton lowers only power-of-two shapes inside a kernel; pick 16, 32, 64 or 128")
        if self.attention == "splash":
            for name in ("q_tile", "k_tile"):
                if getattr(self, name) % 128:
                    raise fail(name, "a multiple of 128 with attention='splash'",
                               "TPU's lanes are 128 wide; set q_tile = k_tile = 128 (or 256, 512)")
        if self.remat not in REMAT_POLICIES:
            raise fail("remat", f"one of {REMAT_POLICIES}")
        if isinstance(self.logits_chunk, bool) or not isinstance(self.logits_chunk, int) or self.logits_chunk < 0:
            raise fail("logits_chunk", "an int >= 0", "use 0 to compute the logits at once")
        for name in ("tie_embeddings", "qk_norm", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise fail(name, "a bool")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise fail("rope_scaling", "None or a RopeScaling")
        if self.activation not in ACTIVATIONS:
            raise fail("activation", f"one of {ACTIVATIONS}")

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def params_jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def compute_jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict, as checkpoints and fingerprints store it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """The config `to_dict` wrote; unknown or missing fields raise `ConfigError` naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"ModelConfig: unknown field(s) {unknown}; known fields are {sorted(known)}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in data)
        if missing:
            raise ConfigError(f"ModelConfig: missing required field(s) {missing}; add them")
        # JSON (and canonical fingerprints) write 10000.0 as 10000: float fields take ints back.
        floats = {"rope_theta", "norm_eps"}
        kwargs: dict[str, Any] = {k: float(v) if k in floats and isinstance(v, int) and not isinstance(v, bool) else v
                                  for k, v in data.items()}
        if isinstance(kwargs.get("rope_scaling"), Mapping):
            kwargs["rope_scaling"] = RopeScaling(**kwargs["rope_scaling"])
        return cls(**kwargs)
