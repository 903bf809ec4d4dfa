"""`ModelConfig`: the frozen, validated architecture of the block-diffusion decoder.

Every field is checked on construction; an error names the field, the value and the fix. Derived
sizes (head_dim, query groups) are properties. `to_dict`/`from_dict` round-trip plain JSON values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

ATTENTION_IMPLS = ("dense", "blocked", "shard_map")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "save_matmuls")


class ConfigError(ValueError):
    """A model config field with an invalid value."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder architecture. `attention` picks the implementation: `dense` (reference), `blocked`
    (online softmax over the key tiles the mask allows; O(T) memory) or `shard_map` (`blocked` per
    shard, batch over (`data`, `fsdp`), heads over `model`, on the mesh set with `jax.set_mesh`).
    `remat` picks what the backward pass recomputes per layer: `none` (keep every activation),
    `full` (keep only each layer's input) or `save_matmuls` (keep the matmul outputs)."""

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
    remat: str = "none"

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "block_size",
                     "q_tile", "k_tile"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ModelConfig.{name}: expected a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"ModelConfig.d_model: {self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"choose d_model = n_heads * head_dim"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"ModelConfig.d_model: head_dim = d_model / n_heads = {self.head_dim} must be even for RoPE; "
                f"change d_model or n_heads"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"ModelConfig.n_kv_heads: n_heads={self.n_heads} is not a multiple of n_kv_heads="
                f"{self.n_kv_heads}; grouped-query attention needs n_kv_heads to divide n_heads"
            )
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"ModelConfig.{name}: expected a positive number, got {value!r}")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(f"ModelConfig.{name}: expected one of {DTYPES}, got {getattr(self, name)!r}")
        if self.attention not in ATTENTION_IMPLS:
            raise ConfigError(f"ModelConfig.attention: expected one of {ATTENTION_IMPLS}, got {self.attention!r}")
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"ModelConfig.remat: expected one of {REMAT_POLICIES}, got {self.remat!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"ModelConfig.tie_embeddings: expected a bool, got {self.tie_embeddings!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

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
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"ModelConfig: unknown field(s) {unknown}; known fields are {sorted(known)}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in data)
        if missing:
            raise ConfigError(f"ModelConfig: missing required field(s) {missing}")
        # JSON (and canonical fingerprints) write 10000.0 as 10000: float fields take ints back.
        floats = {"rope_theta", "norm_eps"}
        return cls(**{k: float(v) if k in floats and isinstance(v, int) and not isinstance(v, bool) else v
                      for k, v in data.items()})
