"""LoRA: low-rank adapters on the decoder's projections, for Equinox (no Flax library needed).

An adapted projection is a `LoRAWeight` in the place of its matrix: `y = x W + s · drop(x) A B`
with `W [in, out]` frozen, `A [in, r]`, `B [r, out]`, `s = alpha / r`. `B` starts at zero, so an
adapted model starts equal to its base, bit for bit (`x A B` is exactly 0). The decoder's layers
are stacked, so every array carries the leading layer axis `L` and the scan slices it.

- `add_lora(model, config, key=)` wraps the configured targets; `trainable_filter(model)` is the
  `eqx.partition` filter the trainer differentiates and the optimizer updates: the `lora_a` /
  `lora_b` leaves when a model has adapters, every inexact array otherwise. The base is frozen
  by that filter, so gradients, optimizer state, accumulation and checkpoints cover adapters only.
- `base_model(model)` is the base with adapters switched off (the same arrays, no copy): GRPO's
  reference policy.
- `merge(model)` folds `s · A B` into `W` (in float32, rounded once to `W`'s dtype), for export.
- Adapters are float32 whatever the base's dtype (they are small, and AdamW on bfloat16 low-rank
  factors loses the update); the matmuls run in the compute dtype. On a mesh they are sharded
  like their base matrix: `A` over its input axis, `B` over its output axis (`param_partition_specs`).
- Dropout (`LoRAConfig.dropout`) acts on the adapter's input only, when a training loss sets
  keys with `with_dropout_keys`; without keys (sampling, scoring, evaluation) it is off.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from bd_core import ConfigError, config_error

from ._sharding import _place, leaf_name, param_partition_specs

Array = jax.Array

TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
"""The projections LoRA may adapt: attention (`wq`, `wk`, `wv`, `wo`) and MLP (`w_gate`, `w_up`, `w_down`)."""
ADAPTER_LEAVES = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """`rank` r, `alpha` (the update is scaled by alpha / r), the projections to adapt (any of
    `TARGETS`: attention `wq wk wv wo`, MLP `w_gate w_up w_down`) and input `dropout`.

    Attributes:
        rank: r, the adapters' rank.
        alpha: the update is scaled by alpha / rank.
        targets: the projections that get adapters (names of `TARGETS`).
        dropout: dropout on the adapters' input while training.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("wq", "wk", "wv", "wo")
    dropout: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise config_error("LoRAConfig", "rank", self.rank, "an integer >= 1", "use e.g. 8 or 16")
        if not self.alpha > 0:
            raise config_error("LoRAConfig", "alpha", self.alpha, "a value > 0", "use e.g. 2 * rank")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise config_error("LoRAConfig", "targets", list(self.targets),
                               f"distinct names from {list(TARGETS)}", "e.g. ['wq', 'wk', 'wv', 'wo']")
        if not 0.0 <= self.dropout < 1.0:
            raise config_error("LoRAConfig", "dropout", self.dropout, "a value in [0, 1)", "use 0 to turn it off")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict, as checkpoints store it."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "dropout": self.dropout}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LoRAConfig:
        """From `to_dict()`'s values, also after a JSON round trip (which may turn 16.0 into 16)."""
        return cls(rank=int(values["rank"]), alpha=float(values["alpha"]), targets=tuple(values["targets"]),
                   dropout=float(values.get("dropout", 0.0)))


class LoRAWeight(eqx.Module):
    """A frozen matrix `base [.., in, out]` with its adapter `lora_a [.., in, r]`, `lora_b [.., r, out]`.

    Attributes:
        base: the frozen matrix `[.., in, out]`.
        lora_a: the adapter's down projection `[.., in, r]`.
        lora_b: the adapter's up projection `[.., r, out]` (zero at start).
        scale: alpha / rank (static).
        dropout: input dropout while training (static).
        dropout_key: the dropout key, set inside a training loss only.
    """

    base: Array
    lora_a: Array
    lora_b: Array
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True, default=0.0)
    dropout_key: Array | None = None  # set by `with_dropout_keys` inside a training loss only

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    def delta(self) -> Array:
        """`s · A B` in float32, `[.., in, out]`."""
        return self.scale * jnp.matmul(self.lora_a.astype(jnp.float32), self.lora_b.astype(jnp.float32))


def lora_matmul(x: Array, w: LoRAWeight, dtype) -> Array:
    """`x [rows, in] @ base + s · (drop(x) @ A) @ B`, every product in `dtype`."""
    y = jnp.dot(x, w.base.astype(dtype), preferred_element_type=dtype)
    if w.dropout_key is not None and w.dropout > 0:
        keep = jax.random.bernoulli(w.dropout_key, 1.0 - w.dropout, x.shape)
        x = jnp.where(keep, x / jnp.asarray(1.0 - w.dropout, dtype), jnp.zeros((), dtype))
    low = jnp.dot(x, w.lora_a.astype(dtype), preferred_element_type=dtype)
    return y + jnp.asarray(w.scale, dtype) * jnp.dot(low, w.lora_b.astype(dtype), preferred_element_type=dtype)


def _is_lora(x: Any) -> bool:
    return isinstance(x, LoRAWeight)


def has_adapters(model: Any) -> bool:
    """Whether any weight of `model` is a `LoRAWeight`."""
    return any(_is_lora(x) for x in jax.tree_util.tree_leaves(model, is_leaf=_is_lora))


def add_lora(model: Any, config: LoRAConfig, *, key: Array) -> Any:
    """`model` with each target projection of its layers wrapped in a `LoRAWeight`: `A` drawn
    uniform in ±1/sqrt(in) (PEFT's default), `B` zero. On a mesh (the base's arrays sharded),
    the adapters are placed by `param_partition_specs`. A model that already has adapters is
    refused: merge them first.

    Example:
        ```python
        import jax
        from bd_models import BlockDiffusionLM, LoRAConfig, ModelConfig, add_lora, count_params, merge

        config = ModelConfig(vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=256,
                             block_size=4)
        model = add_lora(BlockDiffusionLM(config, key=jax.random.key(0)), LoRAConfig(rank=4), key=jax.random.key(1))
        counts = count_params(model)
        assert counts["trained"] < counts["total"]  # only the adapters train
        plain = merge(model)  # a BlockDiffusionLM without adapters, the same logits
        ```
    """
    if has_adapters(model):
        raise ValueError("add_lora: the model already has adapters; merge(model) them first, or use base_model(model)")
    layers = model.layers
    keys = jax.random.split(key, len(config.targets))
    wrapped = {}
    for name, k in zip(config.targets, keys):
        base = getattr(layers, name)
        *lead, n_in, n_out = base.shape
        a = jax.random.uniform(k, (*lead, n_in, config.rank), jnp.float32, -1.0, 1.0) * n_in ** -0.5
        b = jnp.zeros((*lead, config.rank, n_out), jnp.float32)
        wrapped[name] = LoRAWeight(base, a, b, config.scale, config.dropout)
    names = list(wrapped)
    layers = eqx.tree_at(lambda layer: [getattr(layer, n) for n in names], layers, [wrapped[n] for n in names])
    adapted = eqx.tree_at(lambda m: m.layers, model, layers)
    return _place_like_base(adapted)


def _place_like_base(model: Any) -> Any:

    mesh = next((leaf.sharding.mesh for leaf in jax.tree_util.tree_leaves(model)
                 if isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding)), None)
    if mesh is None:
        return model
    specs = param_partition_specs(model, mesh)

    def place(path, x, spec):
        if leaf_name(path) not in ADAPTER_LEAVES:
            return x
        return _place(x, jax.sharding.NamedSharding(mesh, spec), np.shape(x))

    return jax.tree_util.tree_map_with_path(place, model, specs)


def _is_float(x: Any) -> bool:
    """A floating array, or the `jax.ShapeDtypeStruct` of one (an `eqx.filter_eval_shape` target)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jnp.issubdtype(x.dtype, jnp.inexact)
    return eqx.is_inexact_array(x)


def trainable_filter(model: Any) -> Any:
    """The `eqx.partition` filter of what trains: adapter leaves when the model has adapters,
    every floating array otherwise (shape-dtype structs of them too, for restore targets)."""
    if not has_adapters(model):
        return jax.tree_util.tree_map(_is_float, model)
    return jax.tree_util.tree_map_with_path(lambda path, x: _is_float(x) and leaf_name(path) in ADAPTER_LEAVES,
                                            model)


def trainable(model: Any) -> Any:
    """The trained arrays of `model` (None elsewhere)."""
    return eqx.filter(model, trainable_filter(model))


def _map_lora(fn, model: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: fn(x) if _is_lora(x) else x, model, is_leaf=_is_lora)


def base_model(model: Any) -> Any:
    """The base with adapters switched off: the same arrays, no copy."""
    return _map_lora(lambda w: w.base, model)


def merge(model: Any) -> Any:
    """Adapters folded into their base matrices, `W + s · A B` (float32, then `W`'s dtype); a
    model without adapters is returned as it is.

    One matrix at a time, each finished before the next begins: op by op and dispatched
    asynchronously, the float32 copies of every stacked `[L, in, out]` matrix piled up (on a TPU
    chip the merge of a 1.7B model peaked 4.5 GiB above the merged weights it made); now at most
    the product `s · A B` of one matrix (two float32 copies of it while it is scaled) is live
    beside the merged weights. The bits are the op-by-op formula's: the product and its scaling
    are the same operations as before, and the sum and rounding one program whose conversions are
    exact (fused into one program, the scaling and the sum became a fused multiply-add, which
    rounds otherwise). Each result keeps its base's sharding."""
    return _map_lora(_merged, model)


def _merged(w: LoRAWeight) -> Array:
    sharding = w.base.sharding if isinstance(getattr(w.base, "sharding", None), jax.sharding.NamedSharding) else None
    return jax.block_until_ready(_add(w.base, w.delta(), sharding=sharding))


@functools.partial(jax.jit, static_argnames=("sharding",))
def _add(base: Array, delta: Array, *, sharding: jax.sharding.NamedSharding | None) -> Array:
    """`base + delta` in float32, rounded once to `base`'s dtype."""
    out = (base.astype(jnp.float32) + delta).astype(base.dtype)
    return out if sharding is None else jax.lax.with_sharding_constraint(out, sharding)


def with_dropout_keys(model: Any, key: Array) -> Any:
    """`model` with a fresh dropout key per adapted projection and layer (adapters with dropout
    only); a training loss calls it with its microbatch key."""
    weights = [x for x in jax.tree_util.tree_leaves(model, is_leaf=_is_lora) if _is_lora(x) and x.dropout > 0]
    if not weights:
        return model
    keys = iter(jax.random.split(key, len(weights)))

    def set_key(w: LoRAWeight) -> LoRAWeight:
        if w.dropout <= 0:
            return w
        lead = w.base.shape[:-2]
        k = next(keys)
        return dataclasses.replace(w, dropout_key=jax.random.split(k, lead) if lead else k)

    return _map_lora(set_key, model)


def count_params(model: Any) -> dict[str, int]:
    """`{"trained": ..., "total": ...}` parameter counts (adapters count in both)."""
    spec = trainable_filter(model)
    sizes = lambda tree: sum(int(np.prod(np.shape(x))) for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
    return {"trained": sizes(eqx.filter(model, spec)), "total": sizes(eqx.filter(model, _is_float))}


@jax.jit
def _checksums(x: Array) -> Array:
    """Two order-sensitive 32-bit sums of an array's bit patterns (wrapping arithmetic)."""
    bits = jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]).astype(jnp.uint32)
    flat = bits.reshape(-1)
    index = jnp.arange(flat.shape[0], dtype=jnp.uint32)
    mixed = flat * (index * jnp.uint32(2654435761) + jnp.uint32(1)) ^ (flat >> 7)
    return jnp.stack([jnp.sum(flat, dtype=jnp.uint32), jnp.sum(mixed, dtype=jnp.uint32)])


def weights_digest(model: Any) -> str:
    """A digest of the base weights (adapters excluded): every frozen array's path, shape, dtype
    and two order-sensitive checksums of its bits, hashed with SHA-256. Computed on the devices
    that hold the arrays (sharded arrays included, on any number of processes), so any changed
    element changes it with overwhelming probability at the cost of one pass over the weights."""
    frozen = base_model(model)
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(eqx.filter(frozen, eqx.is_inexact_array))[0]:
        if leaf.dtype.itemsize not in (2, 4):
            raise ConfigError(f"weights_digest: {jax.tree_util.keystr(path)} has dtype {leaf.dtype}; "
                              "only 16- and 32-bit weights are digested")
        sums = np.asarray(jax.device_get(_checksums(leaf)))
        h.update(f"{jax.tree_util.keystr(path)}{tuple(leaf.shape)}{leaf.dtype}{sums.tolist()}".encode())
    return h.hexdigest()
