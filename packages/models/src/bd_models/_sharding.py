"""Meshes and partition specs: FSDP over the embedding dim, tensor parallel over heads and the
MLP hidden dim, batches over (`data`, `fsdp`).

Axes that do not divide a dimension are dropped from its spec (that dimension is replicated),
so any model runs on any mesh; the test configs divide every axis.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._attention import BATCH_AXES, MODEL_AXIS

AXES = ("data", "fsdp", "model")

# Per parameter name (the last path entry): the axes of its dims after the stacked layer axis.
_SPECS = {
    "embedding": ("__none__", "fsdp"),
    "lm_head": ("fsdp", "__none__"),
    "final_norm": ("__none__",),
    "attn_norm": ("__none__",),
    "mlp_norm": ("__none__",),
    "wq": ("fsdp", MODEL_AXIS),
    "wk": ("fsdp", MODEL_AXIS),
    "wv": ("fsdp", MODEL_AXIS),
    "wo": (MODEL_AXIS, "fsdp"),
    "w_gate": ("fsdp", MODEL_AXIS),
    "w_up": ("fsdp", MODEL_AXIS),
    "w_down": (MODEL_AXIS, "fsdp"),
}


def make_mesh(data: int, fsdp: int, model: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (`data`, `fsdp`, `model`) mesh with Auto axis types (GSPMD propagates the shardings)."""
    devices = list(jax.devices() if devices is None else devices)
    if data * fsdp * model != len(devices):
        raise ValueError(f"make_mesh: data*fsdp*model = {data}*{fsdp}*{model} = {data * fsdp * model} must equal the "
                         f"number of devices ({len(devices)}); change the axis sizes or pass devices=")
    return jax.make_mesh((data, fsdp, model), AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def _name(path) -> str:
    last = path[-1]
    return str(getattr(last, "name", getattr(last, "key", last)))


def param_partition_specs(model, mesh: Mesh | None = None):
    """A pytree like `model` with a `PartitionSpec` per array. With `mesh`, axes that do not
    divide their dimension are left out."""

    def spec(path, leaf):
        name = _name(path)
        if name not in _SPECS:
            raise ValueError(f"param_partition_specs: no partition rule for parameter {jax.tree_util.keystr(path)}")
        axes = [None if a == "__none__" else a for a in _SPECS[name]]
        axes = [None] * (np.ndim(leaf) - len(axes)) + axes  # the stacked layer axis is never split
        if mesh is not None:
            axes = [a if a is None or np.shape(leaf)[i] % mesh.shape[a] == 0 else None for i, a in enumerate(axes)]
        return P(*axes)

    return jax.tree_util.tree_map_with_path(spec, model)


def shard_model(model, mesh: Mesh):
    """Place every parameter on `mesh` by `param_partition_specs`."""
    specs = param_partition_specs(model, mesh)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), model, specs)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def shard_batch(batch, mesh: Mesh):
    """Place every array of a batch pytree with its leading (batch) axis over (`data`, `fsdp`)."""
    n = mesh.shape["data"] * mesh.shape["fsdp"]

    def put(x):
        if np.ndim(x) == 0:
            return jax.device_put(x, NamedSharding(mesh, P()))
        if np.shape(x)[0] % n:
            raise ValueError(f"shard_batch: batch size {np.shape(x)[0]} does not divide by data*fsdp = {n}; "
                             f"use a batch size that is a multiple of {n}")
        return jax.device_put(x, batch_sharding(mesh))

    return jax.tree.map(put, batch)
