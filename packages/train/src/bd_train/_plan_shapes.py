"""Shapes for ahead-of-time plans: the pipeline's batches as `jax.ShapeDtypeStruct`s, placed on a
mesh as the stages place arrays (weights by their partition specs, optimizer moments like their
weights, batches over the data axes), and the preset's run made without weights, data or, for a
pretrained folder that holds only config.json, a tokenizer file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bd_core import DiffusionTokenBatch, ViewLayout
from bd_models import (
    BlockDiffusionLM,
    MeshError,
    ModelConfig,
    add_lora,
    batch_sharding,
    check_divisibility,
    param_partition_specs,
)


def sds(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> Any:
    """A shape (placed with `sharding`, if given), typed `Any`: it stands where the contracts hold arrays."""
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)


def _layout(rows: int, length: int) -> ViewLayout:
    ints = [sds((rows, length), jnp.int32) for _ in range(4)]
    return ViewLayout(ints[0], ints[1], ints[2], ints[3], sds((rows, length), jnp.bool_))


def diffusion_batch(rows: int, length: int) -> DiffusionTokenBatch:
    """A `DiffusionTokenBatch` of `rows` x `length` as shapes (the data pipelines' dtypes)."""
    return DiffusionTokenBatch(_layout(rows, length), sds((rows, length), jnp.int32),
                               sds((rows, length), jnp.float32), sds((rows, length), jnp.float32))


def place_batch(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Shapes with the data pipelines' placement: leading axis over (`data`, `fsdp`); a shape that
    has a sharding already (OPD's teacher logits: `logits_format`) keeps it, and its layout."""
    return jax.tree.map(lambda x: x if getattr(x, "sharding", None) is not None else jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=batch_sharding(mesh) if x.ndim else NamedSharding(mesh, P())), tree)


def place_state(tree: Any, model: Any, mesh: jax.sharding.Mesh) -> Any:
    """Shapes of `tree` (a model, or a train state holding `model`) with the stages' placement:
    every weight by `param_partition_specs`, every optimizer moment or accumulated gradient like
    the weight it mirrors (found by path), anything else replicated."""
    specs = jax.tree_util.tree_flatten_with_path(param_partition_specs(model, mesh),
                                                 is_leaf=lambda x: isinstance(x, P))[0]
    shapes = {tuple(path): leaf.shape for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]}
    by_path = {tuple(path): spec for path, spec in specs}

    def place(path, leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        spec = P()
        for start in range(len(path)):
            suffix = tuple(path[start:])
            if suffix in by_path and shapes[suffix] == leaf.shape:
                spec = by_path[suffix]
                break
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, tree)


def bytes_per_chip(tree: Any) -> int:
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
            total += int(np.prod(shape, dtype=np.int64)) * leaf.dtype.itemsize  # a key dtype has one too
    return total


def model_maker(run: Any, role: str, stage: str, layers: int | None = None) -> Callable[[], Any]:
    """What `stage` trains or runs for `role`, to build under `eval_shape`: the model, with fresh
    LoRA adapters where `[role] lora` names the stage; with `layers` decoder layers instead of the
    model's own (the cost twins that a plan extrapolates from)."""
    config, lora = run.model_config(role), run.lora(role, stage)
    if layers is not None:
        config = dataclasses.replace(config, n_layers=layers)

    def make():
        model = BlockDiffusionLM(config, key=jax.random.key(0))
        return model if lora is None else add_lora(model, lora, key=jax.random.key(1))

    return make


def check_rows(config: ModelConfig, mesh: jax.sharding.Mesh, key: str, rows: int, microbatches: int) -> None:
    """Each microbatch's rows split over the mesh's `data` x `fsdp` chips (refused naming the
    preset key, as the preset's own mesh is at load), then `check_divisibility` of the model."""
    chips = mesh.shape["data"] * mesh.shape["fsdp"]
    if (rows // microbatches) % chips:
        raise MeshError(f"{key} = {rows} in {microbatches} microbatch(es) gives {rows // microbatches} rows per "
                        f"microbatch, which the mesh's data x fsdp = {chips} chips must divide")
    check_divisibility(config, mesh)
