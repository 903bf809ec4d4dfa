"""`ModelConfig`: the frozen, validated architecture of the block-diffusion decoder.

Every field is checked on construction; an error names the field, the value and the fix. Derived
sizes (head_dim, query groups) are properties. `to_dict`/`from_dict` round-trip plain JSON values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from bd_core import ConfigError, config_error

ATTENTION_IMPLS = ("dense", "blocked", "shard_map")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "save_matmuls")


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
        fail = lambda field, expected, fix=None: config_error(  # noqa: E731
            "ModelConfig", field, getattr(self, field), expected, fix)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "block_size",
                     "q_tile", "k_tile"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise fail(name, "a positive int")
        if self.d_model % self.n_heads:
            raise fail("d_model", f"a multiple of n_heads={self.n_heads}", "choose d_model = n_heads * head_dim")
        if self.head_dim % 2:
            raise fail("d_model", f"head_dim = d_model / n_heads to be even for RoPE (it is {self.head_dim})",
                       "change d_model or n_heads")
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
        if self.remat not in REMAT_POLICIES:
            raise fail("remat", f"one of {REMAT_POLICIES}")
        if not isinstance(self.tie_embeddings, bool):
            raise fail("tie_embeddings", "a bool")

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
            raise ConfigError(f"ModelConfig: missing required field(s) {missing}; add them")
        # JSON (and canonical fingerprints) write 10000.0 as 10000: float fields take ints back.
        floats = {"rope_theta", "norm_eps"}
        kwargs: dict[str, Any] = {k: float(v) if k in floats and isinstance(v, int) and not isinstance(v, bool) else v
                                  for k, v in data.items()}
        return cls(**kwargs)
