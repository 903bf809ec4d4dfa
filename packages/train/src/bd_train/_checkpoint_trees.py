"""A train state's arrays as nested dicts keyed by path names: what a checkpoint stores (`arrays_of`),
compares leaf by leaf (`flat`, `describe`) and restores into (`restore_target`, `fill`, `fill_trained`).
Path names keep checkpoints portable across pytree classes and are what a mismatch reports."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from bd_models import trainable, trainable_filter

if TYPE_CHECKING:
    from ._trainer import TrainState


def _key_name(entry: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _is_leaf_array(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def nested(tree: Any) -> dict:
    """Array leaves of any pytree as nested dicts keyed by path names (portable across pytree
    classes, and the names a mismatch reports)."""
    out: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(eqx.filter(tree, _is_leaf_array))[0]:
        node = out
        names = [_key_name(p) for p in path]
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1] if names else "value"] = leaf
    return out


def flat(nested: Mapping, prefix: str) -> dict[str, Any]:
    out = {}
    for key, value in nested.items():
        path = f"{prefix}/{key}"
        out.update(flat(value, path) if isinstance(value, Mapping) else {path: value})
    return out


def fill(tree: Any, nested: Mapping) -> Any:
    """Replace the array leaves of `tree` by the same-path entries of `nested`."""

    def pick(path, leaf):
        if not _is_leaf_array(leaf):
            return leaf
        node: Any = nested
        for name in [_key_name(p) for p in path] or ["value"]:
            node = node[name]
        return node

    return jax.tree_util.tree_map_with_path(pick, tree)


def is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def fill_trained(model: Any, nested: Mapping) -> Any:
    """`model` with its trained leaves replaced by the same-path entries of `nested`; a LoRA
    model's frozen base is kept as it is."""
    spec = trainable_filter(model)
    return eqx.combine(fill(eqx.filter(model, spec), nested), eqx.filter(model, spec, inverse=True))


def arrays_of(state: TrainState) -> dict[str, Any]:
    key = state.key
    return {
        "model": nested(trainable(state.model)),  # a LoRA model: its adapters only
        "opt_state": nested(state.opt_state),
        "rng": {"key": jax.eval_shape(jax.random.key_data, key)
                if isinstance(key, jax.ShapeDtypeStruct) and is_key(key)
                else jax.random.key_data(key) if is_key(key) else key},
        "counters": {"step": state.step, "nonfinite_total": state.nonfinite_total,
                     "nonfinite_streak": state.nonfinite_streak},
    }


def restore_target(x: Any, mesh: jax.sharding.Mesh | None = None) -> jax.ShapeDtypeStruct:
    """The restore target of a leaf: its own sharding; with `mesh` (the target's parameters are
    sharded over it), leaves that sit on one device (step counters, optimizer counts, the key)
    are restored replicated over the mesh instead, so that jitted steps across processes accept
    them."""
    sharding = getattr(x, "sharding", None)
    if mesh is not None and not isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def mesh_of(tree: Any) -> jax.sharding.Mesh | None:
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(sharding.mesh, jax.sharding.Mesh):
            return sharding.mesh
    return None


def flat_items(items: Mapping[str, Any]) -> dict[str, Any]:
    return {path: leaf for name, tree in items.items() for path, leaf in flat(tree, name).items()}


def describe(shape: Any, dtype: Any) -> str:
    return f"{tuple(shape)} {jnp.dtype(dtype).name}"
